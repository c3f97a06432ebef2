"""The Triton paged-attention kernels against a plain float32 reference.

Without a GPU they run under the Triton interpreter at tiny shapes (fp32 and fp16: the
interpreter mishandles bf16); the large shapes, bf16 and CUDA-graph capture run only on CUDA.
"""

import os

import torch

# The interpreter is chosen when a kernel is decorated, so this must precede the kernel import;
# on a CUDA machine the kernels compile for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

pytest.importorskip("triton")

import numpy as np

from engine.kernels.attention import (
    paged_prefill,
    prefill_queries_per_tile,
    prefill_tile_capacity,
    prefill_tile_map,
)
from engine.kernels.decode import MAX_DECODE_SPLITS, decode_num_splits, paged_decode
from engine.kernels.prefill_fresh import fresh_prefill_fits, prefill_fresh
from tests.attention_reference import assert_close, make_batch, poisoned_like, reference, verify_case
from tests.conftest import NEEDS_FA4, fa4_on_hopper

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="large shapes, bf16 and CUDA graphs need a GPU")


def run_prefill(batch, max_query_len):
    out = poisoned_like(batch["q"])
    result = paged_prefill(**batch, max_query_len=max_query_len, out=out)
    assert result is out
    return out


def run_decode(batch, num_splits):
    args = {k: v for k, v in batch.items() if k != "query_start"}
    out = paged_decode(**args, out=poisoned_like(batch["q"]), num_splits=num_splits)
    return out


# A mixed batch: pure prefill from 0, a decode-like row, a chunk after cached context, and a
# long chunk after a short context (several query tiles).
MIXED_CTX = [0, 37, 70, 5]
MIXED_Q = [20, 1, 13, 30]


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,block_size",
    [
        (torch.float32, 4, 4, 64, 16),
        (torch.float16, 8, 2, 64, 8),
        (torch.float32, 8, 1, 64, 32),
        (torch.float16, 4, 1, 128, 16),
        (torch.float32, 2, 2, 96, 8),
        (torch.float32, 6, 2, 64, 16),
    ],
)
def test_prefill_mixed_batch(dtype, heads, kv_heads, head_dim, block_size):
    batch = make_batch(MIXED_CTX, MIXED_Q, heads, kv_heads, head_dim, block_size, dtype)
    out = run_prefill(batch, max(MIXED_Q))
    assert_close(out, reference(**batch), dtype)


@pytest.mark.parametrize(
    "heads,kv_heads,ctx,q_lens",
    [
        (4, 4, MIXED_CTX, MIXED_Q),
        (6, 2, [0, 3, 0, 50, 9], [45, 1, 1, 22, 7]),  # 21 queries a tile: several tiles, partial last ones
        (8, 1, [12], [1]),  # one decode row
    ],
)
def test_prefill_tile_map_launch_equals_the_grid_launch(heads, kv_heads, ctx, q_lens):
    """The fixed-grid launch of a step graph: the map's tiles, then idle programs, and rows past the step's
    tokens (a graph's padding) left untouched."""
    batch = make_batch(ctx, q_lens, heads, kv_heads, 64, 16, torch.float32)
    per_tile = prefill_queries_per_tile(heads, kv_heads, fp8=False)
    tokens = sum(q_lens)
    padded = tokens + 5
    capacity = prefill_tile_capacity(padded, 8, per_tile)
    tile_map = np.empty((capacity, 2), dtype=np.int32)
    prefill_tile_map(np.array(q_lens), per_tile, tile_map)
    q = torch.cat([batch["q"], torch.randn(5, heads, 64).to(DEVICE)])
    out = poisoned_like(q)
    paged_prefill(**{**batch, "q": q}, max_query_len=0, out=out, tile_map=torch.from_numpy(tile_map).to(DEVICE))
    assert out[tokens:].isnan().all(), "padding rows are no tile's"
    assert_close(out[:tokens], reference(**batch), torch.float32)
    assert torch.equal(out[:tokens], run_prefill(batch, max(q_lens)))


