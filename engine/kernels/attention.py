"""Paged attention in Triton: a varlen causal prefill kernel and a split-KV decode kernel.

Both read K and V through block tables from the cache layout of engine/attention/base.py:
k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim]; position p of sequence s
lives in block block_tables[s, p // block_size] at offset p % block_size. The new tokens' K/V
are already in the cache, so both kernels read everything from there.

GQA is handled the same way in both kernels: the G = H / KVH query heads that share a KV head
are packed into the M (row) dimension of one program, so every K/V tile is loaded once per KV
head instead of once per query head.

The math is FlashAttention-2: scores in fp32, online softmax (running max and sum, rescaled
accumulator), base-2 exponentials with log2(e) folded into the scale.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _kv_offsets(bt_row_ptr, pos, pos_ok, kvh, stride_b, stride_s, stride_h, BLOCK_SIZE: tl.constexpr):
    """Element offset of each key position's row for KV head kvh, gathered through the block table."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    # int64: num_blocks * block stride can pass 2**31 on a large cache.
    return block.to(tl.int64) * stride_b + (pos % BLOCK_SIZE) * stride_s + kvh * stride_h


@triton.jit
def _attend_keys(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_ptr,
    v_ptr,
    bt_row_ptr,
    kvh,
    lo,
    hi,
    qk_scale,
    stride_b,
    stride_s,
    stride_h,
    d,
    d_ok,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr,
    PRECISION: tl.constexpr,
    FOLD_SCALE: tl.constexpr = False,
):
    """Fold keys lo..hi-1 into the running softmax state of the query rows q.

    CAUSAL masks key positions after each row's q_pos; BOUNDED masks positions >= hi. Callers
    turn both off for the key tiles every row sees in full, which skips the masking work there.
    FOLD_SCALE applies the softmax scale to the row maxima and inside the exponent's
    multiply-add instead of to every score first, and accumulates P @ V inside the MMA.
    """
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        if BOUNDED:
            pos_ok = pos < hi
            load_ok = pos_ok[:, None] & d_ok[None, :]
        else:
            pos_ok = pos >= 0
            load_ok = d_ok[None, :]
        offs = _kv_offsets(bt_row_ptr, pos, pos_ok, kvh, stride_b, stride_s, stride_h, BLOCK_SIZE)
        k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=load_ok, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if not FOLD_SCALE:
            scores = scores * qk_scale
        if CAUSAL:
            visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        elif BOUNDED:
            scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        # Every row has a finite score in its first tile (key 0 is visible to every query,
        # and a decode split's first tile holds at least one key), so m_new is never -inf
        # and exp2(m_i - m_new) never sees -inf - -inf.
        if FOLD_SCALE:
            # qk_scale > 0, so scaling the maximum equals the maximum of the scaled scores.
            m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
            p = tl.exp2(scores * qk_scale - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=load_ok, other=0.0)
        if FOLD_SCALE:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    bt_ptr,
    query_start_ptr,
    seq_lens_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_b,
    stride_s,
    stride_h,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    FOLD_SCALE: tl.constexpr = False,
):
    # Row r of the tile is query first_q + r // GROUP of head kvh * GROUP + r % GROUP.
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    # Highest query tiles see the most keys; launching them first shortens the tail.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    first_q = tile * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context + q_idx
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    token = (q_begin + q_idx).to(tl.int64)
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row_ptr = bt_ptr + seq * stride_bt
    # Keys 0..context+first_q are visible to every row; whole tiles of them need no mask.
    full_end = (context + first_q + 1) // BLOCK_N * BLOCK_N
    # The last valid query of the tile bounds the key loop (causal early stop).
    kv_end = context + tl.minimum(first_q + BLOCK_Q, q_len)
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_ptr,
        v_ptr,
        bt_row_ptr,
        kvh,
        0,
        full_end,
        qk_scale,
        stride_b,
        stride_s,
        stride_h,
        d,
        d_ok,
        BLOCK_SIZE,
        BLOCK_N,
        False,
        False,
        PRECISION,
        FOLD_SCALE,
    )
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_ptr,
        v_ptr,
        bt_row_ptr,
        kvh,
        full_end,
        kv_end,
        qk_scale,
        stride_b,
        stride_s,
        stride_h,
        d,
        d_ok,
        BLOCK_SIZE,
        BLOCK_N,
        True,
        True,
        PRECISION,
        FOLD_SCALE,
    )
    acc = acc / l_i[:, None]
    o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


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
):
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
    head = kvh * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_offs = seq.to(tl.int64) * stride_qs + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        rows,
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
        False,
        True,
        PRECISION,
    )
    # An empty split (or a zero-length padding sequence) has l_i == 0: write zeros, not NaN.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    store_ok = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        o_offs = seq.to(tl.int64) * stride_os + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=store_ok)
    else:
        # Scratch is [S, H, NUM_SPLITS, HEAD_DIM] and [S, H, NUM_SPLITS]; lse is in log2 units.
        part = (seq * tl.num_programs(1) * GROUP + head) * NUM_SPLITS + split
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
):
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


