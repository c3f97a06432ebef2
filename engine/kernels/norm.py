"""RMSNorm (optionally fused with the residual add) as a Triton kernel.

Matches engine/layers/norm.py's rounding order: the residual sum is rounded to the
input dtype, the variance and x * rsqrt(var + eps) are float32, the result is cast to
the input dtype and only then multiplied by the weight. For a W8A8 linear's input the kernel can
hand over the normed rows quantized per row instead (engine/kernels/w8a8.py quantize_row), saving
that linear the quantize_rows launch and the normed rows' round trip through memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.w8a8 import qmax, quantize_row

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    x_s0,
    x_s1,
    x_s2,
    r_s0,
    r_s1,
    r_s2,
    o_s0,
    o_s1,
    o_s2,
    scale_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    INT8: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl.enter(PDL)
    # One program per row; rows are addressed by two indices so that a strided
    # [tokens, heads, head_dim] view (q/k norm on a slice of the fused qkv) needs no copy.
    i0 = tl.program_id(0).to(tl.int64)
    i1 = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + i0 * x_s0 + i1 * x_s1 + cols * x_s2, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_offs = i0 * r_s0 + i1 * r_s1 + cols * r_s2
        r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
        # The reference adds in the input dtype, so the sum is rounded before it is normalised.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + r_offs, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # Both factors are exact in float32 and the product of two 16-bit floats fits in its
    # 24-bit significand, so one rounding here equals the reference's half-precision multiply.
    out = normed.to(tl.float32) * w.to(tl.float32)
    o_offs = i0 * o_s0 + i1 * o_s1 + cols * o_s2
    if QUANT:
        # The row quantized as quantize_rows quantizes the stored norm: from its values rounded to the norm's
        # dtype (padding columns are 0, so they leave the row's absolute maximum alone).
        q, scale = quantize_row(out.to(NORM_DTYPE).to(tl.float32), QMAX, INT8)
        tl.store(out_ptr + o_offs, q, mask=mask)
        tl.store(scale_ptr + i0 * tl.num_programs(1) + i1, scale)
    else:
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """A [rows0, rows1, hidden] view (no copy for 1-, 2- or 3-d inputs)."""
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    quant: torch.dtype | None = None,
) -> torch.Tensor | tuple:
    """RMSNorm over the last dim of `x` ([..., hidden], any strides).

    Without `residual`: returns norm(x).
    With `residual` (same shape and dtype as x): writes x + residual INTO `residual`
    in place and returns (norm(x + residual), residual).
    The normed output goes to `out` when given (it may be `x` itself: each row is read
    before it is written), else to a new contiguous tensor. Its dtype follows torch's
    promotion of x and weight, as the reference's `weight * normed` does.

    With `quant` (torch.int8 or float8_e4m3fn; x 2-d, `out` unused): in place of norm(x), the pair
    (q, scale) that engine/kernels/w8a8.py quantize_rows(norm(x), quant) returns, bit for bit (contiguous
    [rows, hidden] 8-bit values, float32 [rows, 1] scales); the normed rows themselves are never stored.
    16-bit rows are rounded before they are quantized; float32 rows are not, and on CUDA the compiler may
    order this kernel's float32 arithmetic otherwise than the plain one's, so a row's scale can differ
    in its last bit there (measured on an H200; no served model computes its norms in float32 on CUDA).
    """
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, hidden)
    assert hidden <= 65536, "one block per row: hidden size too large"
    norm_dtype = torch.promote_types(x.dtype, weight.dtype)
    if quant is not None:
        assert x.dim() == 2 and out is None, "a quantized norm is of [tokens, hidden] rows, into new tensors"
        out = torch.empty(x.shape, dtype=quant, device=x.device)
        scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    elif out is None:
        out = torch.empty(x.shape, dtype=norm_dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert x.dim() <= 3, "the residual is updated in place, so it must not need a reshape copy"
    x3, o3 = _as_3d(x), _as_3d(out)
    r3 = _as_3d(residual) if residual is not None else x3  # dummy pointer when unused
    weight = weight.contiguous()
    block = triton.next_power_of_2(hidden)
    if x3.shape[0] * x3.shape[1] > 0:
        _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
            x3,
            r3,
            weight,
            o3,
            *x3.stride(),
            *r3.stride(),
            *o3.stride(),
            scales if quant is not None else o3,  # dummy pointer when unused
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            QUANT=quant is not None,
            QMAX=qmax(quant) if quant is not None else 0.0,
            INT8=quant == torch.int8,
            NORM_DTYPE=_TL_DTYPES[norm_dtype],
            # Enough warps that a thread holds at most ~16 floats of the row.
            num_warps=max(1, min(16, block // 512)),
            **pdl.launch(x.device, x.shape[0] if x.dim() > 1 else 1),
        )
    if quant is not None:
        out = (out, scales)
    if residual is None:
        return out
    return out, residual
