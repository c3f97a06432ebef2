"""The triton backend: pagoda's own kernels (engine/kernels), the default on CUDA.

Prompt steps: whole fresh prompts go to `prefill_fresh` (tiles fed from the step's own k/v, which over
an fp8 cache the store has rounded to the cache's values), the rest (chunks after cached context,
decodes beside prompts) to `paged_prefill` through the block tables; decode batches, and the verify graphs'
steps (k + 1 query rows a sequence), to the split-KV `paged_decode`. On a Hopper GPU with flash-attn-4
installed, `TritonFa4Backend` (flash_attn.py) sends prompt steps with a long query run there instead.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.kv_fp8 import is_fp8
from engine.ops import triton_ops_table


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_graphs = True
    supports_verify_graphs = True
    supports_prompt_graphs = True
    # Triton compiles a kernel variant per divisibility of an integer argument; a block-table width
    # that is always a multiple of 16 keeps the variants compiled at start-up the only ones.
    pad_block_tables = 16
    # Token counts select no variant (strides and the block-table width do), so one small step compiles
    # the two prompt-step kernels; the decode kernels compile in the graph captures.
    warmup_prompt_lens = ((9, 8),)

    def __init__(self, device: torch.device):
        # Triton loads here, not at import: the CPU builds of torch come without it.
        from engine.kernels import attention, decode, prefill_fresh, qkv_store

        self.store = qkv_store.prepare_and_store
        self.paged_prefill, self.paged_decode = attention.paged_prefill, decode.paged_decode
        # The prompt-step graphs' fixed-grid launch of paged_prefill (engine/runner/cuda_graphs.py: PrefillGraphs).
        self.prefill_tile_capacity, self.prefill_tile_map = attention.prefill_tile_capacity, attention.prefill_tile_map
        self._queries_per_tile = attention.prefill_queries_per_tile
        self.fresh_fits, self.prefill_fresh = prefill_fresh.fresh_prefill_fits, prefill_fresh.prefill_fresh
        self.decode_num_splits = decode.decode_num_splits
        self.ops = triton_ops_table()
        # The decode split count aims at a number of programs per SM of this device.
        self.num_sms = decode.num_sms(device)

    def write_kv(self, layer, q, k, v, meta, prep):
        rope = {} if prep is None else dict(positions=prep.positions, cos=prep.rotary.cos, sin=prep.rotary.sin)
        if prep is not None and prep.q_norm is not None:
            rope.update(q_norm=prep.q_norm.weight, k_norm=prep.k_norm.weight, eps=prep.q_norm.eps)
        # q, k in place; the scales matter only to an fp8 cache, whose rounded k and v go back in place too
        # (Attention.rounds_kv_back), so prefill_fresh over them sees what paged_prefill reads from the cache.
        self.store(
            q,
            k,
            v,
            layer.k_cache,
            layer.v_cache,
            meta.slot_mapping,
            **rope,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            write_back=layer.rounds_kv_back,
        )
        return q, k

    def prefill_queries_per_tile(self, layer) -> int:
        """The query tile of `layer`'s prompt attention (the unit of a tile map)."""
        return self._queries_per_tile(layer.num_heads, layer.num_kv_heads, is_fp8(layer.k_cache.dtype))

    def prefill(self, layer, q, k, v, meta: AttentionMetadata):
        # A prompt-step graph's launch (meta.tile_map: a grid fixed at capture) always reads through the cache.
        if meta.tile_map is None and meta.fresh and self.fresh_fits(q, k, v):
            return self.prefill_fresh(q, k, v, meta.query_start_tensor, layer.scale, meta.max_query_len)
        return self.paged_prefill(
            q,
            layer.k_cache,
            layer.v_cache,
            meta.block_tables,
            meta.query_start_tensor,
            meta.seq_lens_tensor,
            layer.scale,
            meta.max_query_len,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            tile_map=meta.tile_map,
        )

    def decode(self, layer, q, meta):
        queries = meta.queries_per_seq
        splits = self.decode_num_splits(q.shape[0] // queries, layer.num_kv_heads, self.num_sms)
        return self.paged_decode(
            q,
            layer.k_cache,
            layer.v_cache,
            meta.block_tables,
            meta.seq_lens_tensor,
            layer.scale,
            num_splits=splits,
            k_scale=layer.k_scale,
            v_scale=layer.v_scale,
            queries=queries,
            query_lens=meta.query_lens_tensor,
        )
