"""What attention needs done to q, k and v first, in one Triton kernel: Qwen3's per-head RMSNorm
of q and k, rotary embedding (rotate-half layout) of both, and the scatter of k and v into the
paged cache. One program per token; q and k are rewritten in place, k and v go to the cache.

Separately these were four launches a layer (three for Llama); in a decode step each is a few
microseconds of mostly launch gap, and in an eager prompt step each costs the host a Triton launch.

Rounding: the kernel reproduces the references (engine/layers/norm.py, engine/layers/rotary.py)
step by step rather than computing in float32 and rounding once. The references round to x.dtype
after the normalisation, after the weight multiply, after casting cos/sin, after each product and
after each sum; each of those steps is done here in float32 followed by an explicit cast. For
bf16/fp16 the product of two 16-bit values is exact in float32, and float32 is wide enough that
rounding a float32 sum again to 16 bits equals rounding the exact sum, so the rotary equals the
reference bit for bit (fp fusion is off at launch so no product is fused into an fma). The norm's
float32 sum of squares runs in another order than torch's, so a rare element may differ by an ulp.
Keeping the torch and Triton paths this close matters because greedy outputs are compared across
backends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kv_fp8 import is_fp8


@triton.jit
def _halves(base_ptr, s_head, s_dim, n_heads, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Pointers to the first and second half of every head's vector, and their mask."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (dims < half)
    first = base_ptr + heads * s_head + dims * s_dim
    return first, first + half * s_dim, mask


@triton.jit
def _prepare(x1, x2, w_ptr, eps, cos, sin, half, dtype: tl.constexpr, NORM: tl.constexpr, ROTARY: tl.constexpr):
    """Norm (optional) then rotary of float32 halves [BLOCK_H, BLOCK_HALF] -> halves in `dtype`."""
    if NORM:
        # Masked lanes were loaded as 0 and add nothing to the sum of squares.
        var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * half)
        scale = tl.math.rsqrt(var + eps)[:, None]
        dims = tl.arange(0, x1.shape[1])[None, :]
        w1 = tl.load(w_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
        x1 = ((x1 * scale).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * scale).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    if ROTARY:
        c = cos.to(dtype).to(tl.float32)
        s = sin.to(dtype).to(tl.float32)
        x1c = (x1 * c).to(dtype).to(tl.float32)
        x2s = (x2 * s).to(dtype).to(tl.float32)
        x2c = (x2 * c).to(dtype).to(tl.float32)
        x1s = (x1 * s).to(dtype).to(tl.float32)
        return (x1c - x2s).to(dtype), (x2c + x1s).to(dtype)
    return x1.to(dtype), x2.to(dtype)


@triton.jit
def _to_cache(x, scale_ptr, cache_dtype: tl.constexpr, FP8_MAX: tl.constexpr):
    """x in the cache's dtype; for an fp8 cache (FP8_MAX > 0) divided by the layer's scale first and
    saturated to the format's range, since a plain cast turns an out-of-range value into NaN or inf."""
    if FP8_MAX > 0:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x.to(cache_dtype)


@triton.jit
def _store_rounded(
    p, c, x, scale_ptr, mask, valid, dtype: tl.constexpr, cache_dtype: tl.constexpr, FP8_MAX: tl.constexpr
):
    """x into the fp8 cache at c (quantized), and back at p as the cache reads it: the stored value x
    scale in `dtype`, as engine/kv_fp8.py's dequantize(quantize(x))."""
    stored = _to_cache(x, scale_ptr, cache_dtype, FP8_MAX)
    tl.store(c, stored, mask=mask & valid)
    tl.store(p, (stored.to(tl.float32) * tl.load(scale_ptr)).to(dtype), mask=mask)


