"""CUDA graphs for prompt steps: the forward captured in pieces between the attention calls.

A prompt (or mixed prompt + decode) step launches ~10 kernels per layer from Python; at a few
hundred tokens the GPU finishes each faster than the host can launch the next, so such a step is
bound by the host (a 512-token Llama-3-8B prefill: 13-39 ms of launching for ~12 ms of GPU work).
Everything but attention depends on the number of tokens alone, so it is captured once per padded
token count: graph 0 runs the embedding and layer 0 up to its attention, graph i from attention i-1
to attention i, the last one the final norm. Attention itself (with the q/k norm, rotary and KV
store fused before it) depends on the step's sequences (their lengths, slots, block tables), so it
runs eagerly between the replays, on the real tokens only: one graph replay and two kernel
launches per layer instead of ~10 launches.

Padded tokens (past the step's real ones, up to the captured size) sit at position 0; attention
never reads or writes them (the KV store and the attention kernels see only the real tokens), and
every other op is row-wise, so their garbage stays in their own rows.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.paged_attention import Attention, AttentionMetadata, QKPrep

log = logging.getLogger("pagoda.runner")


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
        meta = runner._metadata([size], np.arange(size), [[0] * -(-size // runner.block_size)])
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
        collecting = gc.isenabled()
        gc.disable()  # see DecodeGraphs._capture
        try:
            for attn in layers:
                attn.split = recorder
            with torch.cuda.stream(stream):
                recorder.begin()
                pieces.hidden = model(self.input_ids[:size], self.positions[:size], meta)
                recorder.end()
        finally:
            for attn in layers:
                attn.split = None
            if collecting:
                gc.enable()
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
