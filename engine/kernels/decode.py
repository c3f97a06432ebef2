"""Split-KV (flash-decoding) paged attention in Triton: a fixed number of queries per sequence (one for a
decode, k + 1 for a speculative verify step) against its cached keys.

Program (sequence, KV head, split) runs the Q x G query rows of a KV head (its G query heads for each of
the sequence's Q queries) over one chunk of keys read through the block table (the tile loop of
attention.py); a reduce kernel merges the splits by their log-sum-exp. The split count comes from shapes
and the device's SM count only, so a launch needs no host sync and can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.attention import (
    _LOG2E,
    _attend_keys,
    _check_inputs,
    _fp8_scales,
    _precision,
    _prescale_q,
    fp8_widen,
)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    bt_ptr,
    seq_lens_ptr,
    query_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    qk_scale,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_b,
    stride_s,
    stride_h,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    QUERIES: tl.constexpr = 1,
    KV_FP8: tl.constexpr = False,
    WIDEN: tl.constexpr = 0,
    WIDEN_SHIFT: tl.constexpr = 0,
    PRESCALE: tl.constexpr = 1.0,
    UNBIAS: tl.constexpr = 1.0,
    WIDEN_ASM: tl.constexpr = "",
    PDL: tl.constexpr = 0,
):
    pdl.enter(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each split takes a contiguous chunk, a whole number of key tiles, decided here from the
    # device-side length so the launch needs no host sync (CUDA-graph capturable). Splits past
    # the end get no keys and report lse = -inf.
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    rows = tl.arange(0, BLOCK_G)
    row_ok = rows < QUERIES * GROUP
    if QUERIES == 1:
        head = kvh * GROUP + rows
        token = seq.to(tl.int64)  # the row of q and out (a scalar: every program row's)
        part_row = seq * tl.num_programs(1) * GROUP
        q_pos = rows  # unread: no causal mask
        m_init = float("-inf")
    else:
        # Row r is query r // G of the sequence, head kvh * G + r % G. The sequence's first query_lens[s]
        # rows are real and sit at positions seq_len - query_lens[s] ...; the rest are padding, whose
        # positions run past the last key, so they see every key (finite output that nobody reads).
        query = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        query_row = seq.to(tl.int64) * QUERIES + query  # its row of q and out
        token = query_row[:, None]
        part_row = query_row * (tl.num_programs(1) * GROUP)
        q_pos = seq_len - tl.load(query_lens_ptr + seq) + query
        # A split can begin past a query's position (a split boundary inside the last Q keys): that row
        # sees no key of the split, and a finite initial maximum keeps its exponentials at exp2(-inf) = 0
        # instead of exp2(-inf - -inf) = NaN; it ends with l_i = 0, which the merge drops.
        m_init = -1.0e30
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_offs = token * stride_qs + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], m_init, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    qk_scale, v_scale = _fp8_scales(qk_scale, k_scale_ptr, v_scale_ptr, KV_FP8, UNBIAS)
    q = _prescale_q(q, KV_FP8, PRESCALE, WIDEN)
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_ptr,
        v_ptr,
        bt_ptr + seq * stride_bt,
        kvh,
        lo,
        hi,
        qk_scale,
        stride_b,
        stride_s,
        stride_h,
        d,
        d_ok,
        BLOCK_SIZE,
        BLOCK_N,
        QUERIES > 1,
        True,
        PRECISION,
        False,
        KV_FP8,
        WIDEN,
        WIDEN_SHIFT,
        PRESCALE,
        WIDEN_ASM,
    )
    # An empty split (or a zero-length padding sequence) has l_i == 0: write zeros, not NaN.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if KV_FP8:
        acc = acc * v_scale  # a split's partial is a weighted mean of V rows: scaling each scales the merge
    store_ok = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o_offs = token * stride_os + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=store_ok)
    else:
        # Scratch is [S * Q, H, NUM_SPLITS, HEAD_DIM] and [S * Q, H, NUM_SPLITS]; lse is in log2 units.
        part = (part_row + head) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=store_ok)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl.enter(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_P2)
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits
    split_ok = splits < NUM_SPLITS
    lse = tl.load(part_lse_ptr + part, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # Empty splits wrote zeros with weight exp2(-inf) = 0, so they drop out of the sum.
    parts = tl.load(
        part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=split_ok[:, None] & d_ok[None, :], other=0.0
    )
    o = tl.sum(weight[:, None] * parts, 0) / tl.where(total == 0.0, 1.0, total)
    o_offs = seq.to(tl.int64) * stride_os + head * stride_oh + d
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class DecodeTiles:
    """The decode kernel's tiling for one cache kind: keys per tile (at head_dim <= 128; half that
    above), warps, pipeline stages, and how fp8 tiles are widened (attention.WIDENS)."""

    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    widen: str = "cast"


# The tiling per cache kind. 16-bit: 64 keys, 4 warps, 2 stages (attention.py's prefill sweep). fp8: read as
# 32-bit words and widened to float16 four codes at a time ("words" in attention.WIDENS): before it, the
# kernel gathered fp8 V bytes one at a time through shared memory for P @ V and spent 58% of its instructions
# on integer widening (Nsight Compute, H200, W2 shape: DRAM 33% busy, ALU 61%). Two fp8 tilings, picked by
# programs per SM (sequences x KV heads / SMs, known at launch; bench/gpu_check.sh decode-tiles, H200,
# bench/results/2026-11-26-h200-decd8d2-decode-tiles-words.jsonl): with many short programs (W2: 256 sequences of
# U[100, 1280] keys, 15 programs per SM) 128-key tiles and 3 stages, 153 us against 175 us for the asm
# widening before it and 181 us for a bf16 cache; with few long ones (64 x 8k keys, 64 x 512; 4 per SM)
# 64-key tiles, 394 / 30.8 us against 423 / 32.3 (asm) and 478 / 35.7 (bf16), where the 128-key tiling
# took 472-528 us at 8k.
DECODE_TILES = {
    "16bit": DecodeTiles(block_n=64),
    "fp8": DecodeTiles(block_n=64, widen="words"),
    "fp8_many": DecodeTiles(block_n=128, num_stages=3, widen="words"),
}
# Programs per SM from which an fp8 cache takes DECODE_TILES["fp8_many"].
FP8_MANY_PROGRAMS_PER_SM = 8


def decode_tiles(fp8: bool, num_seqs: int, num_kv_heads: int, num_sms: int) -> DecodeTiles:
    """The shipped tiling for a launch of num_seqs sequences (DECODE_TILES)."""
    if not fp8:
        return DECODE_TILES["16bit"]
    many = num_seqs * num_kv_heads >= FP8_MANY_PROGRAMS_PER_SM * num_sms
    return DECODE_TILES["fp8_many" if many else "fp8"]


# Decode programs to aim for per SM when choosing the split count.
DECODE_PROGRAMS_PER_SM = 2


# At most this many splits: one sequence x 8 KV heads at long context wants ~33 (two programs per
# SM); with 16 its 128 programs each streamed 2k keys of a 32k context at 59% of HBM.
MAX_DECODE_SPLITS = 64


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter runs one program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def decode_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """KV splits for decode, from shapes only: about DECODE_PROGRAMS_PER_SM programs per SM.

    Short contexts leave most of a large split count empty (a split holds whole key tiles and
    the empty ones only write a zero partial), so the count need not know the context."""
    programs = max(1, num_seqs * num_kv_heads)
    return max(1, min(MAX_DECODE_SPLITS, triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms, programs)))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiles: DecodeTiles | None = None,
    queries: int = 1,
    query_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence, q [S, H, D], against keys 0..seq_lens[s]-1 -> [S, H, D].

    With `queries` Q > 1 (a speculative verify step), q is [S * Q, H, D]: sequence s owns rows s*Q ..
    s*Q + Q-1, of which the first query_lens[s] ([S] int32 on the device, 1..Q) are its last tokens, at
    positions seq_lens[s] - query_lens[s] ..., each seeing the keys up to its own position (causal); the
    rest are padding, whose output is meaningless but finite.

    Split-KV (flash-decoding): program (s, kv head, split) runs all G query heads of the KV head (for each
    of its Q queries) over one chunk of keys; a reduce kernel merges the splits by their log-sum-exp. No
    host sync, grid from shapes only, so the call can be captured in a CUDA graph. An fp8 cache is read as
    stored * k_scale / v_scale (one-element float32 tensors, read on the device). `tiles` overrides
    DECODE_TILES (the tile sweep of bench/gpu_check.py).
    """
    out = torch.empty_like(q) if out is None else out
    fp8 = _check_inputs(q, k_cache, v_cache, out, k_scale, v_scale)
    rows, heads, head_dim = q.shape
    assert rows % queries == 0 and (queries == 1 or query_lens is not None), "q is [S * Q, H, D], with query_lens"
    num_seqs = rows // queries
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_seqs == 0:
        return out
    group = heads // kv_heads
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, kv_heads, num_sms(q.device))
    block_d = triton.next_power_of_2(head_dim)
    tiles = tiles or decode_tiles(fp8, num_seqs, kv_heads, num_sms(q.device))
    # fp8: the widening's constexprs; a 16-bit cache passes none, so it compiles as before fp8 caches.
    widen = asdict(fp8_widen(k_cache.dtype, q.dtype, tiles.widen, q.is_cuda, head_dim)) if fp8 else {}
    if num_splits > 1:
        part_out = torch.empty(rows, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: the kernel writes straight to out
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        block_tables,
        seq_lens,
        query_lens if queries > 1 else None,  # None: a constexpr, unread
        # None (a constexpr) for a 16/32-bit cache: the kernel compiles as it did before fp8 caches.
        k_scale if fp8 else None,
        v_scale if fp8 else None,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        # tl.dot needs at least 16 rows; the padding rows are masked.
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(queries * group)),
        BLOCK_N=tiles.block_n if head_dim <= 128 else tiles.block_n // 2,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        PRECISION=_precision(q.dtype),
        QUERIES=queries,
        KV_FP8=fp8,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **widen,
        **pdl.launch(q.device, q.shape[0]),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(rows, heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_D=block_d,
            num_warps=4,
            **pdl.launch(q.device, q.shape[0]),
        )
    return out
