"""OpenTelemetry request traces (--otlp-traces-endpoint): one `llm_request` span per finished engine request.

The span and its attributes are those of vLLM's traces (the gen_ai.* semantic conventions where they have a
name, vLLM's gen_ai.latency.* where they have none), so a trace backend's views of vLLM show pagoda alike.
A client's W3C `traceparent` header makes the span a child of the client's trace.

Only the server imports this module, and only when tracing is on: without it opentelemetry is never imported.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from importlib.metadata import version
from urllib.parse import urlsplit

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from opentelemetry.trace import TracerProvider as AnyTracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput

_PROPAGATOR = TraceContextTextMapPropagator()


class RequestTracer:
    """Turns a finished request's output into its span, timed by the engine's stamps."""

    def __init__(self, provider: AnyTracerProvider, model_name: str):
        self._tracer = provider.get_tracer("pagoda", version("pagoda"))
        self._model_name = model_name

    def record(self, out: RequestOutput, params: SamplingParams, headers: Mapping[str, str]) -> None:
        times = out.times
        if times is None or times.finished is None:
            return
        attributes = {
            "gen_ai.request.id": out.request_id,
            "gen_ai.response.model": self._model_name,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n,
            "gen_ai.usage.prompt_tokens": len(out.prompt_token_ids),
            "gen_ai.usage.completion_tokens": sum(len(c.token_ids) for c in out.outputs),
            "gen_ai.response.finish_reasons": [c.finish_reason or "" for c in out.outputs],
            "gen_ai.latency.e2e": times.finished - times.arrival,
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if times.first_scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = times.first_scheduled - times.arrival
            attributes["gen_ai.latency.time_in_model_inference"] = times.finished - times.first_scheduled
        if times.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = times.first_token - times.arrival
            attributes["gen_ai.latency.time_in_model_decode"] = times.finished - times.first_token
            if times.first_scheduled is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = times.first_token - times.first_scheduled
        # The stamps are time.monotonic(); a span's times are wall-clock nanoseconds.
        wall_offset_ns = time.time_ns() - time.monotonic_ns()
        span = self._tracer.start_span(
            "llm_request",
            context=_PROPAGATOR.extract(headers),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=wall_offset_ns + int(times.arrival * 1e9),
        )
        span.end(end_time=wall_offset_ns + int(times.finished * 1e9))


def otlp_provider(endpoint: str) -> TracerProvider:
    """A TracerProvider that batches spans to an OTLP collector over HTTP (protobuf).

    `endpoint` is the collector's traces URL (http://host:4318/v1/traces); one with no path gets the standard
    /v1/traces, since vLLM's flag is usually given a bare collector address.
    """
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "pagoda")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider
