"""SwiGLU (silu(gate) * up on a fused gate/up projection) as a Triton kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_s0, x_s1, inter, BLOCK: tl.constexpr):
    # Grid: (tokens, column blocks of the intermediate size).
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + t * x_s0
    gate = tl.load(row + cols * x_s1, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + (cols + inter) * x_s1, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # Like the reference: F.silu rounds to the input dtype, then the product rounds again.
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(
        out_ptr + t * inter + cols,  # out is contiguous
        (silu * up).to(dtype),
        mask=mask,
    )


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[..., 2 * I] -> [..., I] = silu(gate) * up, gate the first half.

    Written into `out` when given (contiguous, gate_up's dtype), else into a new tensor."""
    two_i = gate_up.shape[-1]
    assert two_i % 2 == 0
    inter = two_i // 2
    x = gate_up.reshape(-1, two_i)  # a view for 2-d inputs, whatever their row stride
    shape = (*gate_up.shape[:-1], inter)
    if out is None:
        out = torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == shape and out.dtype == gate_up.dtype and out.is_contiguous()
    if x.shape[0] > 0:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            x, out, x.stride(0), x.stride(1), inter, BLOCK=block, num_warps=4
        )
    return out
