"""Rotary position embedding (rotate-half layout), with Llama 3 and linear scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(config: dict) -> dict:
    """The rope settings of a HF config.json, old (`rope_scaling` + `rope_theta`) or new (`rope_parameters`) style."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_context = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are slowed down by `factor`, short ones kept,
        # and the band between is interpolated smoothly.
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
        middle = (wavelen <= old_context / low_freq_factor) & (wavelen >= old_context / high_freq_factor)
        return torch.where(middle, scaled, out)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to q and k, laid out [tokens, heads, head_dim]."""

    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # A float32 table, indexed by position each step: the same values HF computes on the fly.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
