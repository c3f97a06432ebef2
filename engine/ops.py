"""The device ops table: the fused RMSNorm and SwiGLU that the model's layers call.

One table per kernel family (plain PyTorch, pagoda's C kernels on the CPU, Triton on CUDA), picked
once at start-up together with the attention backend (engine/attention) and handed to the model
when it is built, so a layer calls `self.ops.rms_norm(...)` with no switch in the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Ops:
    name: str
    # (x, weight, eps, residual or None) -> norm(x), or (norm(x + residual), x + residual) with a residual.
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    # A fused [.., 2 * I] gate/up projection -> silu(gate) * up, [.., I].
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The reference RMSNorm. Computed in float32 and cast back before the weight, as Hugging Face
    Llama does, so half-precision outputs round the same way."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * x32.to(x.dtype)
    return normed if residual is None else (normed, x)


def torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


TORCH_OPS = Ops("torch", torch_rms_norm, torch_silu_and_mul)


def cpu_ops_table() -> Ops:
    """pagoda's C kernels (engine/cpu_ops.py); the caller has checked that they built."""
    from engine import cpu_ops

    return Ops("cpu", cpu_ops.rms_norm, cpu_ops.silu_and_mul)


def triton_ops_table() -> Ops:
    """The Triton kernels of engine/kernels (CUDA, or the interpreter with TRITON_INTERPRET=1)."""
    from engine.kernels.activation import silu_and_mul
    from engine.kernels.norm import rms_norm

    return Ops("triton", rms_norm, silu_and_mul)
