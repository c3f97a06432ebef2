"""RMSNorm, with the residual add fused into the same call."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import QuantizedActivation
from engine.ops import TORCH_OPS, Ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, ops: Ops = TORCH_OPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, quant: torch.dtype | None = None
    ) -> torch.Tensor | QuantizedActivation | tuple:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual).
        With `quant` (an 8-bit type that engine/layers/linear.py fused_input_quant named, so the Triton ops):
        norm(...) comes quantized per row, as a QuantizedActivation."""
        if quant is None:
            return self.ops.rms_norm(x, self.weight, self.eps, residual)
        out = self.ops.rms_norm(x, self.weight, self.eps, residual, quant=quant)
        if residual is None:
            return QuantizedActivation(*out)
        return QuantizedActivation(*out[0]), out[1]
