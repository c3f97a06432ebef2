"""LLMEngine: requests in, `step()` = schedule -> run -> sample -> update, request outputs out."""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_manager import BlockManager, SwapPool
from engine.config import EngineConfig
from engine.faults import BrokenMatcher, FaultInjector
from engine.loader import ModelLoadError, check_model_files, read_hf_config, resolve_model_dir
from engine.pooling_params import PoolingParams
from engine.runner import LaunchedStep, ModelRunner
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.scheduler import LaunchedPlan, ScheduledSeq, Scheduler, SchedulerOutput
from engine.sequence import Request, RequestOutput, Sequence, SequenceStatus
from engine.spec_decode import Speculator, expand_rows
from engine.spec_decode.draft_model import check_draft_vocabulary
from engine.spec_decode.speculator import COST_RATIO, Guard
from engine.stop_strings import StopMatcher
from engine.structured import GrammarDone, Grammars, GrammarWork, StepMask

log = logging.getLogger("pagoda.engine")

# Steps that fail one after another before the engine gives up (EngineFailedError): one failed step
# fails its requests and the engine goes on; a fault that outlives them (a broken device) is fatal.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineFailedError(RuntimeError):
    """Steps kept failing: the engine cannot serve any more requests."""


@dataclass
class StepStats:
    """What one step did and the state it left, for metrics."""

    num_batched_tokens: int = 0
    num_prefill_tokens: int = 0  # of num_batched_tokens, those of prompts (incl. recomputation)
    num_generated_tokens: int = 0
    num_preempted: int = 0  # both modes
    num_swapped_out: int = 0  # of num_preempted, those swapped to the CPU pool
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache this step
    prefix_hit_tokens: int = 0  # of those, found (their prefill skipped)
    # Speculative decoding's (engine/spec_decode/; 0 without it).
    num_drafts: int = 0  # sequences that had a draft verified this step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # of the draft tokens, those the target model accepted
    # Per draft position i (0-based): drafts whose token i was accepted; None in a step without drafts.
    num_accepted_tokens_per_pos: list[int] | None = None
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use


@dataclass
class _Planned:
    """A scheduled step, not enqueued on the device yet."""

    sched: SchedulerOutput
    sampling: list[tuple[Sequence, int]]  # (sequence, scheduled row whose logits it samples)
    drafts: list[list[int]] | None
    draft_probs: dict[int, torch.Tensor | None] | None
    prefix_counts: tuple[int, int]  # the block manager's prefix-cache counters before the scheduling
    started: float  # time.perf_counter() when its scheduling began (the speculator's step timing)
    proposed: bool  # the speculator chose to speculate in it
    mode: tuple[Guard, bool] | None  # the speculator's guard and its mode it runs in (None: no guard decided it)


@dataclass
class _Step:
    """A launched step, until its tokens are read."""

    plan: LaunchedPlan
    launched: LaunchedStep
    stats: StepStats  # what is known at launch; the occupancy is filled in when it completes


