"""Prometheus metrics, named as vLLM names them, under the prefix `pagoda:` (or `--metrics-prefix`).

Engine-wide state (running / waiting requests, KV usage, tokens per iteration, preemptions, prefix-cache
lookups) comes from the engine's StepStats after every step; per-request latencies and token counts come
from each request's outputs as the server receives them, timed by the engine's stamps (arrival, first
scheduled, first token, finished). Each app has its own registry, so several can live in one process (tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from engine.llm_engine import LLMEngine, StepStats
from engine.sequence import RequestOutput

# Bucket bounds in seconds: from a fast CPU or GPU step up to very long generations.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def _token_buckets(max_num_batched_tokens: int) -> list[int]:
    """1, 8, 16, 32, ... up to the step's token budget."""
    buckets = [1, 8]
    while buckets[-1] < max_num_batched_tokens:
        buckets.append(min(buckets[-1] * 2, max_num_batched_tokens))
    return buckets


def _length_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to the context length: token counts of a request."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def cache_config_labels(engine: LLMEngine) -> dict[str, str]:
    """The KV cache's configuration as cache_config_info's labels (vLLM's label names, values as strings)."""
    config = engine.config
    swap_pool = engine.scheduler.swap_pool
    return {
        "block_size": str(config.block_size),
        "cache_dtype": str(engine.runner.kv_cache.dtype).removeprefix("torch."),
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "num_gpu_blocks": str(engine.block_manager.num_blocks),
        # The pool in tokens: an fp8 cache holds about twice the bf16 one's.
        "kv_cache_size_tokens": str(engine.block_manager.num_blocks * config.block_size),
        "calculate_kv_scales": str(config.calculate_kv_scales),
        "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
        "num_cpu_blocks": str(swap_pool.num_blocks if swap_pool is not None else 0),
        "swap_space": str(config.swap_space),
    }


