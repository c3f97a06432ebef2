"""Prefill of whole fresh prompts in Triton (`prefill_fresh`): the tiling of attention.py's paged
prefill over the step's own contiguous k/v, read through TMA tensor descriptors instead of gathered
through the block table."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.attention import _LOG2E, _precision


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
