"""CUDA graphs: whole decode, verify and prompt steps.

Decode (DecodeGraphs): the forward + lm_head of a batch of one-token queries, one graph per bucketed
batch size. A replay costs one launch instead of one per kernel, which is what decode steps of
small models are bound by.

Verify (DecodeGraphs with queries = k + 1, captured only with speculative decoding): the same for the
steps that score drafts, k + 1 query tokens a sequence (its last token and a k-token draft), attended by
the split-KV decode kernel with a causal mask inside the sequence's rows (engine/kernels/decode.py).

Prompt steps (PrefillGraphs): a prompt (or mixed prompt + decode) step launches ~10 kernels per
layer from Python; at a few hundred tokens the GPU finishes each faster than the host can launch
the next, so such a step is bound by the host. Whole steps of up to max_prefill_graph_tokens tokens are
captured once per padded token count; the prompt attention kernel reads which (sequence, query tile)
each of its programs runs from a map the host fills a step, so its grid is the captured size's.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.runner.step_inputs import block_table_array, token_slots

log = logging.getLogger("pagoda.runner")


@contextlib.contextmanager
def no_collection():
    """Python's garbage collector off while capturing: a collection inside a capture could free
    pinned host memory of some dead object, whose event queries are illegal while capturing and
    would void the graph."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Captured decode batch sizes: powers of two to 16, then every 16 to 128, then every 32.

    A batch pads up to the next size; decode reads the weights once whatever the batch, so the
    padded rows cost little, and fewer graphs capture faster and hold less memory."""
    sizes = [1, 2, 4, 8] + list(range(16, 129, 16)) + list(range(160, max_batch + 1, 32))
    sizes = [b for b in sizes if b < max_batch]
    return sizes + [max_batch]


class DecodeGraphs:
    """CUDA graphs of the decode forward (+ lm_head) for bucketed batch sizes, `queries` tokens a sequence.

    All graphs read the same static input buffers and share one memory pool. A replay costs one
    launch instead of one per kernel, which is what decode steps of small models are bound by.
    Padded rows store nothing (slot -1) and attend to one key of block 0; their logits are ignored.

    queries = k + 1 (verify steps of speculative decoding): sequence s owns rows s*q .. s*q + q-1. A sequence
    with fewer tokens than q (a shorter draft: adaptive k, or room or max_tokens cut it; or no draft at all,
    beside speculating ones) leaves its last rows as padding: at its last token's position (so that the
    sequence's last row gives its length, which the graph computes), stored nowhere (slot -1), attending
    every key of the sequence, its logits never read. One graph per batch size serves every draft length,
    instead of one per (batch size, length): k times fewer captures, and less memory, since every graph keeps
    its own logits (Llama-3-8B, k = 4, batches 1..16: 155 rows of 128,256 bf16 logits, 38 MiB, against 2.8
    times that for graphs of 2..5 rows a sequence), for at most k padded rows a sequence in a step whose
    weight reads cost the same with or without them.
    """

    def __init__(
        self,
        runner,
        max_batch: int,
        max_blocks: int,
        max_model_len: int,
        queries: int = 1,
        pool=None,
    ):
        self.runner = runner
        self.queries = queries
        self.sizes = graph_batch_sizes(max_batch)
        device = runner.device
        rows = max_batch * queries
        # Token ids, positions and KV slots travel together (and, for verify graphs, each sequence's count
        # of real tokens, in the first max_batch entries of a fourth row): one pinned host buffer, one copy.
        self.inputs = torch.zeros(3 + (queries > 1), rows, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.inputs[:3]
        self.slot_mapping.fill_(-1)  # the warm-up and capture runs must not write into the cache
        self.host = [torch.zeros(self.inputs.shape, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.host_tables = [torch.zeros(max_batch, max_blocks, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.turn = 0
        self.staged = [torch.cuda.Event(), torch.cuda.Event()]  # recorded after each buffer's copies
        # Set in the graph: the last row's position + 1 (padding rows repeat the last real position).
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(max_batch, dtype=torch.int32, device=device) if queries > 1 else None
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=device) * queries
        self.max_model_len = max_model_len
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps run through the graphs (tests read it)
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        kind = "decode" if queries == 1 else f"verify ({queries} tokens a sequence)"
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
        for batch in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            self._capture(batch, self.pool)
        torch.cuda.synchronize(device)
        log.info(
            "captured %d %s CUDA graphs of %s (batch %d..%d) in %.1f s, using %.2f GiB",
            len(self.sizes),
            kind,
            runner.what,
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(device) - reserved) / 2**30,
        )

    def fits(self, batch: int, max_tokens: int = 1) -> bool:
        """Whether a step of `batch` sequences of at most `max_tokens` tokens each has a graph."""
        return batch <= self.sizes[-1] and max_tokens <= self.queries

    def _meta(self, batch: int) -> AttentionMetadata:
        return rows_metadata(
            batch,
            self.queries,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start,
            self.query_lens,
            self.max_model_len,
        )

    @torch.inference_mode()
    def _capture(self, batch: int, pool) -> None:
        from engine.kernels import pdl  # here, not at the top: Triton is there wherever graphs are

        model, backend = self.runner.model, self.runner.backend
        meta = self._meta(batch)
        rows = batch * self.queries

        def forward() -> torch.Tensor:
            self.seq_lens[:batch].copy_(self.positions[:rows].view(batch, self.queries)[:, -1] + 1)
            if self.query_lens is not None:
                self.query_lens[:batch].copy_(self.inputs[3, :batch])
            backend.plan(meta)  # inside the graph: whatever it derives follows the replayed lengths
            hidden = model(self.input_ids[:rows], self.positions[:rows], meta)
            return model.compute_logits(hidden)

        if self.query_lens is not None:
            self.inputs[3].fill_(1)  # the warm-up: one real token a sequence
        forward()  # compile / autotune outside the capture: the variants an eager step of these rows launches
        # The capture in pdl.chained; at rows it launches with PDL (pdl.RELEASE_MAX_ROWS) those are other
        # variants, compiled by a second warm-up in the same scope.
        with pdl.chained():
            if rows <= pdl.RELEASE_MAX_ROWS:
                forward()
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with no_collection(), torch.cuda.graph(graph, pool=pool):
                self.logits[batch] = forward()
        self.graphs[batch] = graph

    @torch.inference_mode()
    def run(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        tables: list[list[int]] | list[np.ndarray],
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
        num_new: np.ndarray | None = None,
        select: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Fill the static inputs for len(tables) sequences, replay, return their logits: [rows, vocab] for
        decode graphs (one row a sequence). `fill`: (indices into token_ids, token ids on the device) that
        replace those tokens' ids.

        Verify graphs: sequence s computes num_new[s] (1..queries) of the flat `token_ids` / `positions`;
        the logits returned are those of the tokens `select` (indices into token_ids)."""
        n = len(tables)
        batch = next(b for b in self.sizes if b >= n)
        bs = self.runner.block_size
        # Two staging buffers, alternating: with async scheduling this step's inputs are written
        # while the previous step's copy from the other buffer may still be queued. The one from
        # two steps back has landed when its step's tokens were waited for before this launch; a
        # caller that replays several steps with no wait between them (a draft model's k decode
        # steps) waits here for that copy, not for any later work.
        self.turn ^= 1
        self.staged[self.turn].synchronize()  # at once if never recorded
        host_tensor, tables_tensor = self.host[self.turn], self.host_tables[self.turn]
        host = host_tensor.numpy()
        tables_host = tables_tensor.numpy()
        width = block_table_array(tables, tables_host)
        if self.queries == 1:
            rows = None
            host[0, :n] = token_ids
            pos = host[1, :n]
            pos[:] = positions
            host[2, :n] = token_slots(tables_host, np.arange(n), pos, bs)
            # Padded rows: position 0 (so one key to attend to), and no KV store.
            host[1, n:batch] = 0
            host[2, n:batch] = -1
        else:
            rows = stage_verify(host, self.queries, bs, batch, token_ids, positions, tables_host, num_new)
        size = batch * self.queries
        self.inputs[:, :size].copy_(host_tensor[:, :size], non_blocking=True)
        self.block_tables[:n, :width].copy_(tables_tensor[:n, :width], non_blocking=True)
        self.staged[self.turn].record()
        if fill is not None:
            at = fill[0] if rows is None else torch.from_numpy(rows).to(self.inputs.device, non_blocking=True)[fill[0]]
            self.input_ids[at] = fill[1]
        self.replays += 1
        self.graphs[batch].replay()
        if rows is None:
            return self.logits[batch][:n]
        # A gather, so a copy: the graph's own logits may share memory with other graphs of its pool.
        return self.logits[batch][torch.from_numpy(rows[select]).to(self.inputs.device, non_blocking=True)]


