"""The physical KV block pool: free list, reference counts, copy-on-write for shared blocks."""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class BlockManager:
    """Hands out fixed-size KV blocks to sequences.

    A block may be shared by several sequences (n > 1 children fork the parent's table); its
    reference count says by how many. A shared block is never written: a sequence about to write
    into one gets a private copy first (copy-on-write) and the caller must copy the contents.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to take from the pool so `seq` can hold `num_new_tokens` more computed tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = max(0, -(-total // self.block_size) - len(seq.block_table))
        return needed + (1 if self._shared_write_block(seq) is not None else 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self.free_blocks)

    def tokens_that_fit(self, seq: Sequence) -> int:
        """How many more tokens `seq` could compute with the blocks it has plus the free ones."""
        free = len(self.free_blocks) - (1 if self._shared_write_block(seq) is not None else 0)
        return max(0, (len(seq.block_table) + free) * self.block_size - seq.num_computed_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Grow `seq`'s block table for its next `num_new_tokens`; returns (src, dst) block copies to make."""
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError(f"out of KV blocks for sequence {seq.seq_id}")
        copies = []
        shared = self._shared_write_block(seq)
        if shared is not None:
            index, src = shared
            dst = self._take()
            self.ref_counts[src] -= 1
            seq.block_table[index] = dst
            copies.append((src, dst))
        total = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < total:
            seq.block_table.append(self._take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent`."""
        child.block_table = list(parent.block_table)
        for block in child.block_table:
            self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
            elif self.ref_counts[block] < 0:
                raise AssertionError(f"block {block} freed more often than taken")
        seq.block_table = []

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def _shared_write_block(self, seq: Sequence) -> tuple[int, int] | None:
        """(table index, block id) of the block the next token lands in, if another sequence shares it."""
        index = seq.num_computed_tokens // self.block_size
        if index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1:
            return index, seq.block_table[index]
        return None
