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

The draft runs eagerly (no CUDA graphs for its decode yet).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.attention import select_backend
from engine.config import EngineConfig
from engine.layers.linear import can_prepack, prepack_linears
from engine.loader import head_dim_of, load_model, read_hf_config
from engine.runner.kv_cache import KVCache
from engine.runner.step_inputs import attention_metadata, upload
from engine.sampler import Sampler
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.spec_decode.rejection import verify_row

log = logging.getLogger("pagoda.spec_decode")


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


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class DraftModel:
    """The draft model, its attention backend, KV cache and sampler."""

    def __init__(self, config: EngineConfig, model_dir: str, eos_token_ids: frozenset[int]):
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        dtype = config.torch_dtype
        self.backend = select_backend(
            config.attention_backend,
            self.device,
            dtype,
            config.block_size,
            head_dim_of(read_hf_config(model_dir)),
            0,  # never the flash-attn-4 prompt path: the draft's prompts are catch-up chunks
            config.max_num_batched_tokens,
        )
        start = time.perf_counter()
        self.model, _ = load_model(model_dir, dtype, self.device, "auto", config.seed, self.backend)
        log.info("draft model %s loaded in %.1f s", model_dir, time.perf_counter() - start)
        mc = self.model.config
        self.sampler = Sampler(mc.vocab_size, eos_token_ids, self.device)
        self.kv_cache = KVCache(
            self.model.attention_layers(), config.block_size, mc.num_kv_heads, mc.head_dim, dtype, self.device
        )
        if can_prepack(dtype, self.device):
            prepack_linears(self.model)

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSeq]) -> tuple[list[list[int]], dict[int, torch.Tensor | None]]:
        """The draft model's tokens for each item (scheduled with len(item.draft) placeholder tokens), which
        the scheduler records (Scheduler.drafted), and per seq_id the distributions q they were drawn from
        ([k, vocab]; None for a greedy request, whose draft is the draft model's argmax)."""
        seqs = [item.seq for item in items]
        ks = [len(item.draft) for item in items]
        ends = [len(seq.token_ids) for seq in seqs]  # every token is known: a speculating sequence has none pending
        logits = self.model.compute_logits(self._catch_up(seqs, ends))
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for i in range(max(ks)):
            rows = [verify_row(seqs[j], drafts[j], i) for j in active]  # drafted as the target will check it
            tokens, q = self.sampler.propose(logits, rows)
            for r, (j, token) in enumerate(zip(active, tokens.tolist())):
                drafts[j].append(token)
                if not rows[r].params.greedy:
                    probs[j].append(q[r])
            active = [j for j in active if ks[j] > i + 1]
            if not active:
                break
            # The draft token just drawn, at its position (the sequence's i-th after its last one).
            token_ids = np.array([drafts[j][-1] for j in active], dtype=np.int64)
            positions = np.array([ends[j] + i for j in active], dtype=np.int64)
            hidden = self._forward(token_ids, positions, [1] * len(active), [seqs[j].block_table for j in active])
            logits = self.model.compute_logits(hidden)
        return drafts, {seq.seq_id: torch.stack(q) if q else None for seq, q in zip(seqs, probs)}

    def _catch_up(self, seqs: list[Sequence], ends: list[int]) -> torch.Tensor:
        """Run the draft over each sequence's tokens it has not seen, through its last one, in forwards of at
        most max_num_batched_tokens tokens; the hidden state at each sequence's last token [S, hidden]."""
        last: list[torch.Tensor | None] = [None] * len(seqs)
        pending = [(j, min(seq.num_draft_computed, end - 1), end) for j, (seq, end) in enumerate(zip(seqs, ends))]
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
        return torch.stack(last)

    def _forward(
        self, token_ids: np.ndarray, positions: np.ndarray, num_new: list[int], tables: list[list[int]]
    ) -> torch.Tensor:
        meta = attention_metadata(self.backend, self.block_size, self.device, num_new, positions, tables)
        return self.model(upload(token_ids, self.device), upload(positions, self.device), meta)