@dataclass
class _LaunchTime:
    """What the speculator's step times (engine/spec_decode/speculator.py) need of a launched step."""

    started: float  # time.perf_counter() when its launch began
    overlapped: bool  # launched while the step before it still ran
    speculated: bool  # the speculator chose it to speculate: it runs synchronously, with or without drafts
    decode_only: bool  # no prompt tokens in it
    num_seqs: int
    drafted: int  # draft tokens it verifies
    mode: tuple[Guard, bool] | None  # the speculator's guard and its mode it ran in (None: no guard decided it)
    stats: StepStats  # its tokens: the accepted drafts are counted in once it completes


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.model is None:
            from engine.default_model import default_model_dir

            model_dir = str(default_model_dir())
        else:
            model_dir = resolve_model_dir(config.model, config.revision, config.download_dir)
        self.model_dir = model_dir
        check_model_files(model_dir)
        tokenizer_dir = model_dir
        if config.tokenizer is not None:
            tokenizer_dir = resolve_model_dir(config.tokenizer, cache_dir=config.download_dir)
        self.tokenizer = _load_tokenizer(tokenizer_dir, required=config.tokenizer is not None)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else _config_eos(model_dir)
        self.eos_token_ids = eos
        draft_dir = self._draft_dir(model_dir)
        self.runner = ModelRunner(config, model_dir, eos, draft_dir)
        mc = self.runner.model.config
        self.max_model_len = self._resolve_max_model_len(mc)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be at "
                f"least max_model_len ({self.max_model_len})"
            )
        num_blocks = self.runner.allocate_kv_cache(self.max_model_len)
        capacity = num_blocks * config.block_size
        if capacity < self.max_model_len:
            raise RuntimeError(
                f"the KV cache holds {capacity} tokens, fewer than max_model_len={self.max_model_len}; "
                "lower max_model_len or give the cache more memory"
            )
        log.info(
            "loaded %s (%s, %s on %s, %s attention): %d KV blocks of %d tokens = %d tokens in the %s cache, "
            "max_model_len %d",
            model_dir,
            type(self.runner.model).__name__,
            config.dtype,
            config.device,
            self.runner.backend.name,
            num_blocks,
            config.block_size,
            capacity,
            str(self.runner.kv_cache.dtype).removeprefix("torch."),
            self.max_model_len,
        )
        self.runner.capture_cuda_graphs(self.max_model_len)
        if config.calculate_kv_scales:
            # After the start-up forwards (dummy zeros) and the graph captures: the graphs read the scale
            # tensors the calibration will overwrite in place.
            self.runner.calibrate_kv_scales_on_next_prompt()
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        swap_pool = None
        if config.preemption_mode == "swap":
            swap_pool = SwapPool(self.runner.allocate_swap_space(config.swap_space))
            log.info("swap space: %d blocks (%.1f GiB of CPU memory)", swap_pool.num_blocks, config.swap_space)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.enable_chunked_prefill,
            swap_pool,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            cost_ratio = COST_RATIO
            if self.runner.draft is not None:
                # Each draft token costs a draft forward too: about the draft's share of the weight bytes read
                # per step (a decode step at small batches is bound by reading the weights). Bytes, not
                # parameter counts: quantized and prepacked weights are buffers, not parameters.
                cost_ratio += self.runner.draft.weight_bytes / self.runner.weight_bytes
            self.speculator = Speculator(config.speculative_config, self.max_model_len, cost_ratio)
            if not self.speculator.can_pay:
                log.info(
                    "speculative decoding is off: a draft token costs c = %.2f of a decode step, so no draft length "
                    "pays even if every token is accepted; steps stay pipelined and the draft model never runs",
                    cost_ratio,
                )
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self.in_flight: _Step | None = None  # launched, tokens not read yet (async scheduling)
        self.last_launch: _LaunchTime | None = None  # the latest step launched since the engine was last idle
        # Structured outputs: the forward after in_flight, enqueued before in_flight's tokens are read.
        self.prelaunched: _Step | None = None
        self._grammars: Grammars | None = None  # made on the first constrained request
        self._grammars_lock = threading.Lock()
        # The grammar work for the deferred step of this step() call (engine/structured.py): running on the
        # grammar thread (waited for within the call), or done inline.
        self._grammar: Future[GrammarDone] | GrammarDone | None = None
        self.last_step: StepStats | None = None
        self.consecutive_step_failures = 0
        self.faults = FaultInjector.from_env()

    def _draft_dir(self, model_dir: str) -> str | None:
        """The draft model's directory (draft-model speculation), checked against the model's vocabulary."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        draft_dir = resolve_model_dir(spec.model, cache_dir=self.config.download_dir)
        check_model_files(draft_dir)
        check_draft_vocabulary(
            draft_dir, read_hf_config(model_dir)["vocab_size"], self.tokenizer, _load_tokenizer(draft_dir)
        )
        return draft_dir

    @property
    def faults(self) -> FaultInjector | None:
        """Test-only fault injection (engine/faults.py); None, the default, costs one check per step."""
        return self._faults

    @faults.setter
    def faults(self, faults: FaultInjector | None) -> None:
        self._faults = self.runner.faults = faults

    def _resolve_max_model_len(self, mc) -> int:
        limit = mc.max_position_embeddings
        if mc.sliding_window:
            # Attention here is full, which equals sliding-window attention while the context fits the window.
            limit = min(limit, mc.sliding_window)
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {limit} positions")
        return wanted

    # ----- requests -----

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        queue_timeout: float | None = None,
    ) -> Request:
        """Validate and queue a request: new_request() then enqueue()."""
        return self.enqueue(self.new_request(request_id, prompt, params, priority, arrival_time, queue_timeout))

    def new_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        queue_timeout: float | None = None,
    ) -> Request:
        """A validated request for enqueue(); raises InvalidParameter (with the offending param) when it
        cannot be served. It reads no scheduling state, so another thread may call it (AsyncEngine's callers do).

        A request still waiting for its first scheduling `queue_timeout` seconds after arrival
        (default: the config's `queue_timeout`) finishes with finish_reason "timeout".

        With PoolingParams it is an embedding request: its prompt is computed like any other and pooled
        into RequestOutput.embedding; nothing is sampled."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameter("prompt", "this model has no tokenizer: give the prompt as token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self.check_request(token_ids, params)
        pooling = None
        if isinstance(params, PoolingParams):
            pooling = params.resolved(self.config.pooling_type, self.config.normalize)
            params = SamplingParams()
        request = Request(request_id, text, token_ids, params, priority=priority, pooling=pooling)
        if params.constraint is not None:
            request.grammar = self.compile_constraint(params)
        if params.stop and self.tokenizer is not None:
            request.stop_matcher = StopMatcher(params.stop)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        timeout = queue_timeout if queue_timeout is not None else self.config.queue_timeout
        if timeout is not None:
            request.queue_deadline = request.arrival_time + timeout
        return request

    def enqueue(self, request: Request) -> Request:
        """Queue a request made by new_request() (validated there, not again here)."""
        if request.request_id in self.requests:
            raise InvalidParameter("request_id", f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(self._new_sequence(request, 0))
        return request

    def check_request(self, token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """Raise InvalidParameter (naming the param) if this prompt and params cannot be served."""
        if not token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        vocab = self.runner.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameter("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if isinstance(params, PoolingParams):  # nothing is generated: the prompt may fill the context
            if len(token_ids) > self.max_model_len:
                raise InvalidParameter(
                    "prompt",
                    f"the prompt has {len(token_ids)} tokens; this model's context length is {self.max_model_len}",
                )
            return
        if len(token_ids) >= self.max_model_len:
            raise InvalidParameter(
                "prompt",
                f"the prompt has {len(token_ids)} tokens; this model's context length is {self.max_model_len}, "
                "which must also leave room for at least one generated token",
            )
        if params.max_tokens is not None and len(token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidParameter(
                "max_tokens",
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length "
                f"of {self.max_model_len}",
            )
        if params.n > self.config.max_num_seqs:
            raise InvalidParameter("n", f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        bad_bias = next((t for t in (params.logit_bias or {}) if not 0 <= int(t) < vocab), None)
        if bad_bias is not None:
            raise InvalidParameter("logit_bias", f"logit_bias token id {bad_bias} is outside the vocabulary")
        bad_stop = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad_stop is not None:  # it could never be sampled: a mistake, not a stop condition
            raise InvalidParameter("stop_token_ids", f"stop token id {bad_stop} is outside the vocabulary [0, {vocab})")

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler, made on first use (xgrammar reads the whole vocabulary once)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidParameter("structured_outputs", "structured outputs need a model with a tokenizer")
                start = time.perf_counter()
                self._grammars = Grammars(self.tokenizer.hf, self.runner.vocab_size, self.eos_token_ids)
                log.info("structured outputs (xgrammar) ready in %.2f s", time.perf_counter() - start)
            return self._grammars

    def compile_constraint(self, params: SamplingParams):
        """The compiled grammar of params.constraint; raises InvalidParameter naming the request field
        when it cannot be compiled. Thread-safe and cached by spec: the server calls it off the event
        loop before new_request(), which then finds the grammar in the cache."""
        return self.grammars.compile(params.constraint)

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        seed = request.params.seed
        # A seeded request's i-th child uses seed + i, so n > 1 outputs differ but stay reproducible.
        seed = seed + index if seed is not None else self._seed_rng.getrandbits(62)
        seq = Sequence(next(self._seq_ids), request, index, seed, list(request.prompt_token_ids))
        if request.params.logprobs is not None:
            seq.logprobs = []
        if self.tokenizer is not None and request.pooling is None:
            from engine.tokenizer import IncrementalDetokenizer

            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=request.params.skip_special_tokens,
                stop=request.stop_matcher or (),
                include_stop_str_in_output=request.params.include_stop_str_in_output,
            )
        if request.grammar is not None:
            seq.matcher = self.grammars.matcher(request.grammar)
        if self._faults is not None and seq.detokenizer is not None:
            if self._faults.detokenizer_fails(request.request_id):
                seq.detokenizer.add = _failing_add
        if self._faults is not None and seq.matcher is not None and self._faults.grammar_fails(request.request_id):
            seq.matcher = BrokenMatcher(seq.matcher)
        request.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                self.runner.pooler.forget(seq.seq_id)

    @property
    def hidden_size(self) -> int:
        """The model's hidden size: the length of its embeddings."""
        return self.runner.model.config.hidden_size

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """One scheduling round and forward; outputs of every request that changed.

        With async scheduling, the next step is scheduled and launched before this one's tokens
        are read, so the host work of one step overlaps the device work of the other: each call
        completes the step launched by the call before and leaves its successor on the device.

        A step that raises (a failing forward, device out of memory) fails the requests it held
        (finish_reason "error", RequestOutput.error) and the engine goes on with the others; after
        MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row it raises EngineFailedError."""
        outputs: list[RequestOutput] = []
        try:
            self._step(outputs)
        except Exception as exc:
            outputs += self._recover(exc)
            return outputs
        self.consecutive_step_failures = 0
        return outputs

    def _step(self, outputs: list[RequestOutput]) -> None:
        """step()'s work; outputs are appended as they are made, so a failure keeps those made before it."""
        outputs += self._expire_queued()
        if self.in_flight is None:
            self.in_flight = self._launch()
            if self.in_flight is None:
                self.last_step = self._with_occupancy(StepStats())
                return
        done = self.in_flight
        if self.prelaunched is not None:
            self.in_flight, self.prelaunched = self.prelaunched, None
        else:
            self.in_flight = self._launch(done) if self._can_overlap(done) else None
        nxt = self.in_flight
        deferred = nxt if nxt is not None and nxt.launched.logits is not None else None
        # With a deferred successor, _complete leaves the grammar work (done's tokens into the matchers,
        # then deferred's mask) running on the grammar thread, or does it inline (self._grammar).
        outputs += self._complete(done, deferred)
        if not self.requests:
            # Idle until the caller brings a request: the next launch's wait is no step's time.
            self.last_launch = None
        if deferred is None:
            return
        # Its constrained rows' masks needed the tokens just read: its forward ran meanwhile. The forward
        # after it is enqueued right after this sampling, so the device goes from the sampling straight
        # into it instead of waiting for the next call to schedule it. While the grammar thread fills the
        # mask, that step is scheduled; its forward reads the tokens this sampling makes, so it cannot go
        # first. Inline, the sampling is enqueued first: scheduling would only hold it back.
        threaded = isinstance(self._grammar, Future)
        planned = self._schedule(True) if threaded and self._can_overlap(deferred) else None
        grammar = self._grammar_done()
        self.runner.sample(deferred.launched, grammar.mask if grammar is not None else None)
        if planned is not None:
            self.prelaunched = self._enqueue(planned, deferred)
        elif not threaded and self._can_overlap(deferred):
            self.prelaunched = self._launch(deferred)
        if grammar is not None:
            # Only now: a sequence must not end between its step's scheduling and its enqueueing.
            outputs += self._outputs(self._fail_grammar(grammar.failed))

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """After a step raised: fail every request with a running sequence (the failed step and any step
        launched after it held those, and their state on the device is unknown), drop the launched steps,
        and report every request that ended. Waiting and swapped requests go on untouched: their KV is
        intact, and a block is named in the prefix cache only after a step that filled it succeeded."""
        if isinstance(self._grammar, Future):  # it may still be using matchers: it ends before anything else runs
            wait([self._grammar])
        self._grammar = None
        self.consecutive_step_failures += 1
        if self.consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineFailedError(
                f"{self.consecutive_step_failures} steps failed in a row, the last with {exc!r}"
            ) from exc
        oom = isinstance(exc, torch.OutOfMemoryError)
        log.error("a step failed (%r); failing the requests it held", exc, exc_info=not oom)
        if oom and torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the failed step had taken
        self.in_flight = self.prelaunched = self.last_launch = None
        what = "ran out of device memory" if oom else f"failed ({type(exc).__name__})"
        for seq in list(self.scheduler.running):
            if not seq.is_finished:
                self.scheduler.fail(seq, f"the engine step that computed this request {what}")
        outputs = []
        now = time.monotonic()
        for request in list(self.requests.values()):
            if request.error is not None:
                self._end_failed(request)
            if request.is_finished:  # failed now, or finished by the step's update before it raised
                request.finished_time = now
                self.requests.pop(request.request_id)
                outputs.append(RequestOutput.of(request))
        self.last_step = self._with_occupancy(StepStats())
        return outputs

    def _end_failed(self, request: Request) -> None:
        """A request that one of its sequences failed ends whole: its other sequences end with it."""
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.fail(seq, request.error)
            self.runner.pooler.forget(seq.seq_id)

    def _can_overlap(self, in_flight: _Step) -> bool:
        """Whether the next step may be scheduled before `in_flight` returns its tokens: not when a penalty
        needs the generated tokens themselves on the host, nor around speculation: the next step's drafts
        are proposed from the tokens in flight, and a verify step's computed tokens are only known once its
        drafts are checked."""
        return self._pipelines() and (
            self.speculator is None
            or (in_flight.plan.drafts is None and not self.speculator.speculates(self.scheduler.running))
        )

    def _pipelines(self) -> bool:
        """Whether steps overlap when they do not speculate: async scheduling, and no penalty that needs the
        generated tokens themselves on the host."""
        return self.config.async_scheduling and not any(
            s.request.params.reads_output_tokens for s in self.scheduler.running
        )

    def _time_last_step(self, now: float, overlapped: bool) -> None:
        """Give the speculator the period of the step launched before this launch (at `now`, `overlapped` or
        not): with its tokens to the guard that decided its mode, and, when it was decode only, to the step times:
        a speculative step's, or a plain step's in the engine's usual mode (pipelined, when it pipelines: the
        step and its successor launched while their predecessors ran; the first of a run of pipelined steps is
        launched right after a synchronous one, a short period)."""
        step = self.last_launch
        if step is None:
            return
        seconds = now - step.started
        if step.mode is not None:
            # A speculative step is synchronous: its accepted tokens are counted by now. A plain one that is
            # still running emits one token a sampled sequence, counted at launch.
            self.speculator.count_step(step.mode, step.stats.num_generated_tokens, seconds)
        if not step.decode_only:
            return
        if step.speculated:
            self.speculator.times.add_spec(step.num_seqs, step.drafted, seconds)
        # Timed as a decode step when it and this launch both ran in the engine's usual mode. An overlapped launch
        # was let through by _can_overlap just now, over the same running sequences: _pipelines() holds, no walk.
        elif step.overlapped == overlapped and (overlapped or not self._pipelines()):
            self.speculator.times.add_decode(step.num_seqs, seconds)

    def _launch(self, previous: _Step | None = None) -> _Step | None:
        """Schedule a step, enqueue it on the device, and let the scheduler count it as launched."""
        planned = self._schedule(previous is not None)
        return self._enqueue(planned, previous) if planned is not None else None

    def _schedule(self, overlapped: bool = False) -> _Planned | None:
        """Schedule a step (None if there is nothing to run): its blocks moved, its drafts proposed, its
        sampling rows (an n > 1 request forks here) known. No matcher is read: the grammar thread may be
        running. `overlapped`: the step will be enqueued while its predecessor runs (for the step timing)."""
        bm = self.block_manager
        prefix_counts = bm.prefix_queried_tokens, bm.prefix_hit_tokens
        started = time.perf_counter()
        proposed = mode = None
        if self.speculator is not None:
            if self.speculator.can_pay:  # the step times feed only the decision of one that can
                self._time_last_step(started, overlapped)
            proposed = self.speculator.drafts(self.scheduler.running)
            mode = self.speculator.step_mode
        sched = self.scheduler.schedule(proposed)
        if sched.is_empty:
            self.last_launch = None  # idle: the next launch's wait for work is no step's time
            return None
        self.runner.move_blocks(sched.swap_out, sched.swap_in, sched.block_copies)
        draft_probs = None
        if proposed and self.runner.draft is not None:  # the draft model fills the drafts it was given room for
            speculating = [item for item in sched.scheduled if item.draft]
            if speculating:
                drafts, draft_probs = self.runner.draft.propose(speculating)
                self.scheduler.drafted(speculating, drafts)
        sampling: list[tuple[Sequence, int]] = []
        for row, item in enumerate(sched.scheduled):
            if not item.samples:
                continue
            seq = item.seq
            sampling.append((seq, row))
            if seq.index == 0 and len(seq.request.seqs) != seq.request.params.n:  # an n > 1 parent, not forked
                sampling += [(child, row) for child in self._fork_children(seq, item.num_new_tokens)]
        drafts = self._step_drafts(sched.scheduled, sampling) if proposed else None
        return _Planned(sched, sampling, drafts, draft_probs, prefix_counts, started, proposed is not None, mode)

    def _enqueue(self, planned: _Planned, previous: _Step | None) -> _Step:
        """Enqueue a scheduled step on the device (its sampling too, unless its mask has to wait for the
        tokens `previous` is sampling), and let the scheduler count it as launched."""
        sched, sampling, drafts = planned.sched, planned.sampling, planned.drafts
        # A constrained row's mask needs every token before the one it samples: when one of them is
        # still being sampled by the step in flight, the forward is enqueued now and the sampling
        # once that step's tokens are read.
        constrained = self._grammars is not None and any(seq.matcher is not None for seq, _ in sampling)
        defer = constrained and any(seq.matcher is not None and seq.num_pending for seq, _ in sampling)
        if self._faults is not None:
            self._faults.before_forward([item.seq.request.request_id for item in sched.scheduled])
        mask = None
        if constrained and not defer:  # over the step's sampling rows, one per sampled position
            mask = self._mask(expand_rows(sampling, drafts) if drafts is not None else sampling)
        launched = self.runner.launch(
            sched.scheduled,
            sampling,
            previous.launched if previous else None,
            mask=mask,
            defer_sampling=defer,
            drafts=drafts,
            draft_probs=planned.draft_probs,
        )
        plan = self.scheduler.launched(sched, sampling, drafts)
        bm, (queried, hits) = self.block_manager, planned.prefix_counts
        stats = StepStats(
            num_batched_tokens=sched.num_batched_tokens,
            num_prefill_tokens=plan.num_prefill_tokens,
            num_generated_tokens=len(sampling),
            num_preempted=len(sched.preempted),
            num_swapped_out=sum(s.status is SequenceStatus.SWAPPED for s in sched.preempted),
            prefix_queried_tokens=bm.prefix_queried_tokens - queried,
            prefix_hit_tokens=bm.prefix_hit_tokens - hits,
        )
        if self.speculator is not None:
            drafted = sum(len(d) for d in drafts or ())
            self.last_launch = _LaunchTime(
                planned.started,
                previous is not None,
                planned.proposed,
                decode_only=plan.num_prefill_tokens == 0,
                num_seqs=len(sched.scheduled),
                drafted=drafted,
                mode=planned.mode,
                stats=stats,
            )
        return _Step(plan, launched, stats)

    @staticmethod
    def _step_drafts(scheduled: list[ScheduledSeq], sampling: list[tuple[Sequence, int]]) -> list[list[int]] | None:
        """Per sampling entry, the draft its row verifies (empty for a child of n > 1 sampling its parent's
        row, and for sequences without one); None when the scheduler kept no draft."""
        drafts = [scheduled[row].draft if scheduled[row].seq is seq else () for seq, row in sampling]
        return drafts if any(drafts) else None

    def _mask(self, sampling: list[tuple[Sequence, int]]) -> StepMask | None:
        """The grammar bitmask of a step's constrained sampling rows (None if it has none)."""
        if self._grammars is None:
            return None
        rows = [(row, seq.matcher) for row, (seq, _) in enumerate(sampling) if seq.matcher is not None]
        return self._grammars.fill(rows)

    def _complete(self, step: _Step, deferred: _Step | None = None) -> list[RequestOutput]:
        """Read a launched step's tokens and hand them to the scheduler; outputs of the requests they changed.

        With `deferred` (the next step, its sampling waiting for its mask), the matchers are advanced and
        its mask filled (self._grammar): on the grammar thread while the scheduler takes the tokens, when
        there are at least config.grammar_thread_min_rows rows to do."""
        results = self.runner.collect(step.launched)
        failed = self._fail_nonfinite(step.launched, results.token_ids)
        work, refused = self._grammar_work(step.launched, results.token_ids, deferred)
        grammar = None
        if work is not None and deferred is not None:
            min_rows = self.config.grammar_thread_min_rows
            threaded = 0 < min_rows <= max(len(work.accepts), len(work.fills))
            self._grammar = self._grammars.start(work) if threaded else self._grammars.run(work)
        elif work is not None:  # no step waits for a mask: the matchers are advanced here
            grammar = self._grammars.run(work)
        touched = self.scheduler.update(step.plan, results.token_ids, results.logprobs, refused)
        if grammar is not None:
            touched += self._fail_grammar(grammar.failed)
        if step.plan.drafts is not None:
            self._count_speculation(step.plan, step.stats)
        touched += self._finish_pooled(step.launched)
        outputs = self._outputs(failed + touched)
        self.last_step = self._with_occupancy(step.stats)
        return outputs

    def _outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """The outputs of requests a step changed (one may come twice); those that ended are let go."""
        now = time.monotonic()
        outputs = []
        for request in requests:
            if request.error is not None:
                if request.request_id not in self.requests:
                    continue  # reported already (in `failed`, then in `touched`)
                self._end_failed(request)
            if request.is_finished:
                request.finished_time = now
                self.requests.pop(request.request_id, None)
            elif request.params.output_kind == "final_only":
                continue
            outputs.append(RequestOutput.of(request))
        return outputs

    def _fail_nonfinite(self, launched: LaunchedStep, token_ids: list[int]) -> list[Request]:
        """End each sequence whose logits were not finite (the runner reads its token as -1) with an error;
        their requests. The others of the step are untouched."""
        if min(token_ids, default=0) >= 0:
            return []
        failed = []
        for (seq, _), token in zip(launched.sampling, token_ids):
            if token < 0 and not seq.is_finished:
                log.error("request %s: the model's logits are not finite (NaN or inf)", seq.request.request_id)
                self.scheduler.fail(seq, "the model produced non-finite logits (NaN or inf) for this request")
                seq.matcher = None  # its grammar must not see the -1
                failed.append(seq.request)
        return failed

    def _count_speculation(self, plan: LaunchedPlan, stats: StepStats) -> None:
        """A speculative step's drafts: into the speculator's acceptance estimates and the step's stats."""
        per_pos = [0] * self.config.speculative_config.num_speculative_tokens
        for seq, num_draft, num_accepted in plan.accepted:
            self.speculator.observe(seq, num_draft, num_accepted)
            stats.num_drafts += 1
            stats.num_draft_tokens += num_draft
            stats.num_accepted_tokens += num_accepted
            for i in range(num_accepted):
                per_pos[i] += 1
        # Each draft emitted its accepted tokens besides the one token counted at launch.
        stats.num_generated_tokens += stats.num_accepted_tokens
        stats.num_accepted_tokens_per_pos = per_pos

    def _grammar_work(
        self, launched: LaunchedStep, token_ids: list[int], deferred: _Step | None
    ) -> tuple[GrammarWork | None, set[int]]:
        """The grammar work after a step's tokens are read: its constrained rows' matchers advanced by their
        tokens, then `deferred`'s constrained rows' mask filled (None if there is nothing to do); and the
        rows whose token their grammar refused (none was allowed: the grammar and min_tokens both banned
        every one), which the scheduler ends there. A matcher that takes a stop token has terminated and
        is dropped now (the work still advances it: a row of `deferred` no longer needs its mask)."""
        mask = launched.mask
        work = GrammarWork()
        refused: set[int] = set()
        if mask is not None:
            refused = mask.refused(token_ids)
            for row in mask.rows:
                seq = launched.sampling[row][0]
                if row not in refused and seq.matcher is not None:
                    work.accepts.append((seq, seq.matcher, token_ids[row]))
                    if token_ids[row] in self.eos_token_ids:
                        seq.matcher = None
        if deferred is not None:
            # In the deferred step's own row order: it was scheduled before these tokens were read, so its
            # rows are known now, and the mask needs no per-sequence slots mapped to rows at apply time.
            sampling = deferred.launched.sampling
            work.fills = [(seq, row, seq.matcher) for row, (seq, _) in enumerate(sampling) if seq.matcher is not None]
        return (work if work.accepts or work.fills else None), refused

    def _grammar_done(self) -> GrammarDone | None:
        """The grammar work for the deferred step, once done (None if there was none)."""
        grammar, self._grammar = self._grammar, None
        return grammar.result() if isinstance(grammar, Future) else grammar

    def _fail_grammar(self, failed: list[tuple[Sequence, str]]) -> list[Request]:
        """End each sequence whose grammar matcher raised with an error (_outputs ends its request); their
        requests."""
        requests = []
        for seq, error in failed:
            seq.matcher = None  # its state is unknown: no mask may be filled from it
            if seq.is_finished:
                continue
            log.error("request %s: the grammar matcher failed: %s", seq.request.request_id, error)
            self.scheduler.fail(seq, f"the structured-output grammar failed: {error}")
            requests.append(seq.request)
        return requests

    def _finish_pooled(self, launched: LaunchedStep) -> list[Request]:
        """Finish the embedding requests whose prompts completed in a step, each with its vector."""
        if launched.pooled is None:
            return []
        finished = []
        for seq, embedding in self.runner.pooler.collect(launched.pooled):
            if not seq.is_finished:  # else aborted while the step ran
                self.scheduler.pooled(seq, embedding)
                finished.append(seq.request)
        return finished

    def _with_occupancy(self, stats: StepStats) -> StepStats:
        bm, sched = self.block_manager, self.scheduler
        stats.num_running, stats.num_waiting, stats.num_swapped = (
            len(sched.running),
            len(sched.waiting),
            len(sched.swapped),
        )
        stats.kv_cache_usage = 1.0 - bm.num_free_blocks / bm.num_blocks
        return stats

    def _expire_queued(self) -> list[RequestOutput]:
        """Finish requests that waited past their queue deadline without ever being scheduled."""
        now = time.monotonic()
        expired = [
            s.request
            for s in self.scheduler.waiting
            if s.request.queue_deadline is not None
            and s.request.first_scheduled_time is None
            and now > s.request.queue_deadline
        ]
        outputs = []
        for request in expired:
            for seq in request.seqs:
                self.scheduler.finish(seq, "timeout")
            request.finished_time = now
            self.requests.pop(request.request_id, None)
            outputs.append(RequestOutput.of(request))
        return outputs

    def _fork_children(self, parent: Sequence, num_new_tokens: int) -> list[Sequence]:
        """The first time an n > 1 request's prompt is complete (the caller checks that its first sequence,
        `parent`, has not forked yet), its other n - 1 sequences are forked off it: they share every prompt
        block and sample from the same logits."""
        request = parent.request
        children = [self._new_sequence(request, index) for index in range(len(request.seqs), request.params.n)]
        self.scheduler.fork(parent, children, num_new_tokens)
        return children


def _failing_add(token_ids: list[int]) -> str:
    """A detokenizer's add() under an injected `detokenize` fault (engine/faults.py)."""
    raise RuntimeError("injected fault: the detokenizer failed")


def _load_tokenizer(model_dir: str, required: bool = False):
    """The model's tokenizer, or None for a model directory without tokenizer files (token-id prompts only);
    a tokenizer directory given on its own (`required`) must have them."""
    path = Path(model_dir)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        if required:
            raise ModelLoadError(path, "no tokenizer files (tokenizer.json, tokenizer.model or tokenizer_config.json)")
        return None
    from engine.tokenizer import Tokenizer

    return Tokenizer(model_dir)


def _config_eos(model_dir: str) -> frozenset[int]:
    from engine.loader import read_hf_config

    eos = read_hf_config(model_dir).get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])
