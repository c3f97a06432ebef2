"""Attention backends: one class per family of kernels behind one interface (base.AttentionBackend),
chosen once at start-up by `select_backend`.

- torch: plain PyTorch (any device); the reference the others are tested against.
- cpu: pagoda's C kernels (engine/cpu_ops.py); the default on the CPU.
- triton: pagoda's Triton kernels (engine/kernels); the default on CUDA. On a Hopper GPU with
  flash-attn-4 installed, long prompt steps go to flash-attn-4 (EngineConfig.fa4_prefill_min_tokens).
- flash_attn: FlashAttention's paged varlen forward, from the `flash-attn` package or vLLM's build.
"""

from __future__ import annotations

import logging
import os

import torch

from engine.attention.base import Attention, AttentionBackend, AttentionMetadata, QKPrep
from engine.config import BACKENDS

log = logging.getLogger("pagoda.runner")


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int = 128,
    fa4_prefill_min_tokens: int = 0,
    max_num_batched_tokens: int = 0,
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The backend `name` (or, for `auto`, the best one here), after checking that it can run here and
    can read a KV cache of `kv_cache_dtype` (default: `dtype`)."""
    from engine import cpu_ops, kv_fp8

    fp8 = kv_cache_dtype is not None and kv_fp8.is_fp8(kv_cache_dtype)

    if name == "auto":
        name = "triton" if device.type == "cuda" else ("cpu" if cpu_ops.supports(dtype) else "torch")
    if name == "torch":
        from engine.attention.torch_ref import TorchBackend

        return TorchBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend cpu runs on the CPU only")
        if dtype not in cpu_ops.SUFFIX:
            raise ValueError(f"attention_backend cpu supports float32 and bfloat16, not {dtype}")
        if not cpu_ops.available():
            raise ValueError("attention_backend cpu needs a C compiler to build engine/csrc/cpu_ops.c (see the log)")
        from engine.attention.cpu import CpuBackend, CpuFp8Backend

        return CpuFp8Backend() if fp8 else CpuBackend()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend triton needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
        from engine.attention.flash_attn import TritonFa4Backend, fa4_prefill_applies
        from engine.attention.triton import TritonBackend

        # A threshold above the step budget is never met. flash-attn-4 is not given an fp8 cache to read.
        if (
            not fp8
            and 0 < fa4_prefill_min_tokens <= max_num_batched_tokens
            and fa4_prefill_applies(device, dtype, head_dim)
        ):
            log.info(
                "prompt steps with a prompt chunk of %d+ tokens attend through flash-attn-4", fa4_prefill_min_tokens
            )
            return TritonFa4Backend(device, fa4_prefill_min_tokens)
        return TritonBackend(device)
    if name == "flash_attn":
        if fp8:
            raise ValueError(
                "attention_backend flash_attn does not read an fp8 KV cache here; with kv_cache_dtype fp8 use "
                "attention_backend triton (auto's choice on CUDA)"
            )
        from engine.attention.flash_attn import FlashAttnBackend, flash_attn_module

        found = flash_attn_module()
        if found is None or device.type != "cuda":
            raise ValueError("attention_backend flash_attn needs CUDA and the flash-attn package")
        # Upstream FlashAttention-2 pages the cache only in multiples of 256 tokens; vLLM's build does any.
        if not found[1] and block_size % 256:
            raise ValueError(f"the flash-attn package needs block_size a multiple of 256, got {block_size}")
        return FlashAttnBackend(device)
    raise ValueError(f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")


__all__ = ["BACKENDS", "Attention", "AttentionBackend", "AttentionMetadata", "QKPrep", "select_backend"]
