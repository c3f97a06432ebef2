"""The host side of a step: input token ids, prefix-cache names, block allocation, the frozen heap."""

from __future__ import annotations

import gc
import hashlib
from array import array

import numpy as np

from engine.block_manager import BlockManager
from engine.llm import frozen_heap
from engine.runner.step_inputs import block_table_array, new_token_ids
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Request, Sequence


def _seq(seq_id: int, prompt: list[int], generated: list[int] = (), computed: int = 0) -> Sequence:
    request = Request(f"r{seq_id}", None, list(prompt), SamplingParams())
    seq = Sequence(seq_id, request, 0, 0, list(prompt) + list(generated))
    seq.num_computed_tokens = computed
    return seq


def test_new_token_ids_are_each_sequences_next_tokens_in_order():
    prompt_a, prompt_b = list(range(100, 140)), list(range(500, 520))
    chunk = _seq(0, prompt_a, computed=8)  # a prompt chunk after 8 computed tokens
    decode = _seq(1, prompt_b, generated=[7, 8, 9], computed=22)  # one token: the last
    recompute = _seq(2, prompt_b, generated=[1, 2, 3, 4])  # after a preemption: prompt and output
    whole = _seq(3, [5, 6])
    verify = _seq(4, prompt_b, generated=[3, 4], computed=21)  # its last token and a draft of two
    scheduled = [
        ScheduledSeq(decode, 1),
        ScheduledSeq(chunk, 16),
        ScheduledSeq(verify, 3, [11, 12]),
        ScheduledSeq(recompute, 24),
        ScheduledSeq(whole, 2),
    ]
    ids = new_token_ids(scheduled)
    assert ids.dtype == np.int64
    assert ids.tolist() == [9] + prompt_a[8:24] + [4, 11, 12] + prompt_b + [1, 2, 3, 4] + [5, 6]
    assert new_token_ids([ScheduledSeq(decode, 1), ScheduledSeq(verify, 3, [11, 12])]).tolist() == [9, 4, 11, 12]
    assert new_token_ids([ScheduledSeq(chunk, 16)]).tolist() == prompt_a[8:24]


def _chained_names(tokens: list[int], block_size: int) -> list[bytes]:
    """The definition: SHA-256 over the previous name and the block's token ids as int64."""
    names, name = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        name = hashlib.sha256(name + array("q", tokens[start : start + block_size]).tobytes()).digest()
        names.append(name)
    return names


def test_block_names_follow_the_chain_through_prompt_and_generated_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt, generated = list(range(1, 11)), [40, 41, 42, 43, 44, 45]
    seq = _seq(0, prompt, generated)
    expected = _chained_names(prompt + generated, 4)
    assert bm.block_names_of(seq, 2)[:2] == expected[:2]  # all prompt tokens
    assert bm.block_names_of(seq, 4) == expected  # extended past the prompt, from the memo on
    assert bm.block_names_of(seq, 3) is seq.block_hashes  # the memo itself, no copy
    all_prompt = _seq(1, prompt + generated)  # the same tokens, all read from the prompt's array
    assert bm.block_names_of(all_prompt, 4) == expected


def test_allocation_takes_empty_blocks_first_then_evicts_least_recently_freed():
    bm = BlockManager(num_blocks=6, block_size=2)
    old = _seq(0, [1, 2, 3, 4, 5, 6, 7])
    bm.allocate(old, 7)  # 4 blocks
    old.num_computed_tokens = 7
    bm.name_full_blocks(old, 7, 7)  # 3 full blocks named
    named = old.block_table[:3]
    bm.free(old)  # named blocks become cached-free, tail first; the partial one is empty again
    new = _seq(1, list(range(20, 30)))
    bm.allocate(new, 10)  # 5 blocks: the 3 empty ones, then the two least recently freed
    assert new.block_table[3:] == [named[2], named[1]]
    assert len(bm.cache) == 1 and bm.num_free_blocks == 1
    assert all(bm.ref_counts[b] == 1 for b in new.block_table)


def test_fits_own_blocks_only_without_new_or_shared_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(0, [1, 2, 3])
    assert not bm.fits_own_blocks(seq, 3)  # nothing allocated yet
    bm.allocate(seq, 3)
    seq.num_computed_tokens = 3
    assert bm.fits_own_blocks(seq, 1) and not bm.fits_own_blocks(seq, 2)
    child = _seq(1, [1, 2, 3], computed=3)
    bm.fork(seq, child)
    assert not bm.fits_own_blocks(seq, 1)  # the block is shared now: copy-on-write first
    assert bm.allocate(seq, 1) != [] and bm.fits_own_blocks(seq, 1)


def test_block_table_array_follows_every_change_of_the_table():
    """The int32 copy a step reads is made again after each change the block manager makes, whether or not
    the table's length changed, and is reused while nothing changed."""
    bm = BlockManager(num_blocks=16, block_size=4)

    def check(seq: Sequence) -> None:
        assert seq.block_table_array().dtype == np.int32
        assert seq.block_table_array().tolist() == seq.block_table

    parent = _seq(0, list(range(10)))
    bm.allocate(parent, 10)  # three blocks
    check(parent)
    assert parent.block_table_array() is parent.block_table_array()  # unchanged: not converted again
    parent.num_computed_tokens = 10
    child = _seq(1, list(range(10)))
    bm.fork(parent, child)
    check(child)
    child.num_computed_tokens = 10
    before = child.block_table_array().tolist()
    assert bm.allocate(child, 1)  # its last block is shared: copied on write, same length
    assert len(child.block_table) == len(before) and child.block_table != before
    check(child)
    bm.trim(parent, 4)
    check(parent)
    bm.allocate(parent, 4)  # back to two blocks, another second block: same length as before the trim
    check(parent)
    bm.free(child)
    check(child)


def test_block_table_array_pads_rows_to_a_multiple_and_fills_a_buffers_corner():
    tables = [[5, 6, 7], [1], list(range(20, 37))]
    expected = np.zeros((3, 32), dtype=np.int32)
    for row, table in enumerate(tables):
        expected[row, : len(table)] = table
    for given in (tables, [np.asarray(t, dtype=np.int32) for t in tables]):
        array = block_table_array(given, multiple=16)
        assert array.dtype == np.int32 and np.array_equal(array, expected)
        buffer = np.full((4, 40), 99, dtype=np.int32)
        assert block_table_array(given, buffer, multiple=16) == 32
        for row, table in enumerate(tables):
            assert buffer[row, : len(table)].tolist() == table
        assert buffer[1, 1] == 99 and buffer[3, 0] == 99  # past a row's length, and past the rows: untouched


def test_frozen_heap_restores_the_collector_and_keeps_a_callers_freeze():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap():
            pass
        # Not unfrozen (that would be 0). Not an exact count: a frozen object that dies meanwhile (another
        # thread dropping its last reference) leaves the permanent generation, so the count can fall by a few.
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()
