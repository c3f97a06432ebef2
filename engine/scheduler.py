"""Continuous batching: picks each step's tokens under a token budget and a sequence cap.

Every sequence carries `num_computed_tokens`; a step gives it `num_new_tokens` more (1 for a
decode, a chunk for a prefill). Running sequences come first, decodes before prefill chunks, so
decodes are never starved by a long prompt; waiting sequences are admitted with what is left.
When the pool runs dry, the lowest-priority, latest running sequence is preempted: either its
blocks are dropped and it waits to be recomputed ("recompute"), or they are copied to a CPU
pool and back later ("swap"; recompute when the CPU pool is full). Swapped sequences come back
before any waiting one is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.block_manager import BlockManager, SwapPool
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """After this step every token of the sequence is computed, so it samples the next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq.token_ids)


def new_token_ids(scheduled: list[ScheduledSeq]) -> np.ndarray:
    """The token ids the scheduled sequences compute this step, one after another, as int64."""
    out = np.empty(sum(item.num_new_tokens for item in scheduled), dtype=np.int64)
    # One-token items (decodes) are gathered and converted together; longer ones come as arrays.
    single_at: list[int] = []
    single_ids: list[int] = []
    offset = 0
    for item in scheduled:
        seq, start, num_new = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
        if num_new == 1:
            single_at.append(offset)
            single_ids.append(seq.token_ids[start])
        else:
            out[offset : offset + num_new] = seq.token_array(start, start + num_new)
        offset += num_new
    out[single_at] = single_ids
    return out


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


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        swap_pool: SwapPool | None = None,
    ):
        self.block_manager = block_manager
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

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        # Decodes first (one token each), then prefills already under way, each by priority.
        for seq in sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.sort_key)):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                continue
            if not bm.fits_own_blocks(seq, num_new):
                while not bm.can_allocate(seq, num_new):
                    victim = self._pick_victim(exclude=scheduled_ids) or seq
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                out.block_copies += bm.allocate(seq, num_new)
            out.scheduled.append(ScheduledSeq(seq, num_new))
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
            bm.take_cached_prefix(seq)
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
        seq.num_computed_tokens = 0
        self.num_preemptions["recompute"] += 1
        self.add(seq)

    def _swap_in(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.block_table = self.block_manager.take_blocks(len(seq.swapped_blocks))
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
