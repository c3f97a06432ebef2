"""CUDA graphs: whole decode and verify steps, and prompt steps captured in pieces between the attention calls.

Decode (DecodeGraphs): the forward + lm_head of a batch of one-token queries, one graph per bucketed
batch size. A replay costs one launch instead of one per kernel, which is what decode steps of
small models are bound by.

Verify (DecodeGraphs with queries = k + 1, captured only with speculative decoding): the same for the
steps that score drafts, k + 1 query tokens a sequence (its last token and a k-token draft), attended by
the split-KV decode kernel with a causal mask inside the sequence's rows (engine/kernels/decode.py).

Prompt steps (PrefillGraphs): a prompt (or mixed prompt + decode) step launches ~10 kernels per
layer from Python; at a few hundred tokens the GPU finishes each faster than the host can launch
the next, so such a step is bound by the host. Everything but attention depends on the number of
tokens alone, so it is captured once per padded token count: graph 0 runs the embedding and layer 0
up to its attention, graph i from attention i-1 to attention i, the last one the final norm.
Attention itself (with the q/k norm, rotary and KV store fused before it) depends on the step's
sequences (their lengths, slots, block tables), so it runs eagerly between the replays, on the real
tokens only: one graph replay and two kernel launches per layer instead of ~10 launches.

Padded tokens (past the step's real ones, up to the captured size) sit at position 0; attention
never reads or writes them (the KV store and the attention kernels see only the real tokens), and
every other op is row-wise, so their garbage stays in their own rows.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import Attention, AttentionMetadata, QKPrep
from engine.runner.step_inputs import attention_metadata, block_table_array

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
        forward()  # compile / autotune outside the capture
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
            host[2, :n] = tables_host[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
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
    slots = tables[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
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


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture, as torch.cuda.graph does: cuBLAS keeps a
    workspace per stream, allocated in the graphs' pool on first use and never freed, so a stream
    per captured size cost ~64 MiB a size (and one per PrefillGraphs, a workspace per start-up
    capture; the runner captures twice, once to measure)."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """Captured token counts: every 16 to 64, every 32 to 256, then every 64; a step pads up to
    the next one (at most 1/4 more rows above 256 tokens, where the matmuls start to cost)."""
    sizes = list(range(16, 65, 16)) + list(range(96, 257, 32)) + list(range(320, max_tokens + 1, 64))
    return [s for s in sizes if s <= max_tokens]


@dataclass
class _Pieces:
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)  # one more than attention layers
    preps: list[QKPrep | None] = field(default_factory=list)  # each attention call's q/k preparation
    hidden: torch.Tensor | None = None  # the last graph's output: final hidden states


@dataclass
class _AttentionBuffers:
    """The attention calls' inputs and output, shared by every layer and captured size (one layer
    and one size run at a time): graph i copies q, k and v here, attention i writes `out`, graph
    i+1 reads it. Tensors the graphs keep for themselves would cost a set per layer and size."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


class _Recorder:
    """Installed as every attention layer's `split` during a capture: ends the graph being
    captured (after copying q, k, v into the shared buffers) and begins the next one."""

    def __init__(self, pieces: _Pieces, buffers: _AttentionBuffers, pool):
        self.pieces, self.buffers, self.pool = pieces, buffers, pool
        self.graph = torch.cuda.CUDAGraph()

    def begin(self) -> None:
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graph.capture_end()
        self.pieces.graphs.append(self.graph)
        self.graph = torch.cuda.CUDAGraph()

    def __call__(self, attn: Attention, q, k, v, meta: AttentionMetadata, prep: QKPrep | None) -> torch.Tensor:
        n, b = q.shape[0], self.buffers
        b.q[:n].copy_(q)
        b.k[:n].copy_(k)
        b.v[:n].copy_(v)
        self.pieces.preps.append(prep)
        self.end()
        self.begin()
        return b.out[:n]