def rows_metadata(
    batch: int,
    queries: int,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    query_lens: torch.Tensor | None,
    max_model_len: int,
) -> AttentionMetadata:
    """The metadata of `batch` sequences of `queries` rows each (DecodeGraphs), over the leading part of
    buffers sized for the largest batch; `query_lens` (queries > 1): each sequence's real rows."""
    return AttentionMetadata(
        slot_mapping=slot_mapping[: batch * queries],
        query_start=list(range(0, batch * queries + 1, queries)),
        seq_lens=[1] * batch,  # host copy unused by the graph backends
        block_tables=block_tables[:batch],
        seq_lens_tensor=seq_lens[:batch],
        query_start_tensor=query_start[: batch + 1],
        max_query_len=queries,
        max_seq_len=max_model_len,
        queries_per_seq=queries,
        query_lens_tensor=None if query_lens is None else query_lens[:batch],
    )


def stage_verify(
    host: np.ndarray,
    queries: int,
    block_size: int,
    batch: int,
    token_ids: np.ndarray,
    positions: np.ndarray,
    tables: np.ndarray,
    num_new: np.ndarray,
) -> np.ndarray:
    """Write a verify step's inputs into `host` (rows: token ids, positions, KV slots, and each sequence's
    count of real tokens in the fourth row's first `batch` entries), for len(num_new) sequences padded to
    `batch` with `queries` rows each (DecodeGraphs says how); `tables`: their block tables, one row each.
    Returns each token's row."""
    n, q, bs = len(num_new), queries, block_size
    ends = np.cumsum(num_new)
    rows = np.repeat(np.arange(n) * q - (ends - num_new), num_new) + np.arange(len(token_ids))
    seq_of = np.repeat(np.arange(n), num_new)
    slots = token_slots(tables, seq_of, positions, bs)
    size = batch * q
    host[0, :size] = 0
    host[0, rows] = token_ids
    host[1, : n * q] = np.repeat(positions[ends - 1], q)  # padding: its sequence's last position
    host[1, n * q : size] = 0  # padded sequences: position 0, one key to attend to
    host[1, rows] = positions
    host[2, :size] = -1
    host[2, rows] = slots
    host[3, :n] = num_new
    host[3, n:batch] = 1
    return rows


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Captured token counts: every 16 to 64, every 32 to 256, then every 64; a step pads up to
    the next one (at most 1/4 more rows above 256 tokens, where the matmuls start to cost)."""
    sizes = list(range(16, 65, 16)) + list(range(96, 257, 32)) + list(range(320, max_tokens + 1, 64))
    return [s for s in sizes if s <= max_tokens]


class PrefillGraphs:
    """Whole-step CUDA graphs of the forward for steps with prompt tokens, up to `max_tokens` tokens in all (any
    mix of prompt chunks, with or without cached context, and decodes) in up to `max_seqs` sequences, one graph
    per size of prefill_graph_sizes, all reading the same static buffers and sharing one pool.

    The step's sequences enter through those buffers: slots, query starts, lengths, block tables, and the tile
    map of the prompt attention kernel, whose grid is fixed at capture (engine/kernels/attention.py:
    prefill_tile_map). Padded tokens, past the step's real ones up to the captured size, sit at position 0,
    store nothing (slot -1) and belong to no tile, so attention never reads or writes them; every other op is
    row-wise, so their garbage stays in their own rows."""

    def __init__(self, runner, max_tokens: int, max_seqs: int, max_model_len: int):
        self.runner = runner
        self.sizes = prefill_graph_sizes(max_tokens)
        device = runner.device
        max_tokens = self.sizes[-1]
        self.max_seqs = s = min(max_seqs, max_tokens)
        self.max_model_len = max_model_len
        self.backend = backend = runner.backend
        self.tile_queries = backend.prefill_queries_per_tile(runner.model.attention_layers()[0])
        capacity = self.tile_capacity(max_tokens)
        # int64 rows: token ids, positions, KV slots; int32: the tile map, query starts and sequence lengths; the
        # block tables. Each has a pinned host twin per turn (see DecodeGraphs.run) and goes up in one copy.
        self.inputs = torch.zeros(3, max_tokens, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.inputs
        self.slot_mapping.fill_(-1)
        self.lengths = torch.zeros(2 * capacity + 2 * s + 1, dtype=torch.int32, device=device)
        self.tile_map, self.query_start, self.seq_lens = self._split_lengths(self.lengths, capacity)
        self.tile_map[:, 0] = -1  # the warm-up and capture runs attend nothing
        self.block_tables = torch.zeros(s, -(-max_model_len // runner.block_size), dtype=torch.int32, device=device)
        buffers = (self.inputs, self.lengths, self.block_tables)
        self.host = [tuple(torch.zeros(t.shape, dtype=t.dtype, pin_memory=True) for t in buffers) for _ in range(2)]
        self.turn = 0
        self.staged = [torch.cuda.Event(), torch.cuda.Event()]  # recorded after each turn's copies
        self.hidden: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps run through the graphs (tests read it)
        self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()  # so that the logged growth is the graphs' pool, not cached eager blocks
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            self._capture(size)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-up forwards' eager blocks
        log.info(
            "captured %d prompt-step CUDA graphs (%d..%d tokens, up to %d sequences) in %.1f s, using %.2f GiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            s,
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(device) - reserved) / 2**30,
        )

    def tile_capacity(self, size: int) -> int:
        return self.backend.prefill_tile_capacity(size, self.max_seqs, self.tile_queries)

    def _split_lengths(self, lengths, capacity: int):
        """(tile map [capacity, 2], query starts [max_seqs + 1], sequence lengths [max_seqs]) views of `lengths`."""
        s = self.max_seqs
        tiles = 2 * capacity
        # reshape, not view: the host twin is read as a numpy array, whose view() takes a dtype.
        return lengths[:tiles].reshape(capacity, 2), lengths[tiles : tiles + s + 1], lengths[tiles + s + 1 :]

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.sizes[-1] and num_seqs <= self.max_seqs

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        model, backend = self.runner.model, self.backend
        meta = prompt_metadata(
            size,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start,
            self.tile_map[: self.tile_capacity(size)],
            self.max_model_len,
        )

        def forward() -> torch.Tensor:
            backend.plan(meta)
            return model(self.input_ids[:size], self.positions[:size], meta)

        forward()  # compile / autotune outside the capture
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with no_collection(), torch.cuda.graph(graph, pool=self.pool):
            self.hidden[size] = forward()
        self.graphs[size] = graph

    @torch.inference_mode()
    def run(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        num_new: np.ndarray,
        tables: list[np.ndarray],
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The forward of a step whose sequences compute num_new[s] of the flat `token_ids` at `positions`
        each, with block tables `tables`: [tokens, hidden] final hidden states. `fill`: as DecodeGraphs.run."""
        n, num_seqs, bs = len(token_ids), len(num_new), self.runner.block_size
        size = next(s for s in self.sizes if s >= n)
        self.turn ^= 1
        self.staged[self.turn].synchronize()  # the copies of two steps back (DecodeGraphs.run says why)
        inputs_host, lengths_host, tables_host = self.host[self.turn]
        tile_map, query_start, seq_lens = self._split_lengths(lengths_host.numpy(), len(self.tile_map))
        host_tables = tables_host.numpy()
        width = stage_prompt_step(
            inputs_host.numpy(), query_start, seq_lens, host_tables, size, bs, token_ids, positions, num_new, tables
        )
        self.backend.prefill_tile_map(num_new, self.tile_queries, tile_map[: self.tile_capacity(size)])
        self.inputs[:, :size].copy_(inputs_host[:, :size], non_blocking=True)
        self.lengths.copy_(lengths_host, non_blocking=True)
        self.block_tables[:num_seqs, :width].copy_(tables_host[:num_seqs, :width], non_blocking=True)
        self.staged[self.turn].record()
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.replays += 1
        self.graphs[size].replay()
        return self.hidden[size][:n]


def prompt_metadata(
    size: int,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    tile_map: torch.Tensor,
    max_model_len: int,
) -> AttentionMetadata:
    """The metadata of a prompt-step graph of `size` tokens (PrefillGraphs) over its buffers: what the step's
    sequences are comes from the device tensors alone, filled a step by stage_prompt_step and the tile map."""
    return AttentionMetadata(
        slot_mapping=slot_mapping[:size],
        query_start=[0, size],  # host copies unused by the graph backends
        seq_lens=[size],
        block_tables=block_tables,
        seq_lens_tensor=seq_lens,
        query_start_tensor=query_start,
        max_query_len=size,
        max_seq_len=max_model_len,
        tile_map=tile_map,
    )


def stage_prompt_step(
    host: np.ndarray,
    query_start: np.ndarray,
    seq_lens: np.ndarray,
    tables_host: np.ndarray,
    size: int,
    block_size: int,
    token_ids: np.ndarray,
    positions: np.ndarray,
    num_new: np.ndarray,
    tables: list[np.ndarray],
) -> int:
    """Write a prompt step's inputs into PrefillGraphs' host buffers: `host` rows token ids, positions and KV slots,
    padded to `size` (position 0, slot -1); query starts and sequence lengths; the block tables into `tables_host`.
    Returns the tables' width."""
    n, num_seqs = len(token_ids), len(num_new)
    width = block_table_array(tables, tables_host)
    host[0, :n] = token_ids
    host[1, :n] = positions
    host[2, :n] = token_slots(tables_host, np.repeat(np.arange(num_seqs), num_new), positions, block_size)
    host[:2, n:size] = 0
    host[2, n:size] = -1
    query_start[0] = 0
    np.cumsum(num_new, out=query_start[1 : num_seqs + 1])
    seq_lens[:num_seqs] = positions[query_start[1 : num_seqs + 1] - 1] + 1
    return width
