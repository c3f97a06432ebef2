"""The attention entry point: writes new K/V into the paged cache and attends through block tables.

KV cache layout, per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim].
A token's slot is block_id * block_size + offset, so `cache.view(-1, kv_heads, head_dim)[slot]`
is that token's row (see ARCHITECTURE.md for why this layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """Where a flat batch of tokens sits in the paged cache; built once per step by the runner."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start: list[int]  # [S + 1]: sequence s owns new tokens query_start[s]:query_start[s+1]
    seq_lens: list[int]  # [S]: tokens in the cache for s after this step (context + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    seq_lens_tensor: torch.Tensor  # [S] int32, on device

    @property
    def decode_only(self) -> bool:
        return len(self.query_start) - 1 == self.query_start[-1]


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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.decode_only:
            return self._decode(q, meta)
        return self._prefill(q, meta)

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

    def _prefill(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = self.k_cache.shape[1]
        for s, seq_len in enumerate(meta.seq_lens):
            start, end = meta.query_start[s], meta.query_start[s + 1]
            num_blocks = -(-seq_len // block_size)
            table = meta.block_tables[s : s + 1, :num_blocks]
            keys = self._gather(self.k_cache, table)[:, :, :seq_len]
            values = self._gather(self.v_cache, table)[:, :, :seq_len]
            qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            q_len = end - start
            # Query i sits at position seq_len - q_len + i and sees keys up to it.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = q_pos[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each new token's K/V row into its cache slot."""
    kvh, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)