class PrefillGraphs:
    """Piecewise CUDA graphs of the forward for steps of up to `max_tokens` tokens (any mix of
    prompt chunks and decodes), one set per size of prefill_graph_sizes; all share one pool."""

    def __init__(self, runner, max_tokens: int):
        self.runner = runner
        self.sizes = prefill_graph_sizes(max_tokens)
        device = runner.device
        max_tokens = self.sizes[-1]
        self.inputs = torch.zeros(2, max_tokens, dtype=torch.long, device=device)  # token ids, positions
        self.input_ids, self.positions = self.inputs
        # Two pinned staging buffers, alternating (see DecodeGraphs.run).
        self.host = [torch.zeros(2, max_tokens, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.turn = 0
        mc = runner.model.config
        dtype = runner.dtype
        self.buffers = _AttentionBuffers(
            *(
                torch.zeros(max_tokens, heads, mc.head_dim, dtype=dtype, device=device)
                for heads in (mc.num_heads, mc.num_kv_heads, mc.num_kv_heads, mc.num_heads)
            )
        )
        self.layers = runner.model.attention_layers()
        self.replays = 0  # steps run through the graphs (tests read it)
        self.pieces: dict[int, _Pieces] = {}
        pool = torch.cuda.graph_pool_handle()
        self.capture_stream = _capture_stream(device)
        torch.cuda.empty_cache()  # so that the logged growth is the graphs' pool, not cached eager blocks
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            self._capture(size, pool)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        log.info(
            "captured piecewise prefill CUDA graphs for %d sizes (%d..%d tokens, %d pieces each) in %.1f s, "
            "using %.2f GiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            len(self.pieces[max_tokens].graphs),
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(device) - reserved) / 2**30,
        )

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    def _dummy_meta(self, size: int) -> AttentionMetadata:
        """One sequence of `size` fresh tokens in block 0 that stores nothing: what the warm-up forward
        attends with (the graphs themselves never see it)."""
        runner = self.runner
        meta = attention_metadata(
            runner.backend,
            runner.block_size,
            runner.device,
            [size],
            np.arange(size),
            [[0] * -(-size // runner.block_size)],
        )
        meta.slot_mapping.fill_(-1)
        return meta

    @torch.inference_mode()
    def _capture(self, size: int, pool) -> None:
        model = self.runner.model
        meta = self._dummy_meta(size)
        model(self.input_ids[:size], self.positions[:size], meta)  # compile / autotune outside the capture
        torch.cuda.synchronize(self.runner.device)
        pieces = _Pieces()
        recorder = _Recorder(pieces, self.buffers, pool)
        layers = self.layers
        stream = self.capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        try:
            for attn in layers:
                attn.split = recorder
            with no_collection(), torch.cuda.stream(stream):
                recorder.begin()
                pieces.hidden = model(self.input_ids[:size], self.positions[:size], meta)
                recorder.end()
        finally:
            for attn in layers:
                attn.split = None
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        assert len(pieces.graphs) == len(layers) + 1, "every attention layer must split the forward once"
        self.pieces[size] = pieces

    @torch.inference_mode()
    def run(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        meta: AttentionMetadata,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The forward of len(token_ids) tokens: [tokens, hidden] final hidden states."""
        n = len(token_ids)
        size = next(s for s in self.sizes if s >= n)
        self.turn ^= 1
        host_tensor = self.host[self.turn]
        host = host_tensor.numpy()
        host[0, :n] = token_ids
        host[1, :n] = positions
        host[:, n:size] = 0
        self.inputs[:, :size].copy_(host_tensor[:, :size], non_blocking=True)
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        pieces = self.pieces[size]
        self.replays += 1
        b = self.buffers
        for graph, attn, prep in zip(pieces.graphs, self.layers, pieces.preps):
            graph.replay()
            # prep holds positions[:size] of the static buffer: the kernel reads the real tokens' first n.
            attn(b.q[:n], b.k[:n], b.v[:n], meta, prep, out=b.out[:n])
        pieces.graphs[-1].replay()
        return pieces.hidden[:n]
