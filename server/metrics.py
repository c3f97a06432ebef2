"""Prometheus metrics, named as vLLM names them with the prefix `pagoda:` instead of `vllm:`.

Engine-wide state (running / waiting requests, KV usage, tokens per iteration, preemptions) comes
from the engine's StepStats after every step; per-request latencies come from each request's
outputs as the server receives them. Each app has its own registry, so several can live in one
process (tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from engine.llm_engine import StepStats
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


class Metrics:
    def __init__(self, model_name: str, max_num_batched_tokens: int):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, memory, open fds
        label = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagoda:{name}", doc, list(label), registry=self.registry).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagoda:{name}", doc, list(label), registry=self.registry).labels(**label)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"pagoda:{name}", doc, list(label), buckets=buckets, registry=self.registry).labels(
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
            "pagoda:num_preemptions",
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
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.", _REQUEST_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled (time spent waiting).", _REQUEST_BUCKETS
        )
        self._success = Counter(
            "pagoda:request_success",
            "Finished outputs (one per choice) by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name

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

    def finished(self, reason: str, count: int = 1) -> None:
        self._success.labels(model_name=self._model_name, finished_reason=reason).inc(count)


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
        self.last_output_time = now
        for choice in out.outputs:
            if choice.finish_reason is not None and choice.index not in self.finished_choices:
                self.finished_choices.add(choice.index)
                m.finished(choice.finish_reason)
        if out.finished and times is not None and times.finished is not None:
            m.e2e.observe(times.finished - times.arrival)

    def on_abort(self, reason: str) -> None:
        """The request ended early (client gone, engine dead, queue timeout): its unfinished choices count."""
        if len(self.finished_choices) < self.num_choices:
            self.metrics.finished(reason, self.num_choices - len(self.finished_choices))
