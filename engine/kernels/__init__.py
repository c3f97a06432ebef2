"""Triton GPU kernels of the engine."""

from __future__ import annotations

import sys


def compiled_variants() -> dict[str, int]:
    """How many variants of each of the engine's Triton kernels this process has compiled (or
    loaded from Triton's disk cache) so far, by `module.kernel` name, and of flash-attn-4's forward
    once it is imported. It reads each JITFunction's per-device kernel cache (`device_caches`,
    Triton 3.x's own bookkeeping) and flash-attn-4's compile cache (its `.cache` dict): neither is a
    public API; a diagnostic for benchmarks and tests, not used while serving."""
    import triton

    counts = {}
    fa4 = sys.modules.get("flash_attn.cute.interface")
    if fa4 is not None:
        counts["flash_attn.cute._flash_attn_fwd"] = len(fa4._flash_attn_fwd.compile_cache.cache)
    for name, module in list(sys.modules.items()):
        if not name.startswith("engine."):
            continue
        for attr, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                counts[f"{name}.{attr}"] = sum(len(cache[0]) for cache in obj.device_caches.values())
    return counts