def test_prefill_tile_map_covers_every_tile_once_highest_first():
    q_lens = np.array([1, 40, 21, 22, 3])
    per_tile = 21
    capacity = prefill_tile_capacity(int(q_lens.sum()), len(q_lens), per_tile)
    tile_map = np.full((capacity, 2), 7, dtype=np.int32)
    prefill_tile_map(q_lens, per_tile, tile_map)
    used = tile_map[tile_map[:, 0] >= 0]
    expected = {(s, t) for s, n in enumerate(q_lens) for t in range(-(-n // per_tile))}
    assert sorted(map(tuple, used.tolist())) == sorted(expected)
    assert list(used[:, 1]) == sorted(used[:, 1], reverse=True)
    assert (tile_map[len(used) :] == (-1, 0)).all()
    with pytest.raises(AssertionError, match="query tiles"):
        prefill_tile_map(q_lens, 1, tile_map)


def test_prefill_block_larger_than_key_tile():
    # 128-token blocks against 64-key tiles; the context crosses a block boundary.
    batch = make_batch([150, 0], [10, 3], 4, 2, 64, 128, torch.float32, seed=1)
    assert_close(run_prefill(batch, 10), reference(**batch), torch.float32)


def test_prefill_long_prompt_many_tiles():
    # G = 8 leaves 8 queries per tile: 64 queries span 8 tiles and the causal diagonal.
    batch = make_batch([0], [64], 8, 1, 64, 16, torch.float16, seed=2)
    assert_close(run_prefill(batch, 64), reference(**batch), torch.float16)


def _fresh_kv(batch, fused_with_q=True):
    """The step's own k and v [T, KVH, D] for a batch of whole prompts: the cache rows the
    reference reads, laid out as views of one fused q|k|v buffer as the model makes them."""
    k_cache, v_cache, table = batch["k_cache"], batch["v_cache"], batch["block_tables"]
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    ks, vs = [], []
    for s, n in enumerate(batch["seq_lens"].tolist()):
        pos = torch.arange(n, device=k_cache.device)
        slots = table[s, pos // block_size].long() * block_size + pos % block_size
        ks.append(k_cache.reshape(-1, kv_heads, head_dim)[slots])
        vs.append(v_cache.reshape(-1, kv_heads, head_dim)[slots])
    k, v = torch.cat(ks), torch.cat(vs)
    if not fused_with_q:
        return batch["q"], k, v
    t, heads = batch["q"].shape[:2]
    fused = torch.cat([batch["q"].reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    return q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim)


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,lens",
    [
        (torch.float32, 8, 2, 64, [5, 70, 17]),  # ragged: tiles cross into the next prompt's rows
        (torch.float16, 4, 1, 128, [130]),  # several query tiles, the last one partial
        (torch.float32, 4, 4, 64, [1, 64, 3]),
    ],
)
def test_prefill_fresh_matches_reference(dtype, heads, kv_heads, head_dim, lens):
    batch = make_batch([0] * len(lens), lens, heads, kv_heads, head_dim, 16, dtype, seed=9)
    q, k, v = _fresh_kv(batch)
    assert fresh_prefill_fits(q, k, v)
    out = poisoned_like(q)
    assert prefill_fresh(q, k, v, batch["query_start"], batch["scale"], max(lens), out=out) is out
    assert_close(out, reference(**batch), dtype)


def test_fresh_prefill_fits_only_descriptor_friendly_views():
    batch = make_batch([0], [8], 2, 2, 96, 16, torch.float32, seed=10)
    assert not fresh_prefill_fits(*_fresh_kv(batch))  # head dim not a power of two
    batch = make_batch([0], [8], 2, 2, 64, 16, torch.float32, seed=10)
    q, k, v = _fresh_kv(batch, fused_with_q=False)
    assert fresh_prefill_fits(q, k, v)
    assert not fresh_prefill_fits(q[:, :, :32], k[:, :, :32], v[:, :, :32])  # rows not contiguous in D


def test_prefill_strided_q():
    # q as a slice of a fused qkv projection: token stride larger than H * D.
    batch = make_batch(MIXED_CTX, MIXED_Q, 4, 2, 64, 16, torch.float32, seed=3)
    fused = torch.cat([batch["q"], torch.randn_like(batch["q"])], dim=1)
    batch["q"] = fused[:, :4]
    assert not batch["q"].is_contiguous()
    assert_close(run_prefill(batch, max(MIXED_Q)), reference(**batch), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3, 8, None])
@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,block_size",
    [
        (torch.float32, 8, 2, 64, 16),
        (torch.float16, 8, 1, 128, 8),
        (torch.float32, 4, 4, 64, 32),
    ],
)
def test_decode(num_splits, dtype, heads, kv_heads, head_dim, block_size):
    # Lengths 1 and 9 leave most splits empty (8 splits x 64-key tiles); 200 spans several tiles.
    ctx = [0, 8, 200, 63]
    batch = make_batch(ctx, [1] * len(ctx), heads, kv_heads, head_dim, block_size, dtype, seed=4)
    assert_close(run_decode(batch, num_splits), reference(**batch), dtype)


def test_decode_head_dim_96():
    batch = make_batch([40, 130], [1, 1], 4, 1, 96, 16, torch.float32, seed=5)
    assert_close(run_decode(batch, 2), reference(**batch), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_zero_length_sequence_gives_zeros(num_splits):
    # Batch padding (e.g. for a captured CUDA graph) may carry sequences with no keys.
    batch = make_batch([30, 0], [1, 1], 4, 2, 64, 16, torch.float32, seed=6)
    batch["seq_lens"][1] = 0
    out = run_decode(batch, num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = reference(**{**batch, "seq_lens": batch["seq_lens"][:1], "query_start": batch["query_start"][:2]})
    assert_close(out[:1], ref[:1], torch.float32)


def test_decode_num_splits():
    h100 = 132  # SMs
    assert decode_num_splits(1, 8, h100) == 33
    assert decode_num_splits(1, 2, h100) == MAX_DECODE_SPLITS
    assert decode_num_splits(4, 8, h100) == 9
    assert decode_num_splits(64, 8, h100) == 1
    assert decode_num_splits(256, 2, h100) == 1
    assert decode_num_splits(1, 8, 66) == 17  # half the SMs, half the splits
    assert all(1 <= decode_num_splits(s, h, h100) <= MAX_DECODE_SPLITS for s in range(1, 300, 7) for h in (1, 2, 4, 8))


def test_decode_most_splits():
    # The largest split count on a short and a long sequence: 63 of 64 splits empty on the first,
    # 3,000 keys cut into 47 whole tiles on the second.
    batch = make_batch([4, 3000], [1, 1], 4, 2, 64, 16, torch.float32, seed=7)
    assert_close(run_decode(batch, MAX_DECODE_SPLITS), reference(**batch), torch.float32)


# Verify steps, k = 4: full drafts, shorter ones (adaptive k; 1 = a row without a draft), a context of 61 + 5
# whose split boundary at key 64 falls between its queries (queries 61..63 see no key of the last split), and
# contexts shorter than a tile.
VERIFY_CTX = [61, 0, 130, 7, 200]
VERIFY_Q = [5, 5, 2, 1, 3]


@pytest.mark.parametrize("num_splits", [1, 2, 7])
@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,block_size",
    [(torch.float32, 8, 2, 64, 16), (torch.float16, 4, 1, 128, 8), (torch.float32, 4, 4, 64, 32)],
)
def test_decode_several_queries_a_sequence_is_causal(num_splits, dtype, heads, kv_heads, head_dim, block_size):
    batch = make_batch(VERIFY_CTX, [5] * len(VERIFY_CTX), heads, kv_heads, head_dim, block_size, dtype, seed=11)
    got, ref, out = verify_case(batch, VERIFY_Q, num_splits)
    assert_close(got, ref, dtype)
    assert out.isfinite().all()  # the padding rows too: nothing downstream may see a NaN


def test_unsupported_head_dim_is_refused():
    batch = make_batch([0], [4], 2, 2, 8, 16, torch.float32)
    with pytest.raises(AssertionError, match="head_dim"):
        paged_prefill(**batch, max_query_len=4)


# ---- GPU only: realistic sizes, bf16, CUDA graphs ----


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 8, 64), (14, 2, 64), (32, 32, 128)])
def test_prefill_large(dtype, heads, kv_heads, head_dim):
    ctx = [0, 32000, 3000, 100, 0, 777]
    q_lens = [2048, 300, 1, 1000, 1, 129]
    batch = make_batch(ctx, q_lens, heads, kv_heads, head_dim, 16, dtype, seed=7)
    assert_close(run_prefill(batch, max(q_lens)), reference(**batch), dtype)


@needs_cuda
@pytest.mark.parametrize("block_size", [1, 8, 32, 256])
def test_prefill_block_sizes_large(block_size):
    batch = make_batch([0, 5000, 40], [700, 90, 1], 16, 4, 128, block_size, torch.bfloat16, seed=8)
    assert_close(run_prefill(batch, 700), reference(**batch), torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 5, None])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 2, 64), (28, 4, 128)])
def test_decode_large(dtype, num_splits, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(9)
    ctx = torch.randint(0, 4000, (256,), generator=gen)
    ctx[:3] = torch.tensor([32000, 0, 1])
    batch = make_batch(ctx.tolist(), [1] * 256, heads, kv_heads, head_dim, 16, dtype, seed=9)
    assert_close(run_decode(batch, num_splits), reference(**batch), dtype)


@needs_cuda
def test_decode_cuda_graph_replay_follows_new_lengths():
    batch = make_batch([500, 3000, 10, 0], [1] * 4, 32, 8, 128, 16, torch.bfloat16, seed=10)
    args = {k: v for k, v in batch.items() if k != "query_start"}
    out = torch.empty_like(batch["q"])
    paged_decode(**args, out=out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(**args, out=out)
    for lens in ([501, 3001, 11, 1], [1, 2, 3000, 17]):
        batch["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(**batch), torch.bfloat16)


def _metadata(batch, fresh: bool):
    from engine.attention import AttentionMetadata

    seq_lens, query_start = batch["seq_lens"], batch["query_start"]
    return AttentionMetadata(
        slot_mapping=torch.empty(0),
        query_start=query_start.tolist(),
        seq_lens=seq_lens.tolist(),
        block_tables=batch["block_tables"],
        seq_lens_tensor=seq_lens,
        query_start_tensor=query_start,
        max_query_len=int((query_start[1:] - query_start[:-1]).max()),
        max_seq_len=int(seq_lens.max()),
        fresh=fresh,
    )


@pytest.mark.skipif(not fa4_on_hopper(), reason=NEEDS_FA4)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (16, 2, 64), (14, 14, 128)])
def test_fa4_prompt_route_matches_reference(heads, kv_heads, head_dim):
    """The long-prompt route through flash-attn-4 (attention.flash_attn.fa4_prefill), both ways: whole prompts from the
    step's own k/v (views of one fused q|k|v buffer, as the model makes them), and chunks after cached
    context with decodes beside them through the shuffled block tables."""
    from engine.attention import Attention
    from engine.attention.flash_attn import fa4_prefill

    attn = Attention(heads, kv_heads, head_dim)
    batch = make_batch([0, 0, 0], [300, 77, 1500], heads, kv_heads, head_dim, 16, torch.bfloat16, seed=21)
    attn.k_cache, attn.v_cache = batch["k_cache"], batch["v_cache"]
    q, k, v = _fresh_kv(batch)
    assert_close(fa4_prefill(attn, q, k, v, _metadata(batch, fresh=True)), reference(**batch), torch.bfloat16)

    batch = make_batch(
        [0, 37, 500, 5, 3000], [300, 1, 130, 700, 1], heads, kv_heads, head_dim, 16, torch.bfloat16, seed=22
    )
    attn.k_cache, attn.v_cache = batch["k_cache"], batch["v_cache"]
    out = fa4_prefill(attn, batch["q"], None, None, _metadata(batch, fresh=False))
    assert_close(out, reference(**batch), torch.bfloat16)
