"""The attention entry point: prepares q and k (per-head norm, rotary), writes new K/V into the
paged cache and attends through block tables.

KV cache layout, per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim].
A token's slot is block_id * block_size + offset, so `cache.view(-1, kv_heads, head_dim)[slot]`
is that token's row (see ARCHITECTURE.md for why this layout).

Backends, one call for all:
- torch: plain PyTorch (any device); the reference the others are tested against.
- triton: the kernels of engine/kernels (tiled, online softmax, read through block tables).
- flash_attn: `flash_attn_varlen_func` with `block_table`, from the `flash-attn` package or from
  the build vLLM ships (`vllm.vllm_flash_attn`, FlashAttention-3 on Hopper).
  With triton on a Hopper GPU, prompt steps with a long query run (EngineConfig.fa4_prefill_min_tokens)
  attend through flash-attn-4 (`flash_attn.cute`) when it is installed: see `fa4_prefill_applies`.
- cpu: pagoda's C kernels (engine/cpu_ops.py) for decodes and short query runs; long fresh prompts
  keep the torch path, whose batched SDPA call is matmul-bound there.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding

BACKENDS = ("torch", "triton", "flash_attn", "cpu")
# On the cpu backend, sequences with at most this many new tokens take the C kernel (one loop per query,
# no matmul); longer ones the torch path, whose batched SDPA call is matmul-bound.
CPU_KERNEL_MAX_QUERY = 64


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

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    @functools.cached_property
    def cpu_split(self) -> tuple[torch.Tensor, list[int]]:
        """For the cpu backend, once per step: (int32 indices of the sequences the C kernel takes,
        the others' indices), split at CPU_KERNEL_MAX_QUERY new tokens."""
        lengths = [end - start for start, end in zip(self.query_start, self.query_start[1:])]
        short = [s for s, n in enumerate(lengths) if n <= CPU_KERNEL_MAX_QUERY]
        long = [s for s, n in enumerate(lengths) if n > CPU_KERNEL_MAX_QUERY]
        return torch.tensor(short, dtype=torch.int32), long


@dataclass
class QKPrep:
    """What q and k get before attention, in this order: a per-head RMSNorm (Qwen3's q_norm and
    k_norm; None for the others), then rotary embedding at `positions`. The Triton and
    FlashAttention backends fuse both into the KV-store kernel (engine/kernels/qkv_store.py);
    the torch and cpu backends run the modules themselves."""

    positions: torch.Tensor  # [T] on the device (a piecewise graph's is its captured size: the kernel reads T)
    rotary: RotaryEmbedding
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary(self.positions, q, k)


@functools.cache
def flash_attn_module():
    """(flash_attn_varlen_func, is_vllm_build) or None when no FlashAttention build imports."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func, True
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func, False
    except ImportError:
        return None


@functools.cache
def fa4_varlen():
    """flash-attn-4's `flash_attn_varlen_func` (FlashAttention's CuTe-DSL build), or None where it does
    not import."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # not installed, or its CUDA libraries do not load here
        return None
    return flash_attn_varlen_func


def fa4_prefill_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether long prompt steps should attend through flash-attn-4 here rather than pagoda's kernels.

    Measured on the H100 (`bench/gpu_check.py kernels`, bench/results/2026-11-24-h100-56c346d-gpu-check.jsonl):
    its warp-specialized Hopper forward (one warpgroup's softmax overlapped with another's matmuls,
    which Triton does not produce from prefill_fresh) is 1.19x faster than prefill_fresh at 2 x 8k
    tokens and 1.27x at 1 x 32k, level at 8 x 2k, and slower at 32 x 512; through the block tables
    1.2-1.5x faster than the paged kernel from 2k tokens. End to end (`gpu_check.py long-prompt`) a
    prompt's time to first token is level at 2k tokens, 4-14% shorter from 4k to 32k and 18% longer
    at 1k: hence the default threshold of 2,048. Its decode (no split-KV on Hopper) loses to
    pagoda's at every batch, so decodes never go there. Hopper only (where it was measured), its
    16-bit types, head dims of 8..256 in multiples of 8."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and dtype in (torch.bfloat16, torch.float16)
        and 8 <= head_dim <= 256
        and head_dim % 8 == 0
        and fa4_varlen() is not None
    )


@functools.cache
def _fa_version(device_index: int) -> int:
    return 3 if torch.cuda.get_device_capability(device_index)[0] == 9 else 2


