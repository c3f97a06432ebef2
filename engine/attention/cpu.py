"""The cpu backend: pagoda's C kernels (engine/cpu_ops.py) for decodes and short query runs; long
fresh prompts take the torch path, whose batched SDPA call is matmul-bound there."""

from __future__ import annotations

import torch

from engine import cpu_ops
from engine.attention import torch_ref
from engine.attention.base import AttentionBackend, AttentionMetadata, QKPrep
from engine.ops import cpu_ops_table

# Sequences with at most this many new tokens take the C kernel (one loop per query, no matmul);
# longer ones the torch path, whose batched SDPA call is matmul-bound.
CPU_KERNEL_MAX_QUERY = 64


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(self):
        self.ops = cpu_ops_table()

    def plan(self, meta: AttentionMetadata) -> None:
        """(int32 indices of the sequences the C kernel takes, the others' indices)."""
        lengths = [end - start for start, end in zip(meta.query_start, meta.query_start[1:])]
        short = [s for s, n in enumerate(lengths) if n <= CPU_KERNEL_MAX_QUERY]
        long = [s for s, n in enumerate(lengths) if n > CPU_KERNEL_MAX_QUERY]
        meta.plan = (torch.tensor(short, dtype=torch.int32), long)

    def write_kv(self, layer, q, k, v, meta, prep):
        q, k = _prepare(q, k, prep)
        cpu_ops.store_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        return q, k

    def prefill(self, layer, q, k, v, meta):
        result = torch.empty(q.shape, dtype=q.dtype)
        short, long = meta.plan
        if short.numel():
            cpu_ops.paged_attention(
                q,
                layer.k_cache,
                layer.v_cache,
                meta.block_tables,
                meta.query_start_tensor,
                meta.seq_lens_tensor,
                short,
                layer.scale,
                result,
            )
        if long:
            torch_ref.prefill(layer, q, k, v, meta, long, result)
        return result

    def decode(self, layer, q, meta):
        return self.prefill(layer, q, None, None, meta)


def _prepare(q: torch.Tensor, k: torch.Tensor, prep: QKPrep | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k normed (Qwen3) and rotated by the C kernels."""
    if prep is not None:
        if prep.q_norm is not None:
            q, k = prep.q_norm(q), prep.k_norm(k)
        q, k = cpu_ops.apply_rotary(prep.positions, q, k, prep.rotary.cos, prep.rotary.sin)
    return q, k


class CpuFp8Backend(CpuBackend):
    """The cpu backend over an fp8 KV cache: the C kernels still norm, rotate and run the MLP, but the
    cache is written and attended by the torch reference (quantizing on the store, dequantizing the
    gathered K/V), since the C attention and store kernels read only float32 / bfloat16 caches."""

    name = "cpu+torch-fp8"  # C norms, rotary and SwiGLU; torch store and attention

    def plan(self, meta: AttentionMetadata) -> None:
        pass

    def write_kv(self, layer, q, k, v, meta, prep):
        q, k = _prepare(q, k, prep)
        torch_ref.store_kv(
            k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale, layer.rounds_kv_back
        )
        return q, k

    def prefill(self, layer, q, k, v, meta):
        return torch_ref.prefill(layer, q, k, v, meta)

    def decode(self, layer, q, meta):
        return torch_ref.decode(layer, q, meta)
