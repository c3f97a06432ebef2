"""The model runner: loads the model behind the chosen attention backend, sizes and binds the KV
cache, captures the CUDA graphs, and runs each step's forward + sampling."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig
from engine.faults import FaultInjector
from engine.runner.cuda_graphs import DecodeGraphs, PrefillGraphs
from engine.runner.kv_cache import blocks_that_fit_on_gpu
from engine.runner.loaded_model import PROFILE_PARAMS, LoadedModel
from engine.runner.pooler import PooledRows, Pooler
from engine.runner.step_inputs import attention_metadata, placeholders, step_inputs, upload
from engine.sampler import DraftedRows, SamplerRow
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence, TokenLogprobs
from engine.spec_decode import expand_rows, verify_row
from engine.spec_decode.draft_model import DraftModel
from engine.structured import StepMask

log = logging.getLogger("pagoda.runner")


@dataclass
class SampledTokens:
    """One step's sampled token per sampling row, and its logprobs where the request asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None: no row asked


@dataclass
class LaunchedStep:
    """A forward + sampling enqueued on the device; its tokens reach the host when `event` fires.

    A step launched with its sampling deferred holds its `logits` until sample() is called."""

    sampling: list[tuple[Sequence, int]]
    token_ids: torch.Tensor | None = None  # [rows] on the device: the next step's inputs read them there
    host: list[torch.Tensor | None] = field(default_factory=lambda: [None] * 4)
    # ^ token ids, logprobs, top ids, top logprobs, copied to (pinned) host memory
    event: torch.cuda.Event | None = None  # recorded after the copies; None on the CPU
    logits: torch.Tensor | None = None  # sampling deferred: the rows' logits, until sample()
    rows: list[SamplerRow] | None = None  # sampling deferred: the rows as they were at launch
    mask: StepMask | None = None  # the grammar mask it was sampled under: which tokens it allowed
    pooled: PooledRows | None = None  # the vectors of embedding requests whose prompts completed
    drafted: DraftedRows | None = None  # sampled rows checking a draft model's tokens (speculative decoding)

    def row_of(self) -> dict[int, int]:
        return {seq.seq_id: row for row, (seq, _) in enumerate(self.sampling)}


