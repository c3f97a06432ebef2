"""Triton GPU kernels of the engine."""

from __future__ import annotations

import sys


def compiled_variants() -> dict[str, int]:
    """How many variants of each of the engine's Triton kernels this process has compiled (or
    loaded from Triton's disk cache) so far, by `module.kernel` name. It reads each JITFunction's
    per-device kernel cache (`device_caches`, Triton 3.x's own bookkeeping, not a public API): a
    diagnostic for benchmarks and tests, not used while serving."""
    import triton

    counts = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("engine."):
            continue
        for attr, obj in vars(module).items():
            if isinstance(obj, triton.runtime.jit.JITFunction):
                counts[f"{name}.{attr}"] = sum(len(cache[0]) for cache in obj.device_caches.values())
    return counts