class SpecDecodeMetrics:
    """vLLM's speculative-decoding counters: acceptance rate = accepted / draft tokens, mean acceptance
    length = 1 + accepted / drafts."""

    def __init__(self, counter, per_position):
        self.num_drafts = counter("spec_decode_num_drafts", "Speculative steps: a draft proposed for a sequence.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.per_position = per_position  # per draft position, its counter series

    def on_step(self, stats: StepStats) -> None:
        self.num_drafts.inc(stats.num_drafts)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        for position, count in enumerate(stats.num_accepted_tokens_per_pos or ()):
            self.per_position[position].inc(count)


class Metrics:
    def __init__(
        self,
        model_name: str,
        max_num_batched_tokens: int,
        max_model_len: int,
        prefix: str = "pagoda",
        spec_decode: int = 0,
    ):
        """Every collector, named `{prefix}:{vLLM's name}` and labelled model_name (but the process_* ones).

        spec_decode: the number of speculative tokens k of an engine that speculates (0: it does not),
        which declares the speculative-decoding counters (the per-position one for positions 0..k-1), so
        that no server exports zeros for a feature it does not have.
        """
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, open fds
        self.prefix = prefix
        label = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{prefix}:{name}", doc, list(label), registry=self.registry).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{prefix}:{name}", doc, list(label), registry=self.registry).labels(**label)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, list(label), buckets=buckets, registry=self.registry).labels(
                **label
            )

        self.num_requests_running = gauge(
            "num_requests_running", "Sequences holding KV blocks (prefilling or decoding)."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Sequences waiting to be admitted (incl. preempted for recomputation)."
        )
        self.num_requests_swapped = gauge(
            "num_requests_swapped", "Preempted sequences whose KV blocks are in CPU memory."
        )
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached their first token.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._preemptions = Counter(
            f"{prefix}:num_preemptions",
            "Sequences preempted, by mode: recompute (blocks dropped) or swap (to CPU).",
            ["model_name", "mode"],
            registry=self.registry,
        )
        for mode in ("recompute", "swap"):  # both series exist from the start, at 0
            self._preemptions.labels(model_name=model_name, mode=mode)
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache (full blocks of new requests)."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache: their prefill was skipped."
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens (prompt chunks + decodes) computed per engine step.",
            _token_buckets(max_num_batched_tokens),
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between successive outputs of a request, as the server receives them.",
            _ITL_BUCKETS,
        )
        # vLLM's older name for the same observations, which its published dashboards still chart.
        self.tpot = histogram(
            "time_per_output_token_seconds", "Time between successive outputs (= inter_token_latency).", _ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", _REQUEST_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled (time spent waiting).", _REQUEST_BUCKETS
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to the last.", _REQUEST_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to the last token (prefill + decode).", _REQUEST_BUCKETS
        )
        self.request_tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per finished request with 2+ output tokens: decode time / (output tokens - 1).",
            _ITL_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", _length_buckets(max_model_len)
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated by each finished request (all its choices).",
            _length_buckets(max_model_len),
        )
        self._success = Counter(
            f"{prefix}:request_success",
            "Finished outputs (one per choice) by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.spec_decode = None
        if spec_decode:
            per_pos = Counter(
                f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted, by position in the draft (0: the first).",
                ["model_name", "position"],
                registry=self.registry,
            )
            # Every series exists from the start, at 0, resolved once (labels() takes a lock and a lookup).
            series = [per_pos.labels(model_name=model_name, position=str(p)) for p in range(spec_decode)]
            self.spec_decode = SpecDecodeMetrics(counter, series)
        self._model_name = model_name

    def set_cache_config(self, labels: dict[str, str]) -> None:
        """cache_config_info: a gauge at 1 whose labels are the KV cache's configuration (cache_config_labels)."""
        info = Gauge(
            f"{self.prefix}:cache_config_info",
            "The KV cache's configuration, in the labels.",
            list(labels),
            registry=self.registry,
        )
        info.labels(**labels).set(1)

    def on_step(self, stats: StepStats) -> None:
        """Called on the engine thread after every step."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.generation_tokens.inc(stats.num_generated_tokens)
        self._preemptions.labels(model_name=self._model_name, mode="recompute").inc(
            stats.num_preempted - stats.num_swapped_out
        )
        self._preemptions.labels(model_name=self._model_name, mode="swap").inc(stats.num_swapped_out)
        self.prefix_cache_queries.inc(stats.prefix_queried_tokens)
        self.prefix_cache_hits.inc(stats.prefix_hit_tokens)
        if stats.num_batched_tokens:  # zero: an idle report, not an iteration
            self.iteration_tokens.observe(stats.num_batched_tokens)
        if self.spec_decode is not None:
            self.spec_decode.on_step(stats)

    def finished(self, reason: str, count: int = 1) -> None:
        self._success.labels(model_name=self._model_name, finished_reason=reason).inc(count)

    def on_finished(self, out: RequestOutput) -> None:
        """A request's last output: its token counts and the phases of its life, from the engine's stamps."""
        times = out.times
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(len(c.token_ids) for c in out.outputs))
        if times is None or None in (times.first_scheduled, times.first_token, times.finished):
            return  # finished without a token (e.g. an embedding request has none)
        self.prefill_time.observe(times.first_token - times.first_scheduled)
        self.decode_time.observe(times.finished - times.first_token)
        self.inference_time.observe(times.finished - times.first_scheduled)
        # n > 1: the longest choice decoded for the whole decode time.
        longest = max(len(c.token_ids) for c in out.outputs)
        if longest > 1:  # one token has no time per output token; a 0 would only drag the quantiles down
            self.request_tpot.observe((times.finished - times.first_token) / (longest - 1))


@dataclass
class RequestTracker:
    """Latency bookkeeping of one engine request, fed with its outputs as they arrive."""

    metrics: Metrics
    num_choices: int
    last_output_time: float | None = None
    finished_choices: set[int] = field(default_factory=set)

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        times = out.times
        if self.last_output_time is None:
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            if times is not None and times.first_token is not None:
                m.ttft.observe(times.first_token - times.arrival)
            if times is not None and times.first_scheduled is not None:
                m.queue_time.observe(times.first_scheduled - times.arrival)
        else:
            m.itl.observe(now - self.last_output_time)
            m.tpot.observe(now - self.last_output_time)
        self.last_output_time = now
        for choice in out.outputs:
            if choice.finish_reason is not None and choice.index not in self.finished_choices:
                self.finished_choices.add(choice.index)
                m.finished(choice.finish_reason)
        if out.finished:
            if times is not None and times.finished is not None:
                m.e2e.observe(times.finished - times.arrival)
            m.on_finished(out)

    def on_abort(self, reason: str) -> None:
        """The request ended early (client gone, engine dead, queue timeout): its unfinished choices count."""
        if len(self.finished_choices) < self.num_choices:
            self.metrics.finished(reason, self.num_choices - len(self.finished_choices))