def _check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    """Shape, dtype and stride checks; host-only, so they cost nothing under graph capture."""
    assert q.dim() == 3 and k_cache.dim() == 4, (
        "q is [tokens, heads, head_dim], caches [blocks, block_size, kv_heads, head_dim]"
    )
    assert q.dtype in _DTYPES and k_cache.dtype == v_cache.dtype == q.dtype, (
        "q and caches must share one of fp16/bf16/fp32"
    )
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), (
        "k_cache and v_cache must match in shape and strides"
    )
    head_dim, kv_heads, block_size = q.shape[2], k_cache.shape[2], k_cache.shape[1]
    assert k_cache.shape[3] == head_dim, "q and cache head_dim differ"
    assert 16 <= head_dim <= 256, f"head_dim {head_dim} unsupported: 16..256 (padded to a power of two inside)"
    assert q.shape[1] % kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} must be a power of two"
    assert q.stride(2) == k_cache.stride(3) == out.stride(2) == 1, "head_dim must be the contiguous dimension"
    assert out.shape == q.shape and out.dtype == q.dtype, "out must be like q"


def _precision(dtype: torch.dtype) -> str:
    # fp32 tl.dot defaults to TF32 on the GPU (~1e-3 error); fp32 callers want fp32 accuracy.
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat varlen batch q [T, H, D] against the paged cache -> [T, H, D].

    Sequence s owns q[query_start[s]:query_start[s+1]]; its cache holds seq_lens[s] tokens
    including those new ones, so query i sits at position seq_lens[s] - q_len + i.
    """
    out = torch.empty_like(q) if out is None else out
    _check_inputs(q, k_cache, v_cache, out)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or max_query_len == 0:
        return out
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    # 64 rows: G heads x 64/G queries. A pure long prefill costs the same K/V traffic as one head
    # per program, while short queries (chunk tails, q_len 1 rows in mixed batches) fill the rows.
    # 64x64 tiles, 4 warps, 2 stages: best or within 3% of a 24-config sweep on an H100
    # (bf16, D 64 and 128, G 2..4), about 60% of cuDNN's dense causal attention there. The folded
    # scale gained 3% there (283 -> 292 TFLOP/s at 8 x 2k, 336 -> 346 at 2 x 8k).
    tiles = {
        "BLOCK_M": 64,
        "BLOCK_N": 64 if head_dim <= 128 else 32,
        "num_warps": 4,
        "num_stages": 2,
        "FOLD_SCALE": True,
    }
    tiles["BLOCK_M"] = max(tiles["BLOCK_M"], triton.next_power_of_2(group))
    block_q = tiles["BLOCK_M"] // group
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start,
        seq_lens,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION=_precision(q.dtype),
        **tiles,
    )
    return out


@triton.jit
def _fresh_tile(
    acc,
    m_i,
    l_i,
    q,
    rows,
    k_desc,
    v_desc,
    row,
    start,
    col,
    qk_scale,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold the key tile at descriptor row `row` (positions start..start+BLOCK_N-1) into the state."""
    k = k_desc.load([row, col])
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if CAUSAL:
        cols = start + tl.arange(0, BLOCK_N)
        scores = tl.where(cols[None, :] <= rows[:, None], scores, float("-inf"))
    # Every row sees key 0 in its first tile, so m_new is never -inf (see _attend_keys).
    m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
    p = tl.exp2(scores * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([row, col])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _prefill_fresh_kernel(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    query_start_ptr,
    qk_scale,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Program (query tile, sequence, query head); the longest rows first, as in _prefill_kernel.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kvh = head // GROUP
    begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - begin
    first = tile * BLOCK_M
    if first >= q_len:
        return
    rows = first + tl.arange(0, BLOCK_M)
    q = q_desc.load([begin + first, head * HEAD_DIM])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Key tiles wholly below the tile's first row need no mask. Rows past the sequence (the next
    # sequence's, or zeros past the tensor) come in whole tiles: the causal test masks them as keys,
    # and the store masks them as queries.
    full_end = first // BLOCK_N * BLOCK_N
    end = tl.minimum(first + BLOCK_M, q_len)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _fresh_tile(
            acc,
            m_i,
            l_i,
            q,
            rows,
            k_desc,
            v_desc,
            begin + start,
            start,
            kvh * HEAD_DIM,
            qk_scale,
            BLOCK_N,
            False,
            PRECISION,
        )
    for start in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _fresh_tile(
            acc,
            m_i,
            l_i,
            q,
            rows,
            k_desc,
            v_desc,
            begin + start,
            start,
            kvh * HEAD_DIM,
            qk_scale,
            BLOCK_N,
            True,
            PRECISION,
        )
    acc = acc / l_i[:, None]
    d = tl.arange(0, HEAD_DIM)
    offs = (begin + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None])


def fresh_prefill_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether prefill_fresh can read these views through tensor descriptors: a power-of-two head
    dim up to 128, rows contiguous, base addresses and row strides 16-byte aligned."""
    head_dim = q.shape[2]
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 128:
        return False
    return all(
        x.stride(2) == 1
        and x.stride(1) == head_dim
        and x.stride(0) * x.element_size() % 16 == 0
        and x.data_ptr() % 16 == 0
        for x in (q, k, v)
    )


def prefill_fresh(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of whole prompts with nothing cached: q [T, H, D] against the step's own
    k / v [T, KVH, D] (not the cache), sequence s owning rows query_start[s]:query_start[s+1].

    The keys come through TMA tensor descriptors, so the copy engine computes their addresses;
    the paged kernel gathers them through the block table. On an H100 at 32 x 512 .. 1 x 32k
    tokens: 235-489 TFLOP/s against 187-401 (WRITEUP.md). Needs fresh_prefill_fits(q, k, v).
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    out = torch.empty_like(q) if out is None else out
    t, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if t == 0:
        return out
    # 64 x 64 tiles, 4 warps, 3 stages: the best of 12 settings at the four shapes above (WRITEUP.md).
    block_m, block_n = 64, 64
    q_desc = TensorDescriptor(q, [t, heads * head_dim], [q.stride(0), 1], [block_m, head_dim])
    k_desc = TensorDescriptor(k, [t, kv_heads * head_dim], [k.stride(0), 1], [block_n, head_dim])
    v_desc = TensorDescriptor(v, [t, kv_heads * head_dim], [v.stride(0), 1], [block_n, head_dim])
    grid = (triton.cdiv(max_query_len, block_m), query_start.shape[0] - 1, heads)
    _prefill_fresh_kernel[grid](
        q_desc,
        k_desc,
        v_desc,
        out,
        query_start,
        scale * _LOG2E,
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
        num_warps=4,
        num_stages=3,
    )
    return out


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

    Short contexts leave most of a large split count empty (a split holds whole 64-key tiles and
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
) -> torch.Tensor:
    """One query per sequence, q [S, H, D], against keys 0..seq_lens[s]-1 -> [S, H, D].

    Split-KV (flash-decoding): program (s, kv head, split) runs all G query heads of the KV head
    over one chunk of keys; a reduce kernel merges the splits by their log-sum-exp. No host sync,
    grid from shapes only, so the call can be captured in a CUDA graph.
    """
    out = torch.empty_like(q) if out is None else out
    _check_inputs(q, k_cache, v_cache, out)
    num_seqs, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_seqs == 0:
        return out
    group = heads // kv_heads
    if num_splits is None:
        num_splits = decode_num_splits(num_seqs, kv_heads, num_sms(q.device))
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty(num_seqs, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, heads, num_splits, dtype=torch.float32, device=q.device)
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
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=64 if head_dim <= 128 else 32,
        BLOCK_D=block_d,
        NUM_SPLITS=num_splits,
        PRECISION=_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_seqs, heads)](
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
        )
    return out
