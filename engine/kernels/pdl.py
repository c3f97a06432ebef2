"""Programmatic dependent launch (PDL) for the Triton kernels of engine/kernels, in small decode graphs.

A decode step is some 300 short kernels back to back in one CUDA graph (about ten a layer); between two of
them the GPU idles while the next is launched and its programs are placed on the multiprocessors. Launched
with PDL (Hopper and later), a kernel may be placed while the one before it still runs. Each kernel here
that is launched so first waits (griddepcontrol.wait) until the kernel before it has finished and its
writes are visible, before any load or store of its own, and then lets the next kernel be placed
(griddepcontrol.launch_dependents). (The decode GEMV may prefetch weight bytes into L2 before it waits,
GemvTiles.l2_ahead: a weight is no kernel's output, and a prefetch returns nothing.) So the order of
memory accesses is the stream's, as without PDL; what it removes is the launch gap: the next kernel's
programs are resident and waiting when this one ends. At most two kernels are in flight: the running one
and the next, whose programs wait. A kernel launched without PDL (torch's, cuBLAS's) waits for the whole
of the one before it, as always.

Where: launches of at most RELEASE_MAX_ROWS rows inside `chained()`, which the decode graphs' warm-up and
capture enter (engine/runner/cuda_graphs.py). The kernels a decode step launches take part (RMSNorm, the
qkv store, decode attention and its reduce, SwiGLU, the GEMV, the decode tl.dot kernel, quantize_rows and
the W8A8 GEMM); the prompt-only ones (prefill attention, prefill_fresh, the prompt weight-only kernel) never
run in a decode graph and launch as they always did. At one to four rows a decode step is a chain of kernels of a
few microseconds each, where the gap is a large part of each. Larger launches, eager steps and the prompt
graphs keep the plain stream order (WRITEUP.md: with PDL there, at 16 rows the waiting programs took slots
the running kernel needed, and W2 was 0.5% slower). The launch attribute is a compile option of Triton's,
so a kernel launched both ways compiles twice: the small decode graphs warm up once outside `chained` (the
plain variants, which an eager step of those rows launches) and once inside (the PDL ones, which only the
captures launch), both at start-up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from functools import cache
from types import MappingProxyType

import torch
import triton
import triton.language as tl

RELEASE_MAX_ROWS = 4

_CHAINED: ContextVar[bool] = ContextVar("pdl_chained", default=False)


@cache
def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with PDL: CUDA devices of compute capability 9.0 and later (never
    the interpreter, whose tensors are on the CPU)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@contextlib.contextmanager
def chained() -> Iterator[None]:
    """Within: launches of at most RELEASE_MAX_ROWS rows on an `enabled` device use PDL."""
    token = _CHAINED.set(True)
    try:
        yield
    finally:
        _CHAINED.reset(token)


_ON = MappingProxyType({"PDL": 1, "launch_pdl": True})
_OFF = MappingProxyType({"PDL": 0, "launch_pdl": False})


def launch(device: torch.device, rows: int) -> Mapping:
    """The keyword arguments of a kernel launch of `rows` rows on `device`: the kernel's PDL constexpr and
    Triton's launch_pdl (the launch attribute), both on within `chained` at most RELEASE_MAX_ROWS rows (one of
    two shared read-only mappings: every launch of an eager step asks)."""
    return _ON if _CHAINED.get() and rows <= RELEASE_MAX_ROWS and enabled(device) else _OFF


@triton.jit
def enter(PDL: tl.constexpr):
    """A kernel's first statement: with PDL, wait for the kernel before it, then release the next one."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
