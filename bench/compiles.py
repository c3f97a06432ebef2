"""Count the Triton kernel variants a block of code compiles (or loads from Triton's disk cache).

Through Triton's public `knobs.runtime.jit_cache_hook`, which Triton calls each time a kernel meets
arguments that no variant compiled in this process fits."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator


@contextlib.contextmanager
def count_compiles() -> Iterator[Counter]:
    """Within the block, the returned Counter maps `module.kernel` to the variants compiled."""
    from triton import knobs

    counts: Counter = Counter()
    previous = knobs.runtime.jit_cache_hook

    def hook(*, fn, **kwargs) -> bool:
        counts[f"{fn.module}.{fn.name}"] += 1
        return bool(previous(fn=fn, **kwargs)) if previous else False  # False: compile as usual

    knobs.runtime.jit_cache_hook = hook
    try:
        yield counts
    finally:
        knobs.runtime.jit_cache_hook = previous
