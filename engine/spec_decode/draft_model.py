"""The draft-model proposer: a smaller model of the target's tokenizer and vocabulary, in the same process on
the same device, proposes each speculating sequence's next k tokens and the distributions q it drew them from.

KV cache. The draft has its own K/V tensors (its own layers, heads and head size), with as many blocks as the
target's, indexed by the same block tables: block b holds the target's K/V of its tokens in the target's
cache and the draft's K/V of the same tokens in the draft's cache, and a block's bytes (what sizes the pool)
are both models'. So the block manager accounts for the draft's KV with no second pool; swapping and
copy-on-write copy both caches (engine/runner/model_runner.py), and the block manager's trimming after a
rejection frees both.

What the draft has seen. A sequence's draft K/V are valid for its first `num_draft_computed` tokens
(engine/sequence.py). The draft does not follow the target's prefill: it catches up when the sequence next
speculates, over every token it has not seen, in forwards of at most max_num_batched_tokens tokens (chunked
like the target's prefill), then runs one decode forward per further draft token. A rejection takes
num_draft_computed back to the target's computed tokens (engine/scheduler.py), a recompute preemption to 0.
A sequence with a prefix-cache hit starts at 0 as well: a cached block may hold a finished sequence's tokens
the draft never saw, so the draft recomputes the prefix, writing into shared blocks the K/V of the very
tokens they hold (what a stale draft entry could cost is acceptance, never output: the target verifies).

Start-up. The draft is a LoadedModel (engine/runner/loaded_model.py) like the runner: its kernels compile,
its largest catch-up forward and proposal run in the memory profile that sizes the block pool (with its
draft distributions held through the model's forward, as in a verify step), and its decode forwards (+ lm_head)
are captured as CUDA graphs per bucketed batch size (engine/runner/cuda_graphs.py), up to the batch size
speculation stops at, with the model's and under the same conditions (a CUDA device, a backend that
supports them, no --enforce-eager). A catch-up of one token a sequence replays them too; longer catch-ups
run eagerly.

Proposing. The k draft tokens stay on the device while they are drawn: each decode forward reads the token
drawn before it there (a graph's `fill`), and the host reads them all once, at the end. A request whose
sampling reads its output tokens (penalties) is the exception: the processing of draft position i needs
draft tokens 0..i-1 on the host, so such a round reads each position's tokens as it is drawn.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.config import EngineConfig
from engine.loader import read_hf_config
from engine.runner.loaded_model import PROFILE_PARAMS, LoadedModel
from engine.runner.step_inputs import attention_metadata, upload
from engine.sampler import SamplerRow
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.spec_decode.rejection import verify_row


def check_draft_vocabulary(draft_dir: str, target_vocab_size: int, target_tokenizer, draft_tokenizer) -> None:
    """Raise ValueError (one line) unless the draft's vocabulary and tokenizer are the target's: the draft's
    token ids must mean the same tokens. Tokenizers are compared where both directories have one."""
    draft_vocab = read_hf_config(draft_dir)["vocab_size"]
    if draft_vocab != target_vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {draft_dir} has vocab_size {draft_vocab}, the model "
            f"{target_vocab_size}; a draft must share the model's tokenizer and vocabulary"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.hf.get_vocab() != draft_tokenizer.hf.get_vocab():
            raise ValueError(
                f"speculative_config: the draft model {draft_dir} has another tokenizer than the model "
                "(their vocabularies differ); a draft must share the model's tokenizer and vocabulary"
            )


class DraftModel(LoadedModel):
    """The draft model, its attention backend, KV cache (in the model's dtype, whatever the served model's
    cache holds), sampler and decode graphs."""

    def __init__(self, config: EngineConfig, model_dir: str, eos_token_ids: frozenset[int]):
        # Never the flash-attn-4 prompt path: the draft's prompts are catch-up chunks.
        super().__init__(config, model_dir, eos_token_ids, what="the draft model", kv_dtype=config.torch_dtype)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        self.max_batch = spec.disable_by_batch_size  # no step speculates for more sequences than this
        # Row indices 0..n-1 for a graph replay's device-side tokens, made once (not a launch per draft step).
        self._rows = torch.arange(self.max_batch, device=self.device)

    def capture_cuda_graphs(self, max_batch: int, max_model_len: int) -> None:
        """The decode graphs, for batches up to `max_batch` (the model's) or the most sequences that speculate."""
        self.capture_decode_graphs(min(max_batch, self.max_batch), max_model_len)

    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, num_seqs: int) -> torch.Tensor:
        """The memory profile's part of the draft: its largest catch-up forward (`num_tokens` dummy tokens of
        `num_seqs` sequences), then a proposal of k sampled tokens for as many of them as may speculate.
        Returns the draft distributions, which the caller holds through its forward as a verify step does."""
        num_rows = min(num_seqs, self.max_batch)
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        hidden = self.dummy_forward(lens)
        logits = self.model.compute_logits(hidden[:num_rows])
        del hidden
        rows = [SamplerRow(PROFILE_PARAMS, i, [0] * 8, [1] * 8) for i in range(num_rows)]
        q = [self.sampler.propose(logits, rows)[1] for _ in range(self.k)]
        return torch.cat(q)

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSeq]) -> tuple[list[list[int]], dict[int, torch.Tensor | None]]:
        """The draft model's tokens for each item (scheduled with len(item.draft) placeholder tokens), which
        the scheduler records (Scheduler.drafted), and per seq_id the distributions q they were drawn from
        ([k, vocab]; None for a greedy request, whose draft is the draft model's argmax)."""
        seqs = [item.seq for item in items]
        ks = [len(item.draft) for item in items]
        ends = [len(seq.token_ids) for seq in seqs]  # every token is known: a speculating sequence has none pending
        logits = self._catch_up(seqs, ends)
        # Host copies of the draft tokens drawn so far, kept up to date only where the rows need them.
        on_host = any(seq.request.params.reads_output_tokens for seq in seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        drawn: list[tuple[list[int], torch.Tensor]] = []  # per draft position: its sequences, their tokens
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for i in range(max(ks)):
            rows = [verify_row(seqs[j], drafts[j], i) for j in active]  # drafted as the target will check it
            tokens, q = self.sampler.propose(logits, rows)
            drawn.append((active, tokens))
            if on_host:
                for j, token in zip(active, tokens.tolist()):
                    drafts[j].append(token)
            for r, j in enumerate(active):
                if not rows[r].params.greedy:
                    probs[j].append(q[r])
            still = [r for r, j in enumerate(active) if ks[j] > i + 1]
            if not still:
                break
            if len(still) < len(active):
                tokens = tokens[upload(np.array(still), self.device)]
            active = [active[r] for r in still]
            # The draft token just drawn, at its position (the sequence's i-th after its last one).
            positions = np.array([ends[j] + i for j in active], dtype=np.int64)
            logits = self._decode(tokens, positions, [seqs[j].block_table for j in active])
        if not on_host:  # one read of every position's tokens
            flat = torch.cat([tokens for _, tokens in drawn]).tolist()
            offset = 0
            for active, _ in drawn:
                for j, token in zip(active, flat[offset : offset + len(active)]):
                    drafts[j].append(token)
                offset += len(active)
        return drafts, {seq.seq_id: torch.stack(q) if q else None for seq, q in zip(seqs, probs)}

    def _decode(self, tokens: torch.Tensor, positions: np.ndarray, tables: list[list[int]]) -> torch.Tensor:
        """The logits after one-token forwards of `tokens` (on the device) at `positions`: a graph replay where
        one was captured for the batch, else eager."""
        n = len(positions)
        if self.graphs is not None and self.graphs.fits(n):
            fill = (self._rows[:n], tokens)
            return self.graphs.run(np.zeros(n, dtype=np.int64), positions, tables, fill)
        meta = attention_metadata(self.backend, self.block_size, self.device, [1] * n, positions, tables)
        return self.model.compute_logits(self.model(tokens, upload(positions, self.device), meta))

    def _catch_up(self, seqs: list[Sequence], ends: list[int]) -> torch.Tensor:
        """Run the draft over each sequence's tokens it has not seen, through its last one, in forwards of at
        most max_num_batched_tokens tokens; the logits after each sequence's last token [S, vocab]."""
        starts = [min(seq.num_draft_computed, end - 1) for seq, end in zip(seqs, ends)]
        if all(end - start == 1 for start, end in zip(starts, ends)) and self.graphs is not None:
            # One token each, the usual case after a round whose drafts were all accepted: a decode step, so a
            # graph replay where one fits (an eager decode would also compile kernel variants while serving).
            n = len(seqs)
            if self.graphs.fits(n):
                token_ids = np.concatenate([seq.token_array(end - 1, end) for seq, end in zip(seqs, ends)])
                positions = np.array(ends, dtype=np.int64) - 1
                return self.graphs.run(token_ids, positions, [seq.block_table for seq in seqs])
        last: list[torch.Tensor | None] = [None] * len(seqs)
        pending = [(j, start, end) for j, (start, end) in enumerate(zip(starts, ends))]
        while pending:
            budget, chunk, rest = self.max_num_batched_tokens, [], []
            for j, start, end in pending:
                n = min(end - start, budget)
                if n:
                    chunk.append((j, start, n))
                    budget -= n
                if start + n < end:
                    rest.append((j, start + n, end))
            token_ids = np.concatenate([seqs[j].token_array(start, start + n) for j, start, n in chunk])
            positions = np.concatenate([np.arange(start, start + n, dtype=np.int64) for _, start, n in chunk])
            num_new = [n for _, _, n in chunk]
            hidden = self._forward(token_ids, positions, num_new, [seqs[j].block_table for j, _, _ in chunk])
            for (j, start, n), row in zip(chunk, np.cumsum(num_new) - 1):
                if start + n == ends[j]:
                    last[j] = hidden[int(row)]
            pending = rest
        return self.model.compute_logits(torch.stack(last))

    def _forward(
        self, token_ids: np.ndarray, positions: np.ndarray, num_new: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        meta = attention_metadata(self.backend, self.block_size, self.device, num_new, positions, tables)
        return self.model(upload(token_ids, self.device), upload(positions, self.device), meta)