class ModelRunner(LoadedModel):
    """The served model (engine/runner/loaded_model.py), its pooler, and the draft model of draft-model
    speculation if there is one; sizes the KV pool, captures the graphs, runs each step."""

    def __init__(
        self, config: EngineConfig, model_dir: str, eos_token_ids: frozenset[int], draft_dir: str | None = None
    ):
        super().__init__(
            config,
            model_dir,
            eos_token_ids,
            what="the model",
            kv_dtype=config.kv_torch_dtype,
            fa4_prefill_min_tokens=config.fa4_prefill_min_tokens,
            load_format=config.load_format,
            quantization=config.quantization,
        )
        self.pooler = Pooler(self.device)
        # Draft-model speculation: the draft's K/V live in the same blocks (engine/spec_decode/draft_model.py).
        self.draft = DraftModel(config, draft_dir, eos_token_ids) if draft_dir is not None else None
        self.kv_caches = [self.kv_cache] + ([self.draft.kv_cache] if self.draft is not None else [])
        self.prefill_graphs: PrefillGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None  # speculative decoding's verify steps (k + 1 tokens a row)
        self.faults: FaultInjector | None = None  # test-only (engine/faults.py); the engine sets it

    # ----- start-up: KV cache, kernels, graphs -----

    def allocate_kv_cache(self, max_model_len: int) -> int:
        """Size the block pool from the memory budget, allocate it, bind it to the layers."""
        if self.device.type == "cuda":
            self.compile_kernels()
            if self.draft is not None:
                self.draft.compile_kernels()
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = self.config.num_gpu_blocks_override
        elif self.device.type == "cuda":
            num_blocks = blocks_that_fit_on_gpu(
                self.device,
                self.config.gpu_memory_utilization,
                self.bytes_per_block,
                self.profile_forward,
                lambda: self._graph_memory(max_model_len),
            )
        else:
            num_blocks = self.config.cpu_kv_cache_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise RuntimeError("no memory is left for the KV cache; lower max_num_batched_tokens or raise the budget")
        for kv_cache in self.kv_caches:
            kv_cache.bind(num_blocks)
        return num_blocks

    @property
    def bytes_per_block(self) -> int:
        """A block's K/V across every layer of the model, and of the draft model if there is one."""
        return sum(kv_cache.bytes_per_block for kv_cache in self.kv_caches)

    def allocate_swap_space(self, gib: float) -> int:
        """CPU swap space of `gib` for whole blocks (both models' K/V); how many blocks it holds."""
        num_blocks = int(gib * 2**30 // self.bytes_per_block)
        if num_blocks < 1:
            raise ValueError("swap_space is too small to hold one KV block")
        for kv_cache in self.kv_caches:
            kv_cache.allocate_swap_space(num_blocks)
        return num_blocks

    def move_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], copies) -> None:
        """A step's block moves, in every cache: swap out, then in (a block swapped out may be reused as a
        swap-in or copy target this step), then copy-on-write."""
        for kv_cache in self.kv_caches:
            kv_cache.swap_blocks(swap_out, to_cpu=True)
            kv_cache.swap_blocks(swap_in, to_cpu=False)
            kv_cache.copy_blocks(copies)

    def _graph_memory(self, max_model_len: int) -> int:
        """Bytes the CUDA graphs (the draft model's too) will hold (their memory pools and static buffers),
        found by capturing them once against one-block caches and releasing them. The graphs keep the
        address of the cache they were captured with, so the real capture has to come after the real cache."""
        if not self.graphs_enabled():
            return 0
        for kv_cache in self.kv_caches:
            kv_cache.bind(1)  # the captures store nothing (slot -1) and read only block 0
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
        self.graphs = self.prefill_graphs = self.verify_graphs = None
        if self.draft is not None:
            self.draft.graphs = None
        for kv_cache in self.kv_caches:
            kv_cache.bind(0)
        gc.collect()
        torch.cuda.empty_cache()
        return max(0, used)

    @torch.inference_mode()
    def profile_forward(self) -> None:
        """The largest step's activations: one forward + sampling over max_num_batched_tokens dummy tokens,
        with a throwaway cache, after the draft model's largest catch-up forward and proposal (whose draft
        distributions a verify step holds through the model's forward)."""
        cfg = self.config
        num_tokens = cfg.max_num_batched_tokens
        num_seqs = max(1, min(cfg.max_num_seqs, num_tokens))
        lens = [num_tokens // num_seqs] * num_seqs
        lens[-1] += num_tokens - sum(lens)
        held = self.draft.profile_forward(num_tokens, num_seqs) if self.draft is not None else None
        hidden = self.dummy_forward(lens)
        logits = self.model.compute_logits(hidden[:num_seqs])
        self.sampler(logits, [SamplerRow(PROFILE_PARAMS, i, [0] * 8, [1] * 8) for i in range(num_seqs)])
        del held
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_cuda_graphs(self, max_model_len: int) -> None:
        """Capture the decode graphs and the prompt-step graphs (backends that support them), with speculative
        decoding the verify graphs and the draft model's decode graphs, when the device and backend allow them and
        they are not turned off."""
        if not self.graphs_enabled():
            log.info("no CUDA graphs: %s", self.why_no_graphs())
            return
        max_batch = min(self.config.max_graph_batch_size, self.config.max_num_seqs)
        self.capture_decode_graphs(max_batch, max_model_len)
        spec = self.config.speculative_config
        if spec is not None and self.backend.supports_verify_graphs:
            # No step drafts for more decoding sequences than disable_by_batch_size, so no larger verify batch
            # comes. In the decode graphs' pool, their intermediates reuse the decode graphs' (one step runs at a
            # time); a decode replay may overwrite a verify graph's logits, which run() gathers into a tensor of
            # their own right after its replay.
            self.verify_graphs = DecodeGraphs(
                self,
                min(max_batch, spec.disable_by_batch_size),
                -(-max_model_len // self.block_size),
                max_model_len,
                queries=spec.num_speculative_tokens + 1,
                pool=self.graphs.pool,
            )
        max_tokens = min(self.config.max_prefill_graph_tokens, self.config.max_num_batched_tokens)
        if max_tokens >= 16 and self.backend.supports_prompt_graphs:
            self.prefill_graphs = PrefillGraphs(self, max_tokens, self.config.max_num_seqs, max_model_len)
        if self.draft is not None and self.draft.graphs_enabled():
            self.draft.capture_cuda_graphs(max_batch, max_model_len)

    def calibrate_kv_scales_on_next_prompt(self) -> None:
        """--calculate-kv-scales: every attention layer sets its K/V scales from the next prompt step."""
        for attn in self.model.attention_layers():
            attn.calibrate_kv_scales = True
        log.info("fp8 KV cache: the K/V scales will be computed from the first prompt step, then kept")

    @property
    def _calibrating(self) -> bool:
        """The next prompt step sets the fp8 K/V scales (every layer's flag is set and cleared in one step)."""
        return self.model.attention_layers()[0].calibrate_kv_scales

    # ----- the step -----

    @torch.inference_mode()
    def launch(
        self,
        scheduled: list[ScheduledSeq],
        sampling: list[tuple[Sequence, int]],
        previous: LaunchedStep | None = None,
        mask: StepMask | None = None,
        defer_sampling: bool = False,
        drafts: list[list[int]] | None = None,
        draft_probs: dict[int, torch.Tensor | None] | None = None,
    ) -> LaunchedStep:
        """Enqueue one forward over `scheduled` and the sampling of each (sequence, index into
        `scheduled` whose last token's logits it reads; children of n > 1 read their parent's row),
        with the structured-output `mask` applied to its rows' logits.

        A sequence's last token may be PLACEHOLDER: sampled by `previous`, which is still on the
        device; its value is copied there from `previous`'s token tensor, with no host sync.

        With `defer_sampling`, only the forward is enqueued; sample() completes the step once its
        mask is known (the mask needs the tokens `previous` is still sampling).

        With `drafts` (speculative decoding: per sampling entry, the draft tokens its scheduled row ends
        with), entry i samples len(drafts[i]) + 1 rows, one per scored position, each with the history up to
        it (engine/spec_decode/rejection.py); the step's sampling rows and `mask`'s are those rows. `draft_probs`
        (a draft model's drafts): per seq_id, the distributions its sampled draft tokens were drawn from."""
        inputs = step_inputs(scheduled)
        fill = None
        if previous is not None:
            fill = placeholders(inputs, previous.row_of(), previous.token_ids, self.device)
        rows = [row for _, row in sampling]
        pooling = [i for i, item in enumerate(scheduled) if item.seq.request.pooling is not None]
        pooled = None
        # Pooling needs the hidden states, which a decode graph does not return (an embedding prompt's
        # one-token chunk can make a step look decode-only).
        verify = self.verify_graphs
        if self.graphs is not None and inputs.decode_only and not pooling and self.graphs.fits(len(inputs.seqs)):
            logits = self.graphs.run(inputs.token_ids, inputs.positions, inputs.tables, fill)
            if rows != list(range(len(inputs.seqs))):  # n > 1 children read their parent's row
                logits = logits[upload(np.asarray(rows), self.device)]
        elif (
            drafts is not None
            and verify is not None
            and not pooling
            and verify.fits(len(inputs.seqs), int(inputs.num_new.max()))
        ):
            # A verify step whose every sequence computes at most k + 1 tokens (drafts, decodes beside them, a
            # prompt's short last chunk): one whole-step graph. Steps with longer prompt chunks take the paths below.
            select = _scored_tokens(inputs.ends[rows] - 1, drafts)
            logits = verify.run(inputs.token_ids, inputs.positions, inputs.tables, fill, inputs.num_new, select)
        else:
            graphs = self.prefill_graphs
            # The step that sets --calculate-kv-scales' scales runs eagerly: the graphs hold no calibration.
            if graphs is not None and graphs.fits(len(inputs.token_ids), len(inputs.seqs)) and not self._calibrating:
                hidden = graphs.run(inputs.token_ids, inputs.positions, inputs.num_new, inputs.tables, fill)
            else:
                meta = attention_metadata(
                    self.backend, self.block_size, self.device, inputs.num_new, inputs.positions, inputs.tables
                )
                input_ids = upload(inputs.token_ids, self.device)
                if fill is not None:
                    input_ids[fill[0]] = fill[1]
                hidden = self.model(input_ids, upload(inputs.positions, self.device), meta)
            if pooling:
                pooled = self.pooler.pool(hidden, scheduled, inputs.ends, pooling)
            logits = None
            if sampling:
                last = inputs.ends[rows] - 1
                if drafts is not None:
                    last = _scored_tokens(last, drafts)
                logits = self.model.compute_logits(hidden[upload(last, self.device)])
        if not sampling:
            return LaunchedStep([], pooled=pooled)
        drafted = _drafted_rows(sampling, drafts, draft_probs) if draft_probs else None
        if drafts is not None:
            rows, sampling = self._verify_rows(sampling, drafts), expand_rows(sampling, drafts)
        else:
            rows = self._sampler_rows(sampling)
        # The rows are taken now: a deferred sampling runs after the scheduler has counted this step.
        step = LaunchedStep(sampling, logits=logits, rows=rows, pooled=pooled, drafted=drafted)
        if not defer_sampling:
            self.sample(step, mask)
        return step

    @staticmethod
    def _sampler_rows(sampling: list[tuple[Sequence, int]]) -> list[SamplerRow]:
        rows = []
        for seq, _ in sampling:  # every sampled sequence every step: its attributes read once each
            request = seq.request
            params = request.params
            output = seq.output_token_ids if params.reads_output_tokens else []
            num_output = len(seq.token_ids) - seq.num_prompt_tokens
            rows.append(SamplerRow(params, seq.seed, request.prompt_token_ids, output, num_output))
        return rows

    @staticmethod
    def _verify_rows(sampling: list[tuple[Sequence, int]], drafts: list[list[int]]) -> list[SamplerRow]:
        """The sampler rows of a speculative step: one per scored position of each entry (verify_row)."""
        return [verify_row(seq, draft, i) for (seq, _), draft in zip(sampling, drafts) for i in range(len(draft) + 1)]

    @torch.inference_mode()
    def sample(self, step: LaunchedStep, mask: StepMask | None) -> None:
        """Enqueue the sampling of a launched step's logits (and the copy of its tokens to the host)."""
        logits, rows = step.logits, step.rows
        step.logits = step.rows = None
        step.mask = mask
        if self.faults is not None:
            self.faults.corrupt_logits(logits, [seq.request.request_id for seq, _ in step.sampling])
        out = self.sampler(logits, rows, mask, step.drafted)
        step.token_ids = out.token_ids
        # A row whose logits are not all finite (NaN or inf: a numerical fault) sampled no meaningful token:
        # the host reads -1 there and the engine fails that sequence alone. The device keeps the sampled id,
        # a valid index, for the next step's inputs (which the failed sequence leaves). A row's float32 sum
        # is finite exactly when all its logits are (logits are far too small for the sum to overflow): one
        # read of the logits, a tenth of the cost of isfinite().all() on the CPU and less than the argmax.
        finite = logits[:, : self.vocab_size].sum(dim=-1, dtype=torch.float32).isfinite()
        host_ids = torch.where(finite, out.token_ids, -1)
        device_out = [host_ids, out.logprobs, out.top_ids, out.top_logprobs]
        if self.device.type != "cuda":
            step.host = device_out
            return
        # Pinned destinations: the copies run in stream order and the host does not wait for them.
        step.host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in device_out]
        for dst, src in zip(step.host, device_out):
            if src is not None:
                dst.copy_(src, non_blocking=True)
        step.event = torch.cuda.Event()
        step.event.record()

    def collect(self, step: LaunchedStep) -> SampledTokens:
        """Wait for a launched step's tokens (only its own copies, not later work) and read them."""
        if step.event is not None:
            step.event.synchronize()
        if not step.sampling:
            return SampledTokens([], None)
        host = step.host
        # On the CPU these are the sampler's own tensors; on CUDA, host copies that have landed.
        token_ids = host[0].tolist()
        if host[1] is None:
            return SampledTokens(token_ids, None)
        logprobs = host[1].tolist()
        top_ids = host[2].tolist() if host[2] is not None else None
        top_lps = host[3].tolist() if host[3] is not None else None
        per_row: list[TokenLogprobs | None] = []
        for i, ((seq, _), token) in enumerate(zip(step.sampling, token_ids)):
            k = seq.request.params.logprobs
            if k is None:
                per_row.append(None)
                continue
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if top_ids is not None and k > 0 else []
            per_row.append(TokenLogprobs(token, logprobs[i], top))
        return SampledTokens(token_ids, per_row)


def _scored_tokens(last: np.ndarray, drafts: list[list[int]]) -> np.ndarray:
    """The tokens whose logits a speculative step samples: of each sampling entry (whose last token is at
    `last`), every scored position, last - len(draft) .. last."""
    # A list, then one conversion: k + 1 positions an entry are fewer than numpy's per-call costs would be.
    scored = [p for end, draft in zip(last.tolist(), drafts) for p in range(end - len(draft), end + 1)]
    return np.array(scored, dtype=np.int64)


def _drafted_rows(
    sampling: list[tuple[Sequence, int]], drafts: list[list[int]], draft_probs: dict[int, torch.Tensor | None]
) -> DraftedRows | None:
    """The verify rows that check a sampled draft model token: position i < k of an entry whose draft came
    with its distributions q (a random-sampled request) checks draft token i against q's row i."""
    rows, tokens, qs = [], [], []
    offset = 0
    for (seq, _), draft in zip(sampling, drafts):
        q = draft_probs.get(seq.seq_id) if draft else None
        if q is not None:
            rows += range(offset, offset + len(draft))
            tokens += draft
            qs.append(q)
        offset += len(draft) + 1
    return DraftedRows(rows, tokens, torch.cat(qs)) if rows else None
