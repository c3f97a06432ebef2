"""What every attention backend shares: the step's metadata, the q/k preparation, the backend
interface, and the `Attention` layer that calls its backend.

KV cache layout, per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim]. A token's
slot is block_id * block_size + offset, so `cache.view(-1, kv_heads, head_dim)[slot]` is that
token's row (ARCHITECTURE.md says why this layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine import kv_fp8
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.ops import TORCH_OPS, Ops


@dataclass
class AttentionMetadata:
    """Where a flat batch of tokens sits in the paged cache; built once per step by the runner."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1: padding, not stored)
    query_start: list[int]  # [S + 1]: sequence s owns new tokens query_start[s]:query_start[s+1]
    seq_lens: list[int]  # [S]: tokens in the cache for s after this step (context + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    seq_lens_tensor: torch.Tensor  # [S] int32, on device
    query_start_tensor: torch.Tensor  # [S + 1] int32, on device
    max_query_len: int
    max_seq_len: int
    fresh: bool = False  # every sequence is a whole prompt with nothing cached before this step
    plan: Any = None  # what the backend's `plan` worked out for this step, read by every layer
    # > 1: a verify graph's step (engine/runner/cuda_graphs.py): sequence s owns rows s*q .. s*q + q-1, the first
    # query_lens_tensor[s] its last tokens, the rest padding (stored nowhere, read by no one).
    queries_per_seq: int = 1
    query_lens_tensor: torch.Tensor | None = None  # [S] int32 on the device, with queries_per_seq > 1
    # A prompt-step graph's step (engine/runner/cuda_graphs.py: PrefillGraphs): [P, 2] int32 on the device, the
    # (sequence, query tile) each program of the prompt attention runs (-1: none), so that its grid is fixed;
    # query_start / seq_lens / max_query_len on the host are then placeholders.
    tile_map: torch.Tensor | None = None

    @property
    def decode_only(self) -> bool:
        """Every sequence owns the same number of query rows (one: a decode batch; several: a verify graph's
        step): what `AttentionBackend.decode` attends."""
        return self.max_query_len == 1 or self.queries_per_seq > 1


@dataclass
class QKPrep:
    """What q and k get before attention, in this order: a per-head RMSNorm (Qwen3's q_norm and
    k_norm; None for the others), then rotary embedding at `positions`. The GPU backends fuse both
    into their KV-store kernel (engine/kernels/qkv_store.py); the others run the modules."""

    positions: torch.Tensor  # [T] on the device (a graph's may be longer: the kernel reads the first T)
    rotary: RotaryEmbedding
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary(self.positions, q, k)


class AttentionBackend:
    """One family of attention kernels. Chosen once at start-up (engine/attention/__init__.py:
    select_backend); every layer's `Attention` calls the same instance.

    A step: the runner calls `plan` once on the step's metadata; then each layer calls `write_kv`
    (prepare q/k, store the new K/V), and `decode` for a batch of one-token queries or `prefill`
    for anything else (prompt chunks, with or without cached context, and decodes beside them)."""

    name = "base"
    ops: Ops = TORCH_OPS  # the norm / SwiGLU kernels that go with these attention kernels
    supports_graphs = False  # its calls can be captured in CUDA graphs
    # Its `decode` attends several queries a sequence (AttentionMetadata.queries_per_seq), causally: verify steps
    # of speculative decoding replay whole-step graphs (engine/runner/cuda_graphs.py).
    supports_verify_graphs = False
    # Whole prompt steps can be captured: its `prefill` takes AttentionMetadata.tile_map (a grid fixed at capture),
    # and it has prefill_queries_per_tile(layer), prefill_tile_capacity and prefill_tile_map (TritonBackend's).
    supports_prompt_graphs = False
    pad_block_tables = 1  # block-table width is padded to a multiple of this (kernel variants; step_inputs.py)
    # Prompt lengths whose forwards compile every kernel variant a prompt step can meet; run at start-up
    # with and without cached context (ModelRunner.compile_kernels). Empty: nothing to compile.
    warmup_prompt_lens: tuple[tuple[int, ...], ...] = ()

    def plan(self, meta: AttentionMetadata) -> None:
        """Per-step work every layer would otherwise repeat; stored in `meta.plan`."""

    def write_kv(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        prep: QKPrep | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare q and k (`prep`), store k and v at the step's slots; returns the prepared q and k."""
        raise NotImplementedError

    def prefill(
        self,
        layer: Attention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Queries of any length per sequence against their whole context -> [T, H, D]."""
        raise NotImplementedError

    def decode(self, layer: Attention, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence, q [S, H, D], against its context -> [S, H, D]; with
        meta.queries_per_seq q > 1 (backends that support verify graphs), q is [S * q, H, D]."""
        raise NotImplementedError


class Attention(nn.Module):
    """Paged attention of one layer; the runner binds its K/V cache tensors after allocation and its
    backend at start-up."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # An fp8 cache's per-layer K and V scales (engine/kv_fp8.py): tensors the kernels read on the
        # device, so that CUDA graphs captured before --calculate-kv-scales sets them see the values.
        self.k_scale = torch.ones(1, dtype=torch.float32)
        self.v_scale = torch.ones(1, dtype=torch.float32)
        # Set by the runner with --calculate-kv-scales: the next prompt step sets the scales, then clears it.
        self.calibrate_kv_scales = False
        if backend is None:
            from engine.attention.torch_ref import TorchBackend

            backend = TorchBackend()
        self.backend = backend

    @property
    def rounds_kv_back(self) -> bool:
        """Whether `write_kv` also rewrites the step's k and v in place as an fp8 cache holds them
        (dequantize(quantize(x))), so that whole fresh prompts attending to their own k/v see the cache's
        values. Not in the first store of a --calculate-kv-scales step: _calibrate takes its scales from
        the unrounded values and stores them again."""
        return kv_fp8.is_fp8(self.k_cache.dtype) and not self.calibrate_kv_scales

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        prep: QKPrep | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D], before `prep` -> [T, H, D]."""
        backend = self.backend
        q, k = backend.write_kv(self, q, k, v, meta, prep)
        if self.calibrate_kv_scales and not meta.decode_only:
            self._calibrate(q, k, v, meta)
        if meta.decode_only:
            return backend.decode(self, q, meta)
        return backend.prefill(self, q, k, v, meta)

    def _calibrate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """--calculate-kv-scales: scales from this step's (prepared) k and v, in place; then the step's
        K/V are stored again with them (the first store used the old ones). Only once."""
        self.k_scale.copy_(kv_fp8.amax_scale(k, self.k_cache.dtype))
        self.v_scale.copy_(kv_fp8.amax_scale(v, self.v_cache.dtype))
        self.calibrate_kv_scales = False  # first: this store rounds k and v back (rounds_kv_back)
        self.backend.write_kv(self, q, k, v, meta, None)  # q and k are prepared already
