"""Turns a scheduled batch into flat tensors, runs the model on them and samples.

Owns the model, the paged KV cache (sized here from the memory budget) and the sampler.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.config import EngineConfig
from engine.layers.linear import can_prepack, prepack_linears
from engine.loader import load_model
from engine.paged_attention import AttentionMetadata, fa4_prefill_applies, select_backend
from engine.piecewise_graphs import PrefillGraphs
from engine.sampler import Sampler, SamplerRow
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.scheduler import ScheduledSeq, new_token_ids
from engine.sequence import Sequence, TokenLogprobs

log = logging.getLogger("pagoda.runner")


@dataclass
class SampledTokens:
    """One step's sampled token per sampling row, and its logprobs where the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None: no row asked


PLACEHOLDER = -1  # a token id sampled by a step still on the GPU (async scheduling)


@dataclass
class LaunchedStep:
    """A forward + sampling enqueued on the device; its tokens reach the host when `event` fires."""

    sampling: list[tuple[Sequence, int]]
    token_ids: torch.Tensor | None  # [rows] on the device: the next step's inputs read them there
    host: list[torch.Tensor | None]  # token ids, logprobs, top ids, top logprobs, copied to (pinned) host memory
    event: torch.cuda.Event | None  # recorded after the copies; None on the CPU

    def row_of(self) -> dict[int, int]:
        return {seq.seq_id: row for row, (seq, _) in enumerate(self.sampling)}


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: str, eos_token_ids: frozenset[int]):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model, self.hf_config = load_model(model_dir, self.dtype, self.device, config.load_format, config.seed)
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        self.block_size = config.block_size
        self.sampler = Sampler(mc.vocab_size, eos_token_ids, self.device)
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.swap_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.attention_backend = select_backend(config.attention_backend, self.device, config.block_size, self.dtype)
        # Long prompt steps through flash-attn-4 where it is installed and faster (paged_attention.py); a
        # threshold above the step budget is never met.
        self.fa4_min_tokens = 0
        if (
            self.attention_backend == "triton"
            and 0 < config.fa4_prefill_min_tokens <= config.max_num_batched_tokens
            and fa4_prefill_applies(self.device, self.dtype, mc.head_dim)
        ):
            self.fa4_min_tokens = config.fa4_prefill_min_tokens
            log.info("prompt steps with a prompt chunk of %d+ tokens attend through flash-attn-4", self.fa4_min_tokens)
        for attn in self.model.attention_layers():
            attn.backend = self.attention_backend
            attn.fa4_min_tokens = self.fa4_min_tokens
        # The fused norm, rotary and SwiGLU kernels come with the attention backend: pagoda's C kernels
        # with `cpu`, the Triton ones with triton and flash_attn, plain PyTorch with the reference.
        kernels = {"torch": "torch", "cpu": "cpu"}.get(self.attention_backend, "triton")
        for module in self.model.modules():
            if hasattr(module, "kernels"):
                module.kernels = kernels
        if can_prepack(self.dtype, self.device):
            prepack_linears(self.model)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None

    # ----- KV cache -----

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across every layer."""
        mc = self.model.config
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * elem

    def allocate_kv_cache(self, max_model_len: int) -> int:
        """Size the block pool from the memory budget, allocate it, bind it to the layers."""
        if self.device.type == "cuda" and self.attention_backend != "torch":
            self._compile_kernels()
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = self.config.num_gpu_blocks_override
        elif self.device.type == "cuda":
            num_blocks = self._blocks_that_fit_on_gpu(max_model_len)
        else:
            num_blocks = self.config.cpu_kv_cache_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise RuntimeError("no memory is left for the KV cache; lower max_num_batched_tokens or raise the budget")
        self.kv_caches = self._bind_cache(num_blocks)
        self.num_blocks = num_blocks
        return num_blocks

    def _bind_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """New zeroed K/V caches of `num_blocks` blocks bound to every attention layer (0: unbind)."""
        mc = self.model.config
        shape = (num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        caches = []
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device) if num_blocks else torch.empty(0)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device) if num_blocks else torch.empty(0)
            caches.append((attn.k_cache, attn.v_cache))
        return caches

    def _blocks_that_fit_on_gpu(self, max_model_len: int) -> int:
        """gpu_memory_utilization of the card, minus what is in use now (weights), minus the
        activation peak of a forward at max_num_batched_tokens measured by running one, minus
        what the CUDA graphs will hold, measured by capturing them once."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free_before, total = torch.cuda.mem_get_info(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        self._profile_forward()
        peak = torch.cuda.max_memory_allocated(self.device)
        # Memory other processes (and the CUDA context) hold counts against our budget too.
        used_elsewhere = total - free_before - torch.cuda.memory_reserved(self.device)
        budget = total * self.config.gpu_memory_utilization - used_elsewhere - peak
        torch.cuda.empty_cache()
        graphs = self._graph_memory(max_model_len)
        log.info(
            "memory: total %.1f GiB, weights %.2f GiB, activation peak %.2f GiB, CUDA graphs %.2f GiB",
            total / 2**30,
            baseline / 2**30,
            (peak - baseline) / 2**30,
            graphs / 2**30,
        )
        return int((budget - graphs) // self.bytes_per_block)

    def _graph_memory(self, max_model_len: int) -> int:
        """Bytes the CUDA graphs will hold (their memory pools and static buffers), found by capturing
        them once against a one-block cache and releasing them. The graphs keep the address of the
        cache they were captured with, so the real capture has to come after the real cache."""
        if not self._graphs_enabled():
            return 0
        self._bind_cache(1)  # the captures store nothing (slot -1) and read only block 0
        before = torch.cuda.memory_reserved(self.device)
        level = log.level
        log.setLevel(logging.WARNING)  # the capture is logged once, when it is done for real
        try:
            self.capture_cuda_graphs(max_model_len)
        finally:
            log.setLevel(level)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        used = torch.cuda.memory_reserved(self.device) - before
        self.graphs = self.prefill_graphs = None
        self._bind_cache(0)
        gc.collect()
        torch.cuda.empty_cache()
        return max(0, used)

    def _graphs_enabled(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager and self.attention_backend != "torch"

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """One forward + sampling over max_num_batched_tokens dummy tokens, with a throwaway cache."""
        cfg = self.config
        num_tokens = cfg.max_num_batched_tokens
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens))
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        hidden = self._dummy_forward(lens)
        logits = self.model.compute_logits(hidden[:num_seqs])
        # The sampler's worst case too: every row filtered, penalized and asking for logprobs.
        params = SamplingParams(
            temperature=1.0,
            top_k=50,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.1,
            frequency_penalty=0.5,
            logprobs=MAX_LOGPROBS,
        )
        self.sampler(logits, [SamplerRow(params, i, [0] * 8, [1] * 8) for i in range(num_seqs)])
        torch.cuda.synchronize(self.device)

    def _compile_kernels(self) -> None:
        """Compile, before serving, the attention kernels a prompt step can take: prefill_fresh (whole
        prompts) and the paged prefill kernel (prompts after cached context; it also serves prompts
        beside decodes). Triton compiles a kernel the first time a step calls it, seconds of stall
        in the middle of serving. Token counts select no variant (strides and the block-table
        width do, and are fixed); the decode kernels compile in the graph captures. flash-attn-4, where
        long prompt steps take it, compiles a kernel on its first call of each kind too."""
        for cached in (0, 16):
            self._dummy_forward([9, 8], cached)
            if self.fa4_min_tokens:
                self._dummy_forward([self.fa4_min_tokens], cached)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _dummy_forward(self, lens: list[int], cached: int = 0) -> torch.Tensor:
        """An eager forward over dummy prompts of `lens` new tokens after `cached` tokens of (zero)
        context each, against a throwaway cache."""
        blocks_per_seq = -(-(cached + max(lens)) // self.block_size)
        self._bind_cache(blocks_per_seq * len(lens))
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(lens))]
        input_ids = torch.zeros(sum(lens), dtype=torch.long, device=self.device)
        positions = np.concatenate([np.arange(cached, cached + n) for n in lens])
        hidden = self.model(input_ids, self._upload(positions), self._metadata(lens, positions, tables))
        self._bind_cache(0)
        return hidden

    # ----- one step -----

    def _metadata(
        self, num_new: list[int] | np.ndarray, positions: np.ndarray, tables: list[list[int]]
    ) -> AttentionMetadata:
        """`positions`: every new token's position, sequence after sequence."""
        bs = self.block_size
        num_new = np.asarray(num_new)  # converted once for the three uses below
        query_start = np.zeros(len(num_new) + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start[1:])
        seq_lens = positions[query_start[1:] - 1] + 1
        # The torch and cpu backends read no block-table columns past a sequence: no padding for them.
        block_tables = block_table_array(tables, multiple=1 if self.attention_backend in ("torch", "cpu") else 16)
        # Slot of each new token: block_table[seq, pos // bs] * bs + pos % bs, one vectorized gather.
        seq_index = np.repeat(np.arange(len(num_new)), num_new)
        slots = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        return AttentionMetadata(
            slot_mapping=self._upload(slots),
            query_start=query_start.tolist(),
            seq_lens=seq_lens.tolist(),
            block_tables=self._upload(block_tables),
            seq_lens_tensor=self._upload(seq_lens.astype(np.int32)),
            query_start_tensor=self._upload(query_start),
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            fresh=bool((seq_lens == np.diff(query_start)).all()),
        )

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        # non_blocking: a copy from pageable memory is staged at once, without waiting for the GPU
        # to finish earlier work (a blocking copy would, and the host would idle until it does).
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    def allocate_swap_space(self, gib: float) -> int:
        """CPU copies of the KV layout for swapped-out blocks (pinned when the cache is on a GPU)."""
        num_blocks = int(gib * 2**30 // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError("swap_space is too small to hold one KV block")
        mc = self.model.config
        shape = (num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        pin = self.device.type == "cuda"
        self.swap_caches = [
            (torch.zeros(shape, dtype=self.dtype, pin_memory=pin), torch.zeros(shape, dtype=self.dtype, pin_memory=pin))
            for _ in self.kv_caches
        ]
        return num_blocks

    def swap_blocks(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copy whole blocks (all layers) device -> CPU pool (to_cpu) or back, as (src, dst) pairs."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for (k, v), (cpu_k, cpu_v) in zip(self.kv_caches, self.swap_caches):
            if to_cpu:
                cpu_k.index_copy_(0, dst, k.index_select(0, src.to(self.device)).cpu())
                cpu_v.index_copy_(0, dst, v.index_select(0, src.to(self.device)).cpu())
            else:
                k.index_copy_(0, dst.to(self.device), cpu_k.index_select(0, src).to(self.device))
                v.index_copy_(0, dst.to(self.device), cpu_v.index_select(0, src).to(self.device))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers) before a shared one is written."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def capture_cuda_graphs(self, max_model_len: int) -> None:
        """Capture the decode graphs and the piecewise prompt-step graphs, when the device and backend
        allow them and they are not turned off."""
        if not self._graphs_enabled():
            return
        max_batch = min(self.config.max_graph_batch_size, self.config.max_num_seqs)
        self.graphs = DecodeGraphs(self, max_batch, -(-max_model_len // self.block_size), max_model_len)
        max_tokens = min(self.config.max_prefill_graph_tokens, self.config.max_num_batched_tokens)
        if max_tokens >= 16:
            self.prefill_graphs = PrefillGraphs(self, max_tokens)

    def execute(self, scheduled: list[ScheduledSeq], sampling: list[tuple[Sequence, int]]) -> SampledTokens:
        """Run one forward over `scheduled` and sample (see `launch`), waiting for the tokens."""
        return self.collect(self.launch(scheduled, sampling))

    @torch.inference_mode()
    def launch(
        self, scheduled: list[ScheduledSeq], sampling: list[tuple[Sequence, int]], previous: LaunchedStep | None = None
    ) -> LaunchedStep:
        """Enqueue one forward over `scheduled` and the sampling of each (sequence, index into
        `scheduled` whose last token's logits it reads; children of n > 1 read their parent's row).

        A sequence's last token may be PLACEHOLDER: sampled by `previous`, which is still on the
        device; its value is copied there from `previous`'s token tensor, with no host sync."""
        seqs = [s.seq for s in scheduled]
        num_new = np.array([s.num_new_tokens for s in scheduled])
        num_computed = np.array([s.num_computed_tokens for s in seqs])
        token_ids = new_token_ids(scheduled)
        # Positions: each sequence's new tokens continue from its computed ones.
        ends = np.cumsum(num_new)
        positions = np.repeat(num_computed - (ends - num_new), num_new) + np.arange(len(token_ids))
        fill = self._placeholders(token_ids, seqs, ends, previous)
        tables = [s.block_table for s in seqs]
        rows = [row for _, row in sampling]
        if self.graphs is not None and len(token_ids) == len(seqs) and self.graphs.fits(len(seqs)):
            logits = self.graphs.run(token_ids, positions, tables, fill)
            if rows != list(range(len(seqs))):  # n > 1 children read their parent's row
                logits = logits[self._upload(np.asarray(rows))]
        else:
            meta = self._metadata(num_new, positions, tables)
            if self.prefill_graphs is not None and self.prefill_graphs.fits(len(token_ids)):
                hidden = self.prefill_graphs.run(token_ids, positions, meta, fill)
            else:
                input_ids = self._upload(token_ids)
                if fill is not None:
                    input_ids[fill[0]] = fill[1]
                hidden = self.model(input_ids, self._upload(positions), meta)
            logits = self.model.compute_logits(hidden[self._upload(ends[rows] - 1)]) if sampling else None
        if not sampling:
            return LaunchedStep([], None, [None] * 4, None)
        sampler_rows = [
            SamplerRow(
                seq.request.params,
                seq.seed,
                seq.request.prompt_token_ids,
                seq.output_token_ids if seq.request.params.reads_output_tokens else [],
                seq.num_output_tokens,
            )
            for seq, _ in sampling
        ]
        out = self.sampler(logits, sampler_rows)
        device_out = [out.token_ids, out.logprobs, out.top_ids, out.top_logprobs]
        if self.device.type != "cuda":
            return LaunchedStep(sampling, out.token_ids, device_out, None)
        # Pinned destinations: the copies run in stream order and the host does not wait for them.
        host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device_out]
        for dst, src in zip(host, device_out):
            if src is not None:
                dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return LaunchedStep(sampling, out.token_ids, host, event)

    def _placeholders(
        self, token_ids: np.ndarray, seqs: list[Sequence], ends: np.ndarray, previous: LaunchedStep | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(input indices, their tokens on the device) for PLACEHOLDER inputs; zeroes them in `token_ids`.

        A placeholder is always the last token of its sequence, so only the last input of each
        sequence is looked at."""
        if previous is None:
            return None
        last = ends - 1
        waiting = np.flatnonzero(token_ids[last] == PLACEHOLDER)
        if not len(waiting):
            return None
        dst = last[waiting]
        token_ids[dst] = 0
        rows = previous.row_of()
        src = np.array([rows[seqs[i].seq_id] for i in waiting])
        return self._upload(dst), previous.token_ids[self._upload(src)]

    def collect(self, step: LaunchedStep) -> SampledTokens:
        """Wait for a launched step's tokens (only its own copies, not later work) and read them."""
        if step.event is not None:
            step.event.synchronize()
        return self._to_host(step.host, step.sampling)

    def _to_host(self, host: list[torch.Tensor | None], sampling: list[tuple[Sequence, int]]) -> SampledTokens:
        if not sampling:
            return SampledTokens([], None)
        # On the CPU these are the sampler's own tensors; on CUDA, host copies that have landed.
        token_ids = host[0].tolist()
        if host[1] is None:
            return SampledTokens(token_ids, None)
        logprobs = host[1].tolist()
        top_ids = host[2].tolist() if host[2] is not None else None
        top_lps = host[3].tolist() if host[3] is not None else None
        per_row: list[TokenLogprobs | None] = []
        for i, ((seq, _), token) in enumerate(zip(sampling, token_ids)):
            k = seq.request.params.logprobs
            if k is None:
                per_row.append(None)
                continue
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if top_ids is not None and k > 0 else []
            per_row.append(TokenLogprobs(token, logprobs[i], top))
        return SampledTokens(token_ids, per_row)


def block_table_array(tables: list[list[int]], out: np.ndarray | None = None, multiple: int = 16):
    """Rows of block ids, zero-padded to a common width that is a multiple of `multiple`.

    The width is a stride of the attention kernels' block-table argument; Triton compiles a variant
    per divisibility of an integer argument, so a width that is always a multiple of 16 keeps the
    kernels compiled at start-up the only ones. Without `out`: a new [rows, width] int32 array.
    With `out` (a [max_rows, max_width] buffer): fills its top-left corner, returns the width.
    """
    width = -(-max(len(t) for t in tables) // multiple) * multiple
    array = np.zeros((len(tables), width), dtype=np.int32) if out is None else out
    for row, table in enumerate(tables):
        array[row, : len(table)] = table
    # In `out`, entries past a row's length keep an earlier step's block ids: harmless, since the
    # kernels that read it (graphs run only the Triton and FlashAttention backends) stop at seq_len.
    return array if out is None else width


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Captured decode batch sizes: powers of two to 16, then every 16 to 128, then every 32.

    A batch pads up to the next size; decode reads the weights once whatever the batch, so the
    padded rows cost little, and fewer graphs capture faster and hold less memory."""
    sizes = [1, 2, 4, 8] + list(range(16, 129, 16)) + list(range(160, max_batch + 1, 32))
    sizes = [b for b in sizes if b < max_batch]
    return sizes + [max_batch]


class DecodeGraphs:
    """CUDA graphs of the decode forward (+ lm_head) for bucketed batch sizes.

    All graphs read the same static input buffers and share one memory pool. A replay costs one
    launch instead of one per kernel, which is what decode steps of small models are bound by.
    Padded rows store nothing (slot -1) and attend to one key of block 0; their logits are ignored.
    """

    def __init__(self, runner: ModelRunner, max_batch: int, max_blocks: int, max_model_len: int):
        self.runner = runner
        self.sizes = graph_batch_sizes(max_batch)
        device = runner.device
        # Token ids, positions and KV slots travel together: one pinned host buffer, one copy.
        self.inputs = torch.zeros(3, max_batch, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.inputs
        self.slot_mapping.fill_(-1)  # the warm-up and capture runs must not write into the cache
        self.host = [torch.zeros(3, max_batch, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.host_tables = [torch.zeros(max_batch, max_blocks, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.turn = 0
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)  # positions + 1, in the graph
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.max_model_len = max_model_len
        self.logits: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = torch.cuda.graph_pool_handle()
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(device)
        for batch in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
            self._capture(batch, pool)
        torch.cuda.synchronize(device)
        log.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1f s, using %.2f GiB",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(device) - reserved) / 2**30,
        )

    def fits(self, batch: int) -> bool:
        return batch <= self.sizes[-1]

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start=list(range(batch + 1)),
            seq_lens=[1] * batch,  # host copy unused by the graph backends
            block_tables=self.block_tables[:batch],
            seq_lens_tensor=self.seq_lens[:batch],
            query_start_tensor=self.query_start[: batch + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    @torch.inference_mode()
    def _capture(self, batch: int, pool) -> None:
        model = self.runner.model
        meta = self._meta(batch)

        def forward() -> torch.Tensor:
            self.seq_lens[:batch].copy_(self.positions[:batch] + 1)
            hidden = model(self.input_ids[:batch], self.positions[:batch], meta)
            return model.compute_logits(hidden)

        forward()  # compile / autotune outside the capture
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        # A garbage collection inside the capture could free pinned host memory of some dead
        # object, whose event queries are illegal while capturing and would void the graph.
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool):
                self.logits[batch] = forward()
        finally:
            if collecting:
                gc.enable()
        self.graphs[batch] = graph

    @torch.inference_mode()
    def run(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        tables: list[list[int]],
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Fill the static inputs for len(token_ids) decode rows, replay, return [rows, vocab] logits.
        `fill`: (row indices, token ids on the device) that replace those rows' token ids."""
        n = len(token_ids)
        batch = next(b for b in self.sizes if b >= n)
        bs = self.runner.block_size
        # Two staging buffers, alternating: with async scheduling this step's inputs are written
        # while the previous step's copy from the other buffer may still be queued. The one from
        # two steps back has landed: its step's tokens were waited for before this launch.
        self.turn ^= 1
        host_tensor, tables_tensor = self.host[self.turn], self.host_tables[self.turn]
        host = host_tensor.numpy()
        host[0, :n] = token_ids
        pos = host[1, :n]
        pos[:] = positions
        tables_host = tables_tensor.numpy()
        width = block_table_array(tables, tables_host)
        host[2, :n] = tables_host[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        # Padded rows: position 0 (so one key to attend to), and no KV store.
        host[1, n:batch] = 0
        host[2, n:batch] = -1
        self.inputs[:, :batch].copy_(host_tensor[:, :batch], non_blocking=True)
        self.block_tables[:n, :width].copy_(tables_tensor[:n, :width], non_blocking=True)
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.graphs[batch].replay()
        return self.logits[batch][:n]
