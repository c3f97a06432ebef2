"""The fp8 KV cache's arithmetic in torch (the reference every kernel is checked against): K and V are
stored as value / scale, saturated to the fp8 format's range, and read back as stored * scale, with one
float32 scale per layer for K and one for V (EngineConfig.kv_cache_dtype, calculate_kv_scales)."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in `dtype` (fp8), saturated: a plain cast turns an out-of-range value into NaN."""
    top = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-top, top).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored fp8 values back to `dtype`: x * scale."""
    return (x.float() * scale).to(dtype)


# --calculate-kv-scales sees only the first prompt, and later text reaches larger K and V: its largest
# magnitude is mapped to the fp8 maximum / KV_SCALE_HEADROOM, so values up to 4x it are stored unsaturated.
# The headroom costs only range at the bottom (E4M3 spans 2^15 normal values; 2 of its 15 binades).
KV_SCALE_HEADROOM = 4.0


def amax_scale(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps x's largest magnitude onto the fp8 maximum / KV_SCALE_HEADROOM
    (--calculate-kv-scales); never 0, so an all-zero x (nothing to calibrate on) cannot make the store
    divide by zero."""
    top = torch.finfo(dtype).max / KV_SCALE_HEADROOM
    return (x.abs().amax().float() / top).clamp_min(1e-6).reshape(1)


def raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache as bytes for an fp8 one (block copies index through it: torch's index kernels do not
    all take float8 types), else itself."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache
