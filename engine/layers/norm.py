"""RMSNorm, with the residual add fused into the same call."""

from __future__ import annotations

import torch
from torch import nn

from engine.ops import TORCH_OPS, Ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, ops: Ops = TORCH_OPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
