"""Continuous batching: picks each step's tokens under a token budget and a sequence cap, and
updates the sequences from what each step did. The scheduler is the one writer of a sequence's
progress (computed tokens, appended tokens, finish); the runner and the engine loop only read it.

Every sequence carries `num_computed_tokens`; a step gives it `num_new_tokens` more (1 for a
decode, a chunk for a prefill). Running sequences come first, decodes before prefill chunks, so
decodes are never starved by a long prompt; waiting sequences are admitted with what is left.
When the pool runs dry, the lowest-priority, latest running sequence is preempted: either its
blocks are dropped and it waits to be recomputed ("recompute"), or they are copied to a CPU
pool and back later ("swap"; recompute when the CPU pool is full). Swapped sequences come back
before any waiting one is admitted.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

from engine.block_manager import BlockManager, SwapPool
from engine.sequence import PLACEHOLDER, Request, Sequence, SequenceStatus, TokenLogprobs
from engine.spec_decode.rejection import accepted_lengths

log = logging.getLogger("pagoda.scheduler")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # its last token and the draft's, for a speculating sequence
    draft: list[int] | tuple[()] = ()  # speculative decoding: the proposed tokens the step verifies

    @property
    def completes(self) -> bool:
        """After this step every token of the sequence is computed."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == len(self.seq.token_ids)

    @property
    def samples(self) -> bool:
        """The sequence samples its next token after this step (an embedding request pools instead)."""
        return self.completes and self.seq.request.pooling is None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), before the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, CPU block), first of all
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU block, device block), then these
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class LaunchedPlan:
    """A scheduled step once it is on the device: what its sampled tokens update when they are back."""

    scheduled: list[ScheduledSeq]
    ends: list[int]  # per scheduled sequence: its computed tokens once this step has run
    sampling: list[tuple[Sequence, int]]  # (sequence, row of `scheduled` whose logits it samples from)
    slots: list[int]  # per sampling row: the index in the sequence's token_ids its token goes to
    num_prefill_tokens: int  # of the step's tokens, those of prompts (recomputation included)
    drafts: list[list[int]] | None = None  # speculative: per sampling row, the draft it verifies
    accepted: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (seq, draft length, accepted)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        swap_pool: SwapPool | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int = 1 << 62,
    ):
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.swap_pool = swap_pool  # None: recompute-only preemption
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = {"recompute": 0, "swap": 0}

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """The next step's plan: which sequences compute how many tokens, and the block moves first.
        `drafts` (seq_id -> proposed tokens): decoding sequences that verify a draft this step compute it
        too, as far as the token budget goes and the free blocks hold it without preempting anyone."""
        out = self._schedule(drafts)
        now = time.monotonic()
        for item in out.scheduled:
            if item.seq.request.first_scheduled_time is None:
                item.seq.request.first_scheduled_time = now  # its queueing ends here
        return out

    def _schedule(self, drafts: dict[int, list[int]] | None) -> SchedulerOutput:
        out = SchedulerOutput()
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        running = SequenceStatus.RUNNING
        # Decodes first (one token each), then prefills already under way, each by priority. (This loop
        # visits every running sequence every step: the uncomputed count and a decode's chunk of one are
        # worked out inline.)
        for seq in sorted(self.running, key=lambda s: (len(s.token_ids) - s.num_computed_tokens > 1, s.sort_key)):
            if seq.status is not running:
                continue  # preempted earlier in this loop
            uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            num_new = 1 if uncomputed == 1 and budget > 0 else self._chunk(seq, budget)
            if num_new == 0:
                continue
            draft = drafts.get(seq.seq_id, ()) if drafts and num_new == 1 else ()
            if draft:
                draft = draft[: budget - 1]
                if not bm.can_allocate(seq, 1 + len(draft)):
                    draft = ()  # a draft never preempts anyone
                num_new += len(draft)
            if not bm.fits_own_blocks(seq, num_new):
                while not bm.can_allocate(seq, num_new):
                    victim = self._pick_victim(exclude=scheduled_ids) or seq
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not running:
                    continue
                out.block_copies += bm.allocate(seq, num_new)
            out.scheduled.append(ScheduledSeq(seq, num_new, draft))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new

        # Bring back swapped and admit waiting sequences only if nothing was preempted: a
        # preemption means the pool is full.
        if out.preempted or not (self.swapped or self.waiting):
            return out
        seats = sum(s.num_seqs_when_running for s in self.running)
        self.swapped.sort(key=lambda s: s.sort_key)
        while self.swapped:
            seq = self.swapped[0]
            num_new = seq.num_uncomputed_tokens
            if self.enable_chunked_prefill:
                num_new = min(num_new, budget)
            # With its table empty, blocks_needed counts the blocks to swap back in as well.
            blocks = self.block_manager.blocks_needed(seq, num_new)
            if (
                seats + seq.num_seqs_when_running > self.max_num_seqs
                or num_new == 0
                or num_new > budget
                or blocks > self.block_manager.num_free_blocks
            ):
                return out  # keep the order: nothing overtakes a swapped sequence
            self.swapped.pop(0)
            self._swap_in(seq, out)
            out.block_copies += self.block_manager.allocate(seq, num_new)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            seats += seq.num_seqs_when_running
            budget -= num_new
        if not self.waiting:
            return out
        in_flight = self._blocks_in_flight(out.scheduled)
        self.waiting.sort(key=lambda s: s.sort_key)
        admitted: set[int] = set()
        for seq in self.waiting:
            if seats + seq.num_seqs_when_running > self.max_num_seqs:
                break
            seq.num_computed_tokens = 0 if seq.request.pools_every_token else bm.take_cached_prefix(seq)
            num_new = self._chunk(seq, budget)
            deferred = self._next_block_in_flight(seq, in_flight)
            if deferred or num_new == 0 or not bm.can_allocate(seq, num_new):
                bm.free(seq)  # give the cached prefix back; it stays cached
                seq.num_computed_tokens = 0
                if deferred:  # next step its prefix will be cached: wait rather than compute it twice
                    continue
                break
            admitted.add(seq.seq_id)
            seats += seq.num_seqs_when_running
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.block_copies += bm.allocate(seq, num_new)
            item = ScheduledSeq(seq, num_new)
            out.scheduled.append(item)
            in_flight |= self._blocks_in_flight([item])
            budget -= num_new
        self.waiting = [s for s in self.waiting if s.seq_id not in admitted]
        return out

    def _blocks_in_flight(self, items: list[ScheduledSeq]) -> set[bytes]:
        """Names of the full blocks these chunks are about to compute (empty without prefix caching)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return set()
        names: set[bytes] = set()
        for item in items:
            seq = item.seq
            first = seq.num_computed_tokens // bm.block_size
            # Only blocks of known tokens: a planned token (async scheduling) is not one yet.
            known = len(seq.token_ids) - seq.num_pending
            full = min(seq.num_computed_tokens + item.num_new_tokens, known) // bm.block_size
            if full > first:  # most decodes fill no block
                names.update(bm.block_names_of(seq, full)[first:full])
        return names

    def _next_block_in_flight(self, seq: Sequence, in_flight: set[bytes]) -> bool:
        """Whether the first block `seq` would compute is being computed this step by another sequence."""
        if not in_flight:
            return False
        index = len(seq.block_table)
        if index >= (len(seq.token_ids) - 1) // self.block_manager.block_size:
            return False
        return self.block_manager.block_names_of(seq, index + 1)[index] in in_flight

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of `seq`'s uncomputed tokens to run now: all, or with chunked prefill as many
        as fit in `budget` and (when that leaves some) in the free blocks; without it, all or none."""
        remaining = seq.num_uncomputed_tokens
        if not self.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        num_new = min(remaining, budget)
        if num_new > 1 and not self.block_manager.can_allocate(seq, num_new):
            # A smaller chunk that fits beats preempting someone for a big one.
            fits = self.block_manager.tokens_that_fit(seq)
            num_new = min(num_new, fits) if fits > 0 else num_new
        return num_new

    def _pick_victim(self, exclude: set[int]) -> Sequence | None:
        candidates = [s for s in self.running if s.seq_id not in exclude and s.status is SequenceStatus.RUNNING]
        return max(candidates, key=lambda s: s.sort_key, default=None)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take `seq`'s device blocks away: swap them to the CPU pool if it has room, else drop
        them and recompute prompt + output when the sequence is readmitted."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        out.preempted.append(seq)
        pool = self.swap_pool
        if pool is not None and len(seq.block_table) <= pool.num_free_blocks:
            seq.swapped_blocks = [pool.take() for _ in seq.block_table]
            out.swap_out += list(zip(seq.block_table, seq.swapped_blocks))
            self.block_manager.free(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.num_preemptions["swap"] += 1
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0
        self.num_preemptions["recompute"] += 1
        self.add(seq)

    def _swap_in(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.block_table = self.block_manager.take_blocks(len(seq.swapped_blocks))
        seq.block_table_version += 1
        out.swap_in += list(zip(seq.swapped_blocks, seq.block_table))
        self.swap_pool.give_back(seq.swapped_blocks)
        seq.swapped_blocks = []
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A child forked from a running parent joins the running set directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (stop, length or abort) and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_pool.give_back(seq.swapped_blocks)
            seq.swapped_blocks = []
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ----- updates from a step -----

    def pooled(self, seq: Sequence, embedding: list[float]) -> None:
        """An embedding request's prompt has run: it ends with its pooled vector and gives its blocks back
        (its full blocks stay in the prefix cache)."""
        seq.embedding = embedding
        self.finish(seq, "stop")

    def fork(self, parent: Sequence, children: list[Sequence], num_new_tokens: int) -> None:
        """n > 1: `children` join `parent` as it completes its prompt this step, sharing its blocks."""
        for child in children:
            child.num_computed_tokens = parent.num_computed_tokens + num_new_tokens
            self.block_manager.fork(parent, child)
            self.add_running(child)

    def drafted(self, items: list[ScheduledSeq], drafts: list[list[int]]) -> None:
        """A draft model's tokens for the scheduled items it drafted for (in place of their placeholders); the
        draft model has then seen each sequence's last token and all but the last of its draft tokens."""
        for item, draft in zip(items, drafts):
            item.draft = draft
            item.seq.num_draft_computed = len(item.seq.token_ids) + len(draft) - 1

    def launched(
        self, out: SchedulerOutput, sampling: list[tuple[Sequence, int]], drafts: list[list[int]] | None = None
    ) -> LaunchedPlan:
        """The step `out` is on the device: its tokens count as computed, and every sequence it samples
        gets a PLACEHOLDER for the coming token (unless that token surely ends it by length), so the
        next step can be planned before this one's tokens are read. `drafts`: per sampling row, the draft
        it verifies (a speculative step); update() takes back the computed tokens of rejected ones."""
        prefill_tokens = 0
        ends = []
        for item in out.scheduled:
            seq = item.seq
            # Prompt chunks and recomputation after preemption; a decode is one token past the prompt.
            if item.num_new_tokens - len(item.draft) > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
                prefill_tokens += item.num_new_tokens
            seq.num_computed_tokens += item.num_new_tokens
            ends.append(seq.num_computed_tokens)
        slots = []
        for seq, _ in sampling:
            num_tokens = len(seq.token_ids)
            slots.append(num_tokens)
            if not self.ends_by_length(seq, num_tokens + 1):
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1
        return LaunchedPlan(out.scheduled, ends, sampling, slots, prefill_tokens, drafts)

    def update(
        self,
        plan: LaunchedPlan,
        token_ids: list[int],
        logprobs: list[TokenLogprobs | None] | None,
        refused: set[int] | frozenset[int] = frozenset(),
    ) -> list[Request]:
        """A launched step's tokens are back: commit the blocks it filled to the prefix cache, put each
        token in place of its placeholder, and finish sequences that stop. `refused`: the sampling rows
        whose token their grammar did not allow (engine/structured.py). Returns the requests whose
        outputs changed (a final_only request only once a sequence of it finished).

        In a speculative step (plan.drafts), `token_ids` and `logprobs` hold len(draft) + 1 rows per sampling
        row (engine/spec_decode/rejection.py): each sequence takes its accepted draft tokens and the target's
        next one, in order, until one of them stops it (eos, stop token or string, max_tokens); a speculating
        sequence then gives back the computed tokens (and the blocks) of what was rejected, and the blocks its
        accepted tokens filled go to the prefix cache; `refused` indexes those rows too."""
        bm = self.block_manager
        block_size = bm.block_size
        running = SequenceStatus.RUNNING
        for item, end in zip(plan.scheduled, plan.ends):
            # Not for a sequence preempted (or finished) since: its blocks are gone. Not for a speculating one
            # yet: its draft's tokens are not verified (below, once it is known what was accepted). Nor for
            # one whose step filled no block (most decodes; checked here, saving a call per sequence).
            if (end - item.num_new_tokens) // block_size != end // block_size:
                if item.seq.status is running and not item.draft:
                    bm.name_full_blocks(item.seq, end, item.num_new_tokens)
        now = time.monotonic()
        finished = SequenceStatus.FINISHED
        touched: dict[str, Request] = {}
        logprobs = logprobs or [None] * len(token_ids)
        if plan.drafts is None:  # one row each, nothing to accept
            drafts, accepted = itertools.repeat(()), itertools.repeat(0)
        else:
            drafts, accepted = plan.drafts, accepted_lengths(plan.drafts, token_ids)
        row = 0
        for (seq, _), slot, draft, num_accepted in zip(plan.sampling, plan.slots, drafts, accepted):
            first, row = row, row + len(draft) + 1
            if seq.status is finished:  # aborted, or stopped by the token before this one
                continue
            if first in refused:
                # The mask left no allowed token (the grammar and min_tokens both banned every one): the
                # sequence ends where it is, without the token. A constrained row never has a draft.
                log.warning(
                    "request %s: token %d breaks its grammar; ending the output",
                    seq.request.request_id,
                    token_ids[first],
                )
                self._stop(seq, "stop", None)
            else:
                for i in range(num_accepted + 1):
                    self._put_token(seq, slot + i, token_ids[first + i], logprobs[first + i])
                    if seq.status is finished:
                        break  # stopped by an accepted token: the rest of the draft is dropped
            if draft:
                plan.accepted.append((seq, len(draft), num_accepted))
                if seq.status is SequenceStatus.RUNNING:
                    # Its last token and the accepted draft tokens are computed; the rejected ones are not.
                    seq.num_computed_tokens -= len(draft) - num_accepted
                    # The draft model's K/V hold its own draft tokens: valid up to the first rejected one.
                    seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
                    self.block_manager.trim(seq, seq.num_computed_tokens)
                    self.block_manager.name_full_blocks(seq, seq.num_computed_tokens, num_accepted + 1)
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            if seq.status is finished or request.params.output_kind != "final_only":
                touched[request.request_id] = request
        return list(touched.values())

    def ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a sequence holding `num_tokens` tokens is done by max_tokens or the context length."""
        limit = seq.max_num_tokens
        if limit is None:  # worked out once: it is asked for every sampled sequence twice a step
            max_tokens = seq.request.params.max_tokens
            limit = self.max_model_len
            if max_tokens is not None:
                limit = min(limit, seq.num_prompt_tokens + max_tokens)
            seq.max_num_tokens = limit
        return num_tokens >= limit

    def _put_token(self, seq: Sequence, slot: int, token: int, logprobs: TokenLogprobs | None) -> None:
        """The token sampled for position `slot` of `seq`: replaces its placeholder (or is appended)."""
        params = seq.request.params
        if slot < len(seq.token_ids):
            seq.token_ids[slot] = token
            seq.num_pending -= 1
        else:
            seq.token_ids.append(token)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        num_out = slot + 1 - seq.num_prompt_tokens
        if not params.ignore_eos and token in self.eos_token_ids and num_out >= params.min_tokens:
            self._stop(seq, "stop", None)
        elif token in params.stop_token_ids and num_out >= params.min_tokens:
            self._stop(seq, "stop", token)
        elif seq.detokenizer is not None and self._detokenize(seq, token):
            if not seq.is_finished:  # else a detokenizer error ended it
                self._stop(seq, "stop", seq.detokenizer.stop_string)
        elif self.ends_by_length(seq, slot + 1):
            self._stop(seq, "length", None)

    def _detokenize(self, seq: Sequence, token: int) -> bool:
        """Append the token's text; whether it ended the sequence: a stop string, or a detokenizer error."""
        try:
            seq.text += seq.detokenizer.add([token])
        except Exception as exc:  # a tokenizer bug must end this sequence only, not the step of all the others
            log.exception("request %s: detokenizing token %d failed", seq.request.request_id, token)
            self.fail(seq, f"detokenizing the output failed: {exc}")
            return True
        return seq.detokenizer.stopped

    def fail(self, seq: Sequence, error: str) -> None:
        """End `seq` with finish_reason "error", its request failed with `error` (the engine ends its other
        sequences and reports it)."""
        del seq.token_ids[len(seq.token_ids) - seq.num_pending :]
        seq.num_pending = 0
        if seq.request.error is None:
            seq.request.error = error
        self.finish(seq, "error")

    def _stop(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        # A token already planned past this one (async scheduling) is dropped with the sequence.
        del seq.token_ids[len(seq.token_ids) - seq.num_pending :]
        seq.num_pending = 0
        if seq.detokenizer is not None and not seq.detokenizer.stopped:
            seq.text += seq.detokenizer.flush()
        seq.stop_reason = stop_reason
        self.finish(seq, reason)