@triton.jit
def _qkv_store_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    q_st,
    q_sh,
    q_sd,
    k_st,
    k_sh,
    k_sd,
    v_st,
    v_sh,
    v_sd,
    kc_sb,
    kc_so,
    kc_sh,
    kc_sd,
    vc_sb,
    vc_so,
    vc_sh,
    vc_sd,
    cs_stride,
    n_q_heads,
    n_kv_heads,
    half,
    block_size,
    eps,
    NORM: tl.constexpr,
    ROTARY: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    FP8_MAX: tl.constexpr = 0.0,
    WRITE_BACK: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    dtype: tl.constexpr = q_ptr.dtype.element_ty
    dims = tl.arange(0, BLOCK_HALF)
    cos = tl.zeros([1, BLOCK_HALF], dtype=tl.float32)
    sin = cos
    if ROTARY:
        # One cos/sin row per token, shared by all its q and k heads.
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(cos_ptr + pos * cs_stride + dims, mask=dims < half, other=0.0)[None, :]
        sin = tl.load(sin_ptr + pos * cs_stride + dims, mask=dims < half, other=0.0)[None, :]

    p1, p2, mask = _halves(q_ptr + t * q_st, q_sh, q_sd, n_q_heads, half, BLOCK_HQ, BLOCK_HALF)
    q1, q2 = _prepare(
        tl.load(p1, mask=mask, other=0.0).to(tl.float32),
        tl.load(p2, mask=mask, other=0.0).to(tl.float32),
        qw_ptr,
        eps,
        cos,
        sin,
        half,
        dtype,
        NORM,
        ROTARY,
    )
    tl.store(p1, q1, mask=mask)
    tl.store(p2, q2, mask=mask)

    # A negative slot (padded CUDA-graph rows) masks every cache store: no branch, so the launch
    # is the same for any slot values. The slot is broadcast before the comparison because the
    # triton 3.9 interpreter mistypes (scalar bool & block) masks.
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = (slot + tl.zeros([BLOCK_HK, 1], dtype=tl.int64)) >= 0
    # Block and offset from the slot, so the cache strides need not be contiguous.
    block = slot // block_size
    offset = slot % block_size
    p1, p2, mask = _halves(k_ptr + t * k_st, k_sh, k_sd, n_kv_heads, half, BLOCK_HK, BLOCK_HALF)
    k1, k2 = _prepare(
        tl.load(p1, mask=mask, other=0.0).to(tl.float32),
        tl.load(p2, mask=mask, other=0.0).to(tl.float32),
        kw_ptr,
        eps,
        cos,
        sin,
        half,
        dtype,
        NORM,
        ROTARY,
    )
    cache_dtype: tl.constexpr = kc_ptr.dtype.element_ty
    if WRITE_BACK:
        # An fp8 cache: k and v also go back in place as the cache will read them, so that prefill_fresh
        # over the step's own k/v sees the cache's values. Every row goes back (a negative slot stores
        # nothing in the cache, but its q and k are prepared anyway).
        kc_row = kc_ptr + block * kc_sb + offset * kc_so
        c1, c2, _ = _halves(kc_row, kc_sh, kc_sd, n_kv_heads, half, BLOCK_HK, BLOCK_HALF)
        _store_rounded(p1, c1, k1, ks_ptr, mask, valid, dtype, cache_dtype, FP8_MAX)
        _store_rounded(p2, c2, k2, ks_ptr, mask, valid, dtype, cache_dtype, FP8_MAX)
        p1, p2, mask = _halves(v_ptr + t * v_st, v_sh, v_sd, n_kv_heads, half, BLOCK_HK, BLOCK_HALF)
        vc_row = vc_ptr + block * vc_sb + offset * vc_so
        c1, c2, _ = _halves(vc_row, vc_sh, vc_sd, n_kv_heads, half, BLOCK_HK, BLOCK_HALF)
        _store_rounded(p1, c1, tl.load(p1, mask=mask, other=0.0), vs_ptr, mask, valid, dtype, cache_dtype, FP8_MAX)
        _store_rounded(p2, c2, tl.load(p2, mask=mask, other=0.0), vs_ptr, mask, valid, dtype, cache_dtype, FP8_MAX)
    else:
        # Back in place too: a prompt with nothing cached attends to the step's own k (prefill_fresh).
        tl.store(p1, k1, mask=mask)
        tl.store(p2, k2, mask=mask)
        kc_row = kc_ptr + block * kc_sb + offset * kc_so
        c1, c2, _ = _halves(kc_row, kc_sh, kc_sd, n_kv_heads, half, BLOCK_HK, BLOCK_HALF)
        tl.store(c1, _to_cache(k1, ks_ptr, cache_dtype, FP8_MAX), mask=mask & valid)
        tl.store(c2, _to_cache(k2, ks_ptr, cache_dtype, FP8_MAX), mask=mask & valid)

        p1, p2, mask = _halves(v_ptr + t * v_st, v_sh, v_sd, n_kv_heads, half, BLOCK_HK, BLOCK_HALF)
        vc_row = vc_ptr + block * vc_sb + offset * vc_so
        c1, c2, _ = _halves(vc_row, vc_sh, vc_sd, n_kv_heads, half, BLOCK_HK, BLOCK_HALF)
        tl.store(c1, _to_cache(tl.load(p1, mask=mask & valid), vs_ptr, cache_dtype, FP8_MAX), mask=mask & valid)
        tl.store(c2, _to_cache(tl.load(p2, mask=mask & valid), vs_ptr, cache_dtype, FP8_MAX), mask=mask & valid)


