"""The CPU kernels of engine/csrc/cpu_ops.c: built on first use with the system C compiler, called through ctypes.

Why C: on the CPU a decode step of a small model is mostly many small operations (attention over a
few hundred keys per sequence, norms, rotary, SwiGLU on a few rows), and in PyTorch each one costs
microseconds of dispatch, temporaries and, for attention, a gather of every context row. One C loop
per operation does the same arithmetic with none of that.

The shared library is cached under $PAGODA_CACHE/kernels (default ~/.cache/pagoda/kernels), keyed by
the source, the compiler flags and the CPU, since -march=native code runs only on a CPU like the one
it was built on. Without a working compiler `available()` is False and the torch path is used.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("pagoda.engine")

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.c"
INCLUDES = [SOURCE.parent / "cpu_kernels.inc"]  # hashed with the source: a change rebuilds
# -fno-math-errno: sqrtf and friends become instructions the vectorizer can use.
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
SIGNATURES = {
    "store_kv": [_P, _I, _P, _I, _P, _P, _P, _I, _I],
    "paged_attention": [_P, _P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _F, _P],
    "add_rms_norm": [_P, _P, _P, _P, _P, _I, _I, _F],
    "rotary": [_P, _P, _I, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I],
    "silu_and_mul": [_P, _P, _I, _I],
}


def _cpu_id() -> str:
    """The CPU model and instruction-set flags: what -march=native compiled code depends on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))


def _cache_dir() -> Path:
    root = os.environ.get("PAGODA_CACHE") or Path.home() / ".cache" / "pagoda"
    return Path(root) / "kernels"


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    source = b"".join(path.read_bytes() for path in [SOURCE, *INCLUDES])
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode() + _cpu_id().encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, target)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"compiling {SOURCE.name} failed: {exc.stderr.strip()[-2000:]}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as exc:
        log.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return None
    for name, argtypes in SIGNATURES.items():
        for dtype, suffix in SUFFIX.items():
            fn = getattr(lib, f"{name}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = None
            _FUNCTIONS[name, dtype] = fn
    return lib


# (kernel name, dtype) -> its ctypes function, filled by _library(). The wrappers below run ~150 times
# per decode step, so they look functions up in one dict and skip checks torch would repeat: at batch 16
# a wrapper that repeats them costs 3-4x the kernel (33 us around a 7 us RMSNorm).
_FUNCTIONS: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}


def release_openmp_threads() -> bool:
    """Release the calling thread's OpenMP worker threads (OpenMP 5.0 `omp_pause_resource_all`).

    Call it on a thread that has run torch's parallel operators (the model load) before another
    thread takes over the compute: libgomp counts every thread of every team, and once there are
    more than cores it stops spinning between parallel regions, so each of the ~250 regions of a
    CPU decode step waits on a futex wake-up (measured: an engine stepped in a new thread ran a
    batch-4 step in ~50 ms instead of ~25). Returns whether the runtime did it."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")  # the OpenMP runtime torch already loaded
        return gomp.omp_pause_resource_all(1) == 0  # 1 = omp_pause_soft
    except (OSError, AttributeError):
        return False


def available() -> bool:
    """Whether the kernels are built and loadable on this machine."""
    return _library() is not None


def supports(dtype: torch.dtype) -> bool:
    return dtype in SUFFIX and available()


def _fn(name: str, dtype: torch.dtype):
    return _FUNCTIONS[name, dtype]


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [T, heads, D] whose token rows may be spaced out (a column slice of a fused projection), as
    (x, the element stride between token rows); copied only when a row itself is not contiguous."""
    heads, dim = x.shape[1], x.shape[2]
    if x.stride(2) != 1 or x.stride(1) != dim:
        x = x.contiguous()
    return x, x.stride(0) if x.shape[0] > 1 else heads * dim


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v [T, KVH, D] into the cache rows of slot_mapping [T] int64 (negative slots skipped)."""
    (k, k_stride), (v, v_stride) = _rows(k), _rows(v)
    slot_mapping = slot_mapping.long()  # the kernel reads int64 (a no-op for the engine's own)
    _fn("store_kv", k.dtype)(
        k.data_ptr(),
        k_stride,
        v.data_ptr(),
        v_stride,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slot_mapping.data_ptr(),
        k.shape[0],
        k.shape[1] * k.shape[2],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of the sequences `seqs` [n] int32 through the paged cache, into `out` [T, H, D].

    query_start [S + 1] and seq_lens [S] are int32 (as in AttentionMetadata); block_tables [S, max_blocks]."""
    q = q.contiguous()
    _fn("paged_attention", q.dtype)(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        query_start.data_ptr(),
        seq_lens.data_ptr(),
        seqs.data_ptr(),
        seqs.numel(),
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        scale,
        out.data_ptr(),
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim; with `residual`, (norm(x + residual), x + residual) as in RMSNorm.forward."""
    x = x.contiguous()
    out = torch.empty_like(x)
    hidden = x.shape[-1]
    if residual is None:
        _fn("add_rms_norm", x.dtype)(
            x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, x.numel() // hidden, hidden, eps
        )
        return out
    residual = residual.contiguous()
    summed = torch.empty_like(x)
    _fn("add_rms_norm", x.dtype)(
        x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        summed.data_ptr(),
        x.numel() // hidden,
        hidden,
        eps,
    )
    return out, summed


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [T, Hq, D] and k [T, Hk, D] at positions [T] int64, into new contiguous tensors."""
    (q, q_stride), (k, k_stride) = _rows(q), _rows(k)
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    positions = positions.long()  # the kernel reads int64 (a no-op for the engine's own)
    _fn("rotary", q.dtype)(
        positions.data_ptr(),
        q.data_ptr(),
        q_stride,
        k.data_ptr(),
        k_stride,
        q_out.data_ptr(),
        k_out.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[2],
    )
    return q_out, k_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [T, 2I] projection."""
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    _fn("silu_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * inter), inter)
    return out
