"""LLMEngine.step(): schedule -> run -> sample -> update; and the offline `LLM` API."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from pathlib import Path

from engine.block_manager import BlockManager, SwapPool
from engine.config import EngineConfig
from engine.model_runner import PLACEHOLDER, LaunchedStep, ModelRunner
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Request, RequestOutput, Sequence, SequenceStatus, TokenLogprobs

log = logging.getLogger("pagoda.engine")


@dataclass
class StepStats:
    """What one step did and the state it left, for metrics."""

    num_batched_tokens: int
    num_prefill_tokens: int  # of num_batched_tokens, those of prompts (incl. recomputation)
    num_generated_tokens: int
    num_preempted: int  # both modes
    num_swapped_out: int  # of num_preempted, those swapped to the CPU pool
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache this step
    prefix_hit_tokens: int  # of those, found (their prefill skipped)
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # fraction of KV blocks in use


@dataclass
class _Step:
    """A launched step, until its tokens are read."""

    scheduled: list[ScheduledSeq]
    ends: list[int]  # per scheduled sequence: its computed tokens once this step has run
    sampling: list[tuple[Sequence, int]]
    slots: list[int]  # per sampling row: the index in token_ids its token goes to
    launched: LaunchedStep
    stats: tuple  # the StepStats fields known at launch


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = config.model
        if model_dir is None:
            from engine.default_model import default_model_dir

            model_dir = str(default_model_dir())
        self.model_dir = model_dir
        self.tokenizer = _load_tokenizer(model_dir)
        eos = self.tokenizer.eos_token_ids if self.tokenizer else _config_eos(model_dir)
        self.eos_token_ids = eos
        self.runner = ModelRunner(config, model_dir, eos)
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
            "loaded %s (%s, %s on %s, %s attention): %d KV blocks of %d tokens = %d tokens in the cache, "
            "max_model_len %d",
            model_dir,
            type(self.runner.model).__name__,
            config.dtype,
            config.device,
            self.runner.attention_backend,
            num_blocks,
            config.block_size,
            capacity,
            self.max_model_len,
        )
        self.runner.capture_cuda_graphs(self.max_model_len)
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
        )
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self.in_flight: _Step | None = None  # launched, tokens not read yet (async scheduling)
        self.last_step: StepStats | None = None

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
        params: SamplingParams,
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
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        queue_timeout: float | None = None,
    ) -> Request:
        """A validated request for enqueue(); raises InvalidParameter (with the offending param) when it
        cannot be served. It reads no scheduling state, so another thread may call it (AsyncEngine's callers do).

        A request still waiting for its first scheduling `queue_timeout` seconds after arrival
        (default: the config's `queue_timeout`) finishes with finish_reason "timeout"."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameter("prompt", "this model has no tokenizer: give the prompt as token ids")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        self.check_request(token_ids, params)
        request = Request(request_id, text, token_ids, params, priority=priority)
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

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidParameter (naming the param) if this prompt and params cannot be served."""
        if not token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        vocab = self.runner.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameter("prompt", f"token id {bad} is outside the vocabulary [0, {vocab})")
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

    def _new_sequence(self, request: Request, index: int) -> Sequence:
        seed = request.params.seed
        # A seeded request's i-th child uses seed + i, so n > 1 outputs differ but stay reproducible.
        seed = seed + index if seed is not None else self._seed_rng.getrandbits(62)
        seq = Sequence(next(self._seq_ids), request, index, seed, list(request.prompt_token_ids))
        if request.params.logprobs is not None:
            seq.logprobs = []
        if self.tokenizer is not None:
            from engine.tokenizer import IncrementalDetokenizer

            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=request.params.skip_special_tokens,
                stop=request.params.stop,
                include_stop_str_in_output=request.params.include_stop_str_in_output,
            )
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

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """One scheduling round and forward; outputs of every request that changed.

        With async scheduling, the next step is scheduled and launched before this one's tokens
        are read, so the host work of one step overlaps the device work of the other: each call
        completes the step launched by the call before and leaves its successor on the device."""
        outputs = self._expire_queued()
        if self.in_flight is None:
            self.in_flight = self._launch()
            if self.in_flight is None:
                self.last_step = StepStats(0, 0, 0, 0, 0, 0, 0, *self._occupancy())
                return outputs
        done = self.in_flight
        self.in_flight = self._launch(done) if self._can_overlap() else None
        return outputs + self._complete(done)

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the one in flight returns its tokens:
        not when a penalty needs the generated tokens themselves on the host."""
        return self.config.async_scheduling and not any(
            s.request.params.reads_output_tokens for s in self.scheduler.running
        )

    def _launch(self, previous: _Step | None = None) -> _Step | None:
        """Schedule and enqueue a step. Every sequence it samples gets a PLACEHOLDER token (unless
        this token surely ends it by length), so the scheduler can already plan its next token."""
        bm = self.block_manager
        queried, hits = bm.prefix_queried_tokens, bm.prefix_hit_tokens
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        scheduled_at = time.monotonic()
        for item in sched.scheduled:
            if item.seq.request.first_scheduled_time is None:
                item.seq.request.first_scheduled_time = scheduled_at
        # Order matters: a block swapped out may be reused as a swap-in or copy target this step.
        self.runner.swap_blocks(sched.swap_out, to_cpu=True)
        self.runner.swap_blocks(sched.swap_in, to_cpu=False)
        self.runner.copy_blocks(sched.block_copies)
        sampling: list[tuple[Sequence, int]] = []
        for row, item in enumerate(sched.scheduled):
            if not item.samples:
                continue
            sampling.append((item.seq, row))
            sampling += [(child, row) for child in self._fork_children(item.seq, item.num_new_tokens)]
        launched = self.runner.launch(sched.scheduled, sampling, previous.launched if previous else None)
        prefill_tokens = 0
        ends = []
        for item in sched.scheduled:
            seq = item.seq
            # Prompt chunks and recomputation after preemption; a decode is one token past the prompt.
            if item.num_new_tokens > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
                prefill_tokens += item.num_new_tokens
            seq.num_computed_tokens += item.num_new_tokens
            ends.append(seq.num_computed_tokens)
        slots = []
        for seq, _ in sampling:
            num_tokens = len(seq.token_ids)
            slots.append(num_tokens)
            if not self._ends_by_length(seq, num_tokens + 1):
                seq.token_ids.append(PLACEHOLDER)
                seq.num_pending += 1
        stats = (
            sched.num_batched_tokens,
            prefill_tokens,
            len(sampling),
            len(sched.preempted),
            sum(s.status is SequenceStatus.SWAPPED for s in sched.preempted),
            bm.prefix_queried_tokens - queried,
            bm.prefix_hit_tokens - hits,
        )
        return _Step(sched.scheduled, ends, sampling, slots, launched, stats)

    def _complete(self, step: _Step) -> list[RequestOutput]:
        """Read a launched step's tokens, put them in place of the placeholders, check stops."""
        results = self.runner.collect(step.launched)
        for item, end in zip(step.scheduled, step.ends):
            # Not for a sequence preempted (or finished) since: its blocks are gone.
            if item.seq.status is SequenceStatus.RUNNING:
                self.block_manager.name_full_blocks(item.seq, end, item.num_new_tokens)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        logprobs = results.logprobs or [None] * len(step.sampling)
        for (seq, _), slot, token, token_logprobs in zip(step.sampling, step.slots, results.token_ids, logprobs):
            if seq.is_finished:  # aborted, or stopped by the token before this one
                continue
            self._put_token(seq, slot, token, token_logprobs)
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            # A final_only request has an output only once finished, so only when a sequence just finished.
            if seq.is_finished or request.params.output_kind != "final_only":
                touched[request.request_id] = request
        outputs = []
        for request in touched.values():
            if request.is_finished:
                request.finished_time = now
                self.requests.pop(request.request_id, None)
            elif request.params.output_kind == "final_only":
                continue
            outputs.append(RequestOutput.of(request))
        self.last_step = StepStats(*step.stats, *self._occupancy())
        return outputs

    def _occupancy(self) -> tuple[int, int, int, float]:
        bm, sched = self.block_manager, self.scheduler
        return len(sched.running), len(sched.waiting), len(sched.swapped), 1.0 - bm.num_free_blocks / bm.num_blocks

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
        """The first time an n > 1 request's prompt is complete, its other n - 1 sequences are
        forked off it: they share every prompt block and sample from the same logits."""
        request = parent.request
        if parent.index != 0 or len(request.seqs) == request.params.n:
            return []
        children = []
        for index in range(len(request.seqs), request.params.n):
            child = self._new_sequence(request, index)
            child.num_computed_tokens = parent.num_computed_tokens + num_new_tokens
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def _ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a sequence holding `num_tokens` tokens is done by max_tokens or the context length."""
        max_tokens = seq.request.params.max_tokens
        return (
            max_tokens is not None and num_tokens - seq.num_prompt_tokens >= max_tokens
        ) or num_tokens >= self.max_model_len

    def _put_token(self, seq: Sequence, slot: int, token: int, logprobs: TokenLogprobs | None) -> None:
        """The token sampled for position `slot` of `seq`: replaces its placeholder (or is appended)."""
        params = seq.request.params
        if slot < len(seq.token_ids):
            seq.token_ids[slot] = token
            seq.num_pending -= 1
        else:
            seq.token_ids.append(token)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
        num_out = slot + 1 - seq.num_prompt_tokens
        if not params.ignore_eos and token in self.eos_token_ids and num_out >= params.min_tokens:
            self._finish(seq, "stop", None)
            return
        if token in params.stop_token_ids and num_out >= params.min_tokens:
            self._finish(seq, "stop", token)
            return
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.add([token])
            if seq.detokenizer.stopped:
                self._finish(seq, "stop", seq.detokenizer.stop_string)
                return
        if self._ends_by_length(seq, slot + 1):
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        # A token already planned past this one (async scheduling) is dropped with the sequence.
        del seq.token_ids[len(seq.token_ids) - seq.num_pending :]
        seq.num_pending = 0
        if seq.detokenizer is not None and not seq.detokenizer.stopped:
            seq.text += seq.detokenizer.flush()
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq, reason)


@contextlib.contextmanager
def frozen_heap():
    """Keep the objects that exist now out of Python's cyclic garbage collections while the block runs.

    A collection of the oldest generation walks every object, torch's and the model's among them
    (~170,000 with a tiny model on the CPU): a stall of 0.1-0.2 s in whatever step it lands in, about
    once a W2 run. The objects the block makes are still collected as usual, and those frozen go back
    to the oldest generation after it. Nothing is done when the caller froze objects itself, since
    unfreezing would undo that too."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _load_tokenizer(model_dir: str):
    """The model's tokenizer, or None for a directory without tokenizer files (token-id prompts only)."""
    path = Path(model_dir)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from engine.tokenizer import Tokenizer

    return Tokenizer(model_dir)


def _config_eos(model_dir: str) -> frozenset[int]:
    from engine.loader import read_hf_config

    eos = read_hf_config(model_dir).get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


class LLM:
    """Offline batch generation, shaped like vLLM's `LLM`."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]] | list[int],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in the order of `prompts`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        # Offline, only the finished outputs are read.
        sampling_params = [replace(p, output_kind="final_only") for p in sampling_params]
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, params, priority=priority[i] if priority else 0)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar, frozen_heap():
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[i] for i in ids]
