"""The torch backend: plain PyTorch on any device, the reference every other backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kv_fp8
from engine.attention.base import Attention, AttentionBackend, AttentionMetadata


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, layer, q, k, v, meta, prep):
        if prep is not None:
            q, k = prep.apply(q, k)
        store_kv(
            k, v, layer.k_cache, layer.v_cache, meta.slot_mapping, layer.k_scale, layer.v_scale, layer.rounds_kv_back
        )
        return q, k

    def prefill(self, layer, q, k, v, meta):
        return prefill(layer, q, k, v, meta)

    def decode(self, layer, q, meta):
        return decode(layer, q, meta)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    write_back: bool = False,
) -> None:
    """Write each new token's K/V row into its cache slot (no padding slots); an fp8 cache takes them
    divided by the scales (engine/kv_fp8.py), and with `write_back` k and v are rewritten in place as the
    cache reads them (Attention.rounds_kv_back)."""
    kvh, d = k.shape[1], k.shape[2]
    if kv_fp8.is_fp8(k_cache.dtype):
        k8 = kv_fp8.quantize(k, k_scale, k_cache.dtype)
        v8 = kv_fp8.quantize(v, v_scale, v_cache.dtype)
        if write_back:
            k.copy_(kv_fp8.dequantize(k8, k_scale, k.dtype))
            v.copy_(kv_fp8.dequantize(v8, v_scale, v.dtype))
        k, v = k8, v8
    kv_fp8.raw(k_cache).view(-1, kvh, d).index_copy_(0, slot_mapping, kv_fp8.raw(k))
    kv_fp8.raw(v_cache).view(-1, kvh, d).index_copy_(0, slot_mapping, kv_fp8.raw(v))


def _gather(
    layer: Attention, cache: torch.Tensor, scale: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """[S, nb] block ids -> [S, KVH, nb * block_size, D] keys or values in `dtype` (an fp8 cache's
    dequantized with `scale`)."""
    s, nb = block_tables.shape
    rows = kv_fp8.raw(cache).view(cache.shape[0], -1).index_select(0, block_tables.reshape(-1))
    if kv_fp8.is_fp8(cache.dtype):
        rows = kv_fp8.dequantize(rows.view(cache.dtype), scale, dtype)
    return rows.view(s, nb * cache.shape[1], layer.num_kv_heads, layer.head_dim).transpose(1, 2)


def _keys_values(layer: Attention, block_tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        _gather(layer, layer.k_cache, layer.k_scale, block_tables, dtype),
        _gather(layer, layer.v_cache, layer.v_scale, block_tables, dtype),
    )


def decode(layer: Attention, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    keys, values = _keys_values(layer, meta.block_tables, q.dtype)
    positions = torch.arange(keys.shape[2], device=q.device)
    mask = (positions[None, :] < meta.seq_lens_tensor[:, None])[:, None, None, :]
    # The G = H / KVH query heads of a KV head become G query rows against it: one plain
    # batched attention with no K/V expansion.
    s, group = q.shape[0], layer.num_heads // layer.num_kv_heads
    grouped = q.view(s, layer.num_kv_heads, group, layer.head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=layer.scale)
    return out.reshape(s, layer.num_heads, layer.head_dim)


def prefill(
    layer: Attention,
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
    # Over an fp8 cache the store has rounded k and v to the cache's values (Attention.rounds_kv_back):
    # a token sees the same keys whether its prompt came whole, in chunks, after a prefix-cache hit or
    # recomputed after preemption.
    fresh: dict[int, list[int]] = {}
    for s in range(len(meta.seq_lens)) if seqs is None else seqs:
        seq_len = meta.seq_lens[s]
        start, end = meta.query_start[s], meta.query_start[s + 1]
        if end - start == seq_len:
            fresh.setdefault(seq_len, []).append(start)
            continue
        out[start:end] = _attend_cached(layer, q[start:end], s, seq_len, meta)
    for length, starts in fresh.items():
        rows = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).view(-1)
        qs, ks, vs = (_batched(x, rows, len(starts), length) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=layer.scale, enable_gqa=True)
        out.index_copy_(0, rows, o.transpose(1, 2).reshape(-1, layer.num_heads, layer.head_dim))
    return out


def _batched(x: torch.Tensor, rows: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """[n * length, heads, D] rows of `x` -> [n, heads, length, D]."""
    return x.index_select(0, rows).view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)


def _attend_cached(layer: Attention, qs: torch.Tensor, s: int, seq_len: int, meta: AttentionMetadata) -> torch.Tensor:
    """Sequence s's new queries [q_len, H, D] against its whole context, read from the cache."""
    block_size = layer.k_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    table = meta.block_tables[s : s + 1, :num_blocks]
    keys, values = (x[:, :, :seq_len] for x in _keys_values(layer, table, qs.dtype))
    q_len = qs.shape[0]
    # Query i sits at position seq_len - q_len + i and sees keys up to it.
    q_pos = torch.arange(seq_len - q_len, seq_len, device=qs.device)
    mask = q_pos[:, None] >= torch.arange(seq_len, device=qs.device)[None, :]
    o = F.scaled_dot_product_attention(
        qs.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)
