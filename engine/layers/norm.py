"""RMSNorm, with the residual add fused into the same call."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.kernels = "torch"  # torch | triton | cpu: set by the runner with the attention backend

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 and cast back before the weight, as Hugging Face Llama does,
        # so half-precision outputs round the same way.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.kernels == "triton":
            from engine.kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if self.kernels == "cpu":
            from engine import cpu_ops

            return cpu_ops.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
