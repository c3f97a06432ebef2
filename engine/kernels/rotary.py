"""Rotary position embedding (rotate-half layout) applied in place by a Triton kernel.

Rounding: this kernel reproduces the reference (engine/layers/rotary.py) step by step
rather than computing in float32 and rounding once. The reference casts cos/sin to
x.dtype and rounds each product and the sum to x.dtype; each of those steps is done
here in float32 followed by an explicit cast. For bf16/fp16 the products of two 16-bit
values are exact in float32 and float32 (24 bits) is wide enough that rounding a
float32 sum again to 16 bits equals rounding the exact sum, so the result equals the
reference bit for bit (checked on an H100 for bf16 and fp16; fp fusion is turned off
at launch so that no product is fused into an fma). Keeping the torch and Triton paths identical matters more here
than the extra accuracy, because greedy outputs are compared across backends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    base_ptr,
    s_head,
    s_dim,
    n_heads,
    half,
    cos,
    sin,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half)
    p1 = base_ptr + heads * s_head + dims * s_dim
    p2 = p1 + half * s_dim
    dtype = base_ptr.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # Each .to(dtype) is one of the reference's roundings to x.dtype (no-ops for float32).
    c = cos.to(dtype).to(tl.float32)
    s = sin.to(dtype).to(tl.float32)
    x1c = (x1 * c).to(dtype).to(tl.float32)
    x2s = (x2 * s).to(dtype).to(tl.float32)
    x2c = (x2 * c).to(dtype).to(tl.float32)
    x1s = (x1 * s).to(dtype).to(tl.float32)
    tl.store(p1, (x1c - x2s).to(dtype), mask=mask)
    tl.store(p2, (x2c + x1s).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_st,
    q_sh,
    q_sd,
    k_st,
    k_sh,
    k_sd,
    cs_stride,
    n_q_heads,
    n_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per token: the cos/sin row is loaded once and shared by all q and k heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * cs_stride + dims, mask=dims < half, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * cs_stride + dims, mask=dims < half, other=0.0)[None, :]
    _rotate_heads(q_ptr + t * q_st, q_sh, q_sd, n_q_heads, half, cos, sin, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * k_st, k_sh, k_sd, n_k_heads, half, cos, sin, BLOCK_HK, BLOCK_HALF)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] IN PLACE (any strides, e.g. views of a fused
    qkv output) by the float32 tables cos/sin [max_positions, D/2] at `positions` [T].
    Returns (q, k), the same tensors."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0]
    head_dim = q.shape[2]
    half = head_dim // 2
    assert k.shape[2] == head_dim and head_dim % 2 == 0 and cos.shape[1] == half
    assert cos.stride() == sin.stride() and cos.stride(1) == 1
    if q.shape[0] == 0:
        return q, k
    block_hq = triton.next_power_of_2(q.shape[1])
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(q.shape[0],)](
        positions,
        q,
        k,
        cos,
        sin,
        *q.stride(),
        *k.stride(),
        cos.stride(0),
        q.shape[1],
        k.shape[1],
        half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=block_half,
        num_warps=4 if block_hq * block_half >= 1024 else 1,
        # Without this the compiler narrows the float32 steps to native bf16/fp16 ops and fuses
        # a product with the sum into one fma, skipping the product's rounding.
        enable_fp_fusion=False,
    )
    return q, k
