"""RMSNorm (optionally fused with the residual add) as a Triton kernel.

Matches engine/layers/norm.py's rounding order: the residual sum is rounded to the
input dtype, the variance and x * rsqrt(var + eps) are float32, the result is cast to
the input dtype and only then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
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
    tl.store(out_ptr + i0 * o_s0 + i1 * o_s1 + cols * o_s2, out.to(out_ptr.dtype.element_ty), mask=mask)


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of `x` ([..., hidden], any strides).

    Without `residual`: returns norm(x).
    With `residual` (same shape and dtype as x): writes x + residual INTO `residual`
    in place and returns (norm(x + residual), residual).
    The normed output goes to `out` when given (it may be `x` itself: each row is read
    before it is written), else to a new contiguous tensor. Its dtype follows torch's
    promotion of x and weight, as the reference's `weight * normed` does.
    """
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, hidden)
    assert hidden <= 65536, "one block per row: hidden size too large"
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
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
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            # Enough warps that a thread holds at most ~16 floats of the row.
            num_warps=max(1, min(16, block // 512)),
        )
    if residual is None:
        return out
    return out, residual