def select_backend(name: str, device: torch.device, block_size: int, dtype: torch.dtype) -> str:
    """Resolve `auto` and check that the requested backend can run here."""
    from engine import cpu_ops

    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if cpu_ops.supports(dtype) else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend cpu runs on the CPU only")
        if dtype not in cpu_ops.SUFFIX:
            raise ValueError(f"attention_backend cpu supports float32 and bfloat16, not {dtype}")
        if not cpu_ops.available():
            raise ValueError("attention_backend cpu needs a C compiler to build engine/csrc/cpu_ops.c (see the log)")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend triton needs a CUDA device (or TRITON_INTERPRET=1 on the CPU)")
    if name == "flash_attn":
        found = flash_attn_module()
        if found is None or device.type != "cuda":
            raise ValueError("attention_backend flash_attn needs CUDA and the flash-attn package")
        # Upstream FlashAttention-2 pages the cache only in multiples of 256 tokens; vLLM's build does any.
        if not found[1] and block_size % 256:
            raise ValueError(f"the flash-attn package needs block_size a multiple of 256, got {block_size}")
    return name


class Attention(nn.Module):
    """Paged attention of one layer; the runner binds its K/V cache tensors after allocation."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend = "torch"  # set by the runner (select_backend)
        # Set by the runner where fa4_prefill_applies: with triton, prompt steps whose longest query run
        # has at least this many tokens attend through flash-attn-4 (0: never).
        self.fa4_min_tokens = 0
        # While the runner captures piecewise CUDA graphs (engine/piecewise_graphs.py): called instead of
        # attending, it ends one graph at this layer's attention and begins the next.
        self.split = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        prep: QKPrep | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D], before `prep` -> [T, H, D] (into `out` when given)."""
        if self.split is not None:
            return self.split(self, q, k, v, meta, prep)
        if self.backend in ("torch", "cpu"):  # no graphs on these: `out` only for a uniform signature
            if prep is not None:
                q, k = prep.apply(q, k)
            result = self._cpu(q, k, v, meta) if self.backend == "cpu" else self._torch(q, k, v, meta)
            return result if out is None else out.copy_(result)
        from engine.kernels.qkv_store import prepare_and_store

        rope = {} if prep is None else dict(positions=prep.positions, cos=prep.rotary.cos, sin=prep.rotary.sin)
        if prep is not None and prep.q_norm is not None:
            rope.update(q_norm=prep.q_norm.weight, k_norm=prep.k_norm.weight, eps=prep.q_norm.eps)
        prepare_and_store(q, k, v, self.k_cache, self.v_cache, meta.slot_mapping, **rope)
        if self.backend == "flash_attn":
            result = self._flash_attn(q, meta)
            return result if out is None else out.copy_(result)
        from engine.kernels import attention

        if self.fa4_min_tokens and meta.max_query_len >= self.fa4_min_tokens:
            result = self._fa4(q, k, v, meta)
            return result if out is None else out.copy_(result)
        if meta.decode_only:
            return attention.paged_decode(
                q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens_tensor, self.scale, out=out
            )
        if meta.fresh and attention.fresh_prefill_fits(q, k, v):  # k was prepared in place above
            return attention.prefill_fresh(q, k, v, meta.query_start_tensor, self.scale, meta.max_query_len, out=out)
        return attention.paged_prefill(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.query_start_tensor,
            meta.seq_lens_tensor,
            self.scale,
            meta.max_query_len,
            out=out,
        )

    def _torch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.decode_only:
            return self._decode(q, meta)
        return self._prefill(q, k, v, meta)

    def _flash_attn(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        varlen, vllm_build = flash_attn_module()
        kwargs = dict(
            cu_seqlens_q=meta.query_start_tensor,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
            block_table=meta.block_tables,
        )
        if vllm_build:
            # vLLM's build takes the key lengths directly (upstream wants them cumulative), and
            # FlashAttention-3 on Hopper.
            return varlen(
                q,
                self.k_cache,
                self.v_cache,
                seqused_k=meta.seq_lens_tensor,
                fa_version=_fa_version(q.device.index or 0),
                **kwargs,
            )
        cu_k = F.pad(meta.seq_lens_tensor.cumsum(0, dtype=torch.int32), (1, 0))
        return varlen(q, self.k_cache, self.v_cache, cu_seqlens_k=cu_k, **kwargs)

    def _fa4(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A long prompt step through flash-attn-4: from the step's own k/v (prepared in place) when every
        sequence is a whole prompt, as prefill_fresh does, else through the block tables, which also
        covers cached context and the decodes beside the prompt."""
        common = dict(
            cu_seqlens_q=meta.query_start_tensor,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=self.scale,
            causal=True,
        )
        if meta.fresh:
            result = fa4_varlen()(q, k, v, cu_seqlens_k=meta.query_start_tensor, **common)
        else:
            result = fa4_varlen()(
                q, self.k_cache, self.v_cache, seqused_k=meta.seq_lens_tensor, page_table=meta.block_tables, **common
            )
        return result[0] if isinstance(result, tuple) else result  # (out, lse)

    def _cpu(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        from engine import cpu_ops

        cpu_ops.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)
        short, long = meta.cpu_split
        if short.numel():
            cpu_ops.paged_attention(
                q,
                self.k_cache,
                self.v_cache,
                meta.block_tables,
                meta.query_start_tensor,
                meta.seq_lens_tensor,
                short,
                self.scale,
                out,
            )
        if long:
            self._prefill(q, k, v, meta, long, out)
        return out

    def _gather(self, cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """[S, nb] block ids -> [S, KVH, nb * block_size, D] keys or values."""
        s, nb = block_tables.shape
        rows = cache.view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1))
        return rows.view(s, nb * cache.shape[1], self.num_kv_heads, self.head_dim).transpose(1, 2)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        keys = self._gather(self.k_cache, meta.block_tables)
        values = self._gather(self.v_cache, meta.block_tables)
        positions = torch.arange(keys.shape[2], device=q.device)
        mask = (positions[None, :] < meta.seq_lens_tensor[:, None])[:, None, None, :]
        # The G = H / KVH query heads of a KV head become G query rows against it: one plain
        # batched attention with no K/V expansion.
        s, group = q.shape[0], self.num_heads // self.num_kv_heads
        grouped = q.view(s, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scale)
        return out.reshape(s, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        seqs: list[int] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows of the sequences `seqs` (default: all) into `out` (default: a new tensor)."""
        if out is None:
            out = torch.empty_like(q)
        # Sequences with nothing cached before this step (the common prompt) attend to this step's
        # own k/v, and those of one length share a single causal call; the others (chunks after
        # cached context, decodes in a mixed batch) gather their context from the cache one by one.
        fresh: dict[int, list[int]] = {}
        for s in range(len(meta.seq_lens)) if seqs is None else seqs:
            seq_len = meta.seq_lens[s]
            start, end = meta.query_start[s], meta.query_start[s + 1]
            if end - start == seq_len:
                fresh.setdefault(seq_len, []).append(start)
                continue
            out[start:end] = self._attend_cached(q[start:end], s, seq_len, meta)
        for length, starts in fresh.items():
            rows = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).view(-1)

            def batch(x: torch.Tensor) -> torch.Tensor:  # [n * length, heads, D] -> [n, heads, length, D]
                return x.index_select(0, rows).view(len(starts), length, x.shape[1], x.shape[2]).transpose(1, 2)

            o = F.scaled_dot_product_attention(
                batch(q), batch(k), batch(v), is_causal=True, scale=self.scale, enable_gqa=True
            )
            out.index_copy_(0, rows, o.transpose(1, 2).reshape(-1, self.num_heads, self.head_dim))
        return out

    def _attend_cached(self, qs: torch.Tensor, s: int, seq_len: int, meta: AttentionMetadata) -> torch.Tensor:
        """Sequence s's new queries [q_len, H, D] against its whole context, read from the cache."""
        block_size = self.k_cache.shape[1]
        num_blocks = -(-seq_len // block_size)
        table = meta.block_tables[s : s + 1, :num_blocks]
        keys = self._gather(self.k_cache, table)[:, :, :seq_len]
        values = self._gather(self.v_cache, table)[:, :, :seq_len]
        q_len = qs.shape[0]
        # Query i sits at position seq_len - q_len + i and sees keys up to it.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=qs.device)
        mask = q_pos[:, None] >= torch.arange(seq_len, device=qs.device)[None, :]
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
        return o[0].transpose(0, 1)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each new token's K/V row into its cache slot (the torch backend's; no padding slots)."""
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)