def prepare_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    write_back: bool = False,
) -> None:
    """q [T, H, D], k and v [T, KVH, D] (any strides, e.g. views of a fused qkv output).

    With q_norm / k_norm weights [D]: RMSNorm over each head of q and of k first (eps). With
    positions (their first T entries; a captured buffer may be longer) and the float32 tables
    cos / sin [max_positions, D/2]: rotary at those positions.
    q and k are rewritten in place; k (so prepared) and v are written into k_cache / v_cache
    [num_blocks, block_size, KVH, D] at the flat slots `slot_mapping` [T] (block * block_size +
    offset); tokens whose slot is negative store nothing (their q and k are still prepared).
    An fp8 cache stores k / k_scale and v / v_scale (one-element float32 tensors, read on the device
    so that a CUDA graph sees scales set after its capture), saturated to the fp8 range.
    """
    t, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    assert k.shape == v.shape == (t, kv_heads, head_dim) and slot_mapping.shape == (t,)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, head_dim)
    assert head_dim % 2 == 0 and (q_norm is None) == (k_norm is None)
    rotary = positions is not None
    if rotary:
        assert positions.dim() == 1 and positions.shape[0] >= t and cos.shape[1] == head_dim // 2
        assert cos.stride() == sin.stride() and cos.stride(1) == 1
    fp8 = is_fp8(k_cache.dtype)
    assert not fp8 or (k_scale is not None and v_scale is not None), "an fp8 cache needs k_scale and v_scale"
    assert fp8 or not write_back, "write_back rounds to an fp8 cache's values"
    if t == 0:
        return
    half = head_dim // 2
    block_hq, block_half = triton.next_power_of_2(heads), triton.next_power_of_2(half)
    unused = slot_mapping  # any pointer of the right device for the arguments a variant skips
    _qkv_store_kernel[(t,)](
        positions if rotary else unused,
        q,
        k,
        v,
        cos if rotary else q,
        sin if rotary else q,
        q_norm if q_norm is not None else q,
        k_norm if k_norm is not None else q,
        k_cache,
        v_cache,
        slot_mapping,
        # None (a constexpr) for a 16-bit cache: the kernel compiles as it did before fp8 caches.
        k_scale if fp8 else None,
        v_scale if fp8 else None,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        cos.stride(0) if rotary else 0,
        heads,
        kv_heads,
        half,
        k_cache.shape[1],
        eps,
        NORM=q_norm is not None,
        ROTARY=rotary,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=block_half,
        FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0,
        WRITE_BACK=write_back,
        num_warps=4 if block_hq * block_half >= 1024 else 1,
        # Without this the compiler narrows the float32 steps to native bf16/fp16 ops and fuses
        # a product with the sum into one fma, skipping the product's rounding.
        enable_fp_fusion=False,
        **pdl.launch(q.device, t),
    )
