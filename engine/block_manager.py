"""The physical KV block pool: free list, reference counts, prefix cache, copy-on-write.

Prefix caching: a full block is named by a chained hash, SHA-256 over the previous block's
hash and this block's token ids, so a name stands for the whole prefix up to the block's end.
A new sequence reuses every leading full block whose name is in the cache, shared by
reference count, and skips computing those tokens. A freed block keeps its contents and its
name and stays findable until the pool needs it; then the least recently freed goes first.
SHA-256 rather than Python's 64-bit `hash`: a collision would silently hand one request
another's KV, and with a collision-resistant hash none will be found in practice.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from engine.sequence import Sequence


class BlockManager:
    """Hands out fixed-size KV blocks to sequences.

    A block may be shared by several sequences (prefix-cache hits, n > 1 children forked off a
    parent); its reference count says by how many. A shared block is never written: a sequence
    about to write into one gets a private copy first (copy-on-write) and the caller copies the
    contents. Only full blocks are named, and a full block is never written again.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.empty_blocks: deque[int] = deque(range(num_blocks))  # free, holding nothing reusable
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # free but named; oldest first
        self.block_names: list[bytes | None] = [None] * num_blocks
        self.cache: dict[bytes, int] = {}  # name -> block
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty_blocks) + len(self.cached_free)

    @property
    def free_blocks(self) -> list[int]:
        return [*self.empty_blocks, *self.cached_free]

    # ----- prefix cache -----

    def block_names_of(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained names of `seq`'s full blocks, at least its first `num_blocks`: its memo itself,
        to read, not to change (no copy: the scheduler looks up a few names of hundreds of sequences)."""
        names = seq.block_hashes
        start = len(names)
        if start >= num_blocks:
            return names
        # The new blocks' tokens as bytes in one piece (converting them block by block costs as much as
        # the hashes).
        bs = self.block_size
        data = seq.token_array(start * bs, num_blocks * bs).tobytes()
        step = bs * 8  # bytes of one block's token ids
        name = names[-1] if names else b""
        for offset in range(0, len(data), step):
            digest = hashlib.sha256(name)
            digest.update(data[offset : offset + step])
            name = digest.digest()
            names.append(name)
        return names

    def take_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence with nothing computed: take every leading cached block; returns the
        number of tokens that need no computing (the scheduler counts them computed). At least one
        token is always left to compute, since its logits are what the next token is sampled from."""
        assert seq.num_computed_tokens == 0 and not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        full = (len(seq.token_ids) - 1) // self.block_size
        self.prefix_queried_tokens += full * self.block_size
        for name in self.block_names_of(seq, full)[:full]:
            block = self.cache.get(name)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.cached_free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.block_table_version += 1
        hit = len(seq.block_table) * self.block_size
        self.prefix_hit_tokens += hit
        return hit

    def name_full_blocks(self, seq: Sequence, end: int, num_new_tokens: int) -> None:
        """After a step computed `seq`'s tokens [end - num_new_tokens, end): put the blocks it filled
        into the cache. (`end`, not num_computed_tokens: a later step may be planned already.)"""
        if not self.enable_prefix_caching:
            return
        first = (end - num_new_tokens) // self.block_size
        full = end // self.block_size
        if first == full:  # most decode steps: no block filled up
            return
        names = self.block_names_of(seq, full)
        for i in range(first, full):
            block, name = seq.block_table[i], names[i]
            if self.block_names[block] is None and name not in self.cache:
                self.block_names[block] = name
                self.cache[name] = block

    # ----- allocation -----

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to take from the pool so `seq` can hold `num_new_tokens` more computed tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        needed = max(0, -(-total // self.block_size) - len(seq.block_table))
        return needed + (1 if self._shared_write_block(seq) is not None else 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def fits_own_blocks(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `seq`'s next `num_new_tokens` land in blocks it holds alone: nothing to take or copy
        (most decode steps)."""
        return (
            seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size
            and self._shared_write_block(seq) is None
        )

    def tokens_that_fit(self, seq: Sequence) -> int:
        """How many more tokens `seq` could compute with the blocks it has plus the free ones."""
        free = self.num_free_blocks - (1 if self._shared_write_block(seq) is not None else 0)
        return max(0, (len(seq.block_table) + free) * self.block_size - seq.num_computed_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Grow `seq`'s block table for its next `num_new_tokens`; returns (src, dst) block copies to make."""
        total = seq.num_computed_tokens + num_new_tokens
        shared = self._shared_write_block(seq)
        if shared is None and total <= len(seq.block_table) * self.block_size:
            return []  # fits_own_blocks: most decode steps
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError(f"out of KV blocks for sequence {seq.seq_id}")
        copies = []
        if shared is not None:
            index, src = shared
            [dst] = self._take(1)
            self.ref_counts[src] -= 1
            seq.block_table[index] = dst
            copies.append((src, dst))
        missing = -(-total // self.block_size) - len(seq.block_table)
        if missing > 0:
            seq.block_table += self._take(missing)
        seq.block_table_version += 1
        return copies

    def take_blocks(self, num_blocks: int) -> list[int]:
        """`num_blocks` private blocks (for a sequence swapped back in)."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError("out of KV blocks")
        return self._take(num_blocks)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent`."""
        child.block_table = list(parent.block_table)
        child.block_table_version += 1
        child.block_hashes = list(parent.block_hashes)
        for block in child.block_table:
            self.ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s blocks. A named block that nobody holds stays in the cache, most recent last;
        blocks are released last to first, so a prefix's tail is evicted before its head."""
        self.trim(seq, 0)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the blocks of `seq` past those that hold its first `num_tokens` tokens (speculative decoding:
        the blocks that only rejected draft tokens were written to)."""
        keep = -(-num_tokens // self.block_size)
        if keep >= len(seq.block_table):  # most verify steps: the draft stayed within blocks the sequence keeps
            return
        for block in reversed(seq.block_table[keep:]):
            self._release(block)
        del seq.block_table[keep:]
        seq.block_table_version += 1  # only on a change: it makes the sequence's table array again

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if self.block_names[block] is not None:
                self.cached_free[block] = None
            else:
                self.empty_blocks.append(block)
        elif self.ref_counts[block] < 0:
            raise AssertionError(f"block {block} freed more often than taken")

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody holds."""
        while self.cached_free:
            block, _ = self.cached_free.popitem(last=False)
            self._forget(block)
            self.empty_blocks.append(block)

    def _take(self, num_blocks: int) -> list[int]:
        """`num_blocks` blocks, each now held once: empty blocks first, then the least recently
        freed cached ones, evicted. (One call per sequence: a prompt chunk takes dozens.)"""
        pop_empty = self.empty_blocks.popleft
        blocks = [pop_empty() for _ in range(min(num_blocks, len(self.empty_blocks)))]
        while len(blocks) < num_blocks:
            block, _ = self.cached_free.popitem(last=False)
            self._forget(block)
            blocks.append(block)
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def _forget(self, block: int) -> None:
        name = self.block_names[block]
        if name is not None:
            del self.cache[name]
            self.block_names[block] = None

    def _shared_write_block(self, seq: Sequence) -> tuple[int, int] | None:
        """(table index, block id) of the block the next token lands in, if another sequence shares it."""
        index = seq.num_computed_tokens // self.block_size
        if index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1:
            return index, seq.block_table[index]
        return None


class SwapPool:
    """Free list of the CPU swap space's blocks; a swapped-out sequence holds its own copies."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def take(self) -> int:
        return self.free.popleft()

    def give_back(self, blocks: list[int]) -> None:
        self.free.extend(blocks)
