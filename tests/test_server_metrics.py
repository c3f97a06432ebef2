"""vLLM's metrics and traces: `pagoda serve --metrics-prefix vllm` scraped after real requests of the openai SDK,
and --otlp-traces-endpoint's spans, caught by the OpenTelemetry SDK's in-memory exporter from a server in this
process (an exporter cannot be handed to a server process)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import FRANCE, MODEL, start_server

# (tokens asked for, streamed) of each request the vllm-prefix test sends; ignore_eos makes them exact.
CHATS = [(4, False), (5, True)]
COMPLETIONS = [(3, False), (6, True)]
REQUEST_HISTOGRAMS = (
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "time_to_first_token_seconds",
)


def samples(url: str) -> dict[tuple, float]:
    """/metrics as (sample name, sorted labels) -> value, model_name included."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: dict[tuple, float], name: str, **labels: str) -> float:
    return metrics[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("metrics"),
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "512",
        "--served-model-name",
        MODEL,
        "--disable-uvicorn-access-log",
        "--metrics-prefix",
        "vllm",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def send_requests(url: str) -> list[openai.types.CompletionUsage]:
    """The requests of CHATS and COMPLETIONS; the usage of each."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    common = {"model": MODEL, "temperature": 0, "extra_body": {"ignore_eos": True}}
    usages = []
    for max_tokens, stream in CHATS:
        if stream:
            chunks = client.chat.completions.create(
                messages=FRANCE, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, **common
            )
            usages.append([c.usage for c in chunks if c.usage is not None][0])
        else:
            usages.append(client.chat.completions.create(messages=FRANCE, max_tokens=max_tokens, **common).usage)
    for max_tokens, stream in COMPLETIONS:
        if stream:
            chunks = client.completions.create(
                prompt="Once upon a time",
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                **common,
            )
            usages.append([c.usage for c in chunks if c.usage is not None][0])
        else:
            usages.append(client.completions.create(prompt="Once upon a time", max_tokens=max_tokens, **common).usage)
    return usages


def test_vllm_prefix_exports_vllm_series_that_add_up(vllm_server):
    usages = send_requests(vllm_server.url)
    n = len(usages)
    assert [u.completion_tokens for u in usages] == [t for t, _ in CHATS + COMPLETIONS]
    deadline = time.monotonic() + 10
    while True:  # the engine thread counts generated tokens after the step that the response came from
        m = samples(vllm_server.url)
        if value(m, "vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages):
            break
        assert time.monotonic() < deadline, value(m, "vllm:generation_tokens_total")
        time.sleep(0.05)

    names = {name for name, _ in m}
    assert not any(name.startswith("pagoda:") for name in names)
    for name in REQUEST_HISTOGRAMS:
        assert value(m, f"vllm:{name}_count") == n, name
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    assert value(m, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert value(m, "vllm:prompt_tokens_total") == prompt_tokens
    assert value(m, "vllm:request_generation_tokens_sum") == sum(u.completion_tokens for u in usages)
    assert value(m, "vllm:request_success_total", finished_reason="length") == n
    # One interval between successive tokens of each request (one output per step on the CPU).
    intervals = sum(u.completion_tokens - 1 for u in usages)
    assert value(m, "vllm:time_per_output_token_seconds_count") == intervals
    assert value(m, "vllm:inter_token_latency_seconds_count") == intervals

    queue, prefill, decode, inference = (
        value(m, f"vllm:request_{phase}_time_seconds_sum") for phase in ("queue", "prefill", "decode", "inference")
    )
    assert queue > 0 and prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode, rel=1e-6)
    e2e, ttft = value(m, "vllm:e2e_request_latency_seconds_sum"), value(m, "vllm:time_to_first_token_seconds_sum")
    assert e2e == pytest.approx(queue + inference, rel=1e-6)
    assert ttft == pytest.approx(queue + prefill, rel=1e-6)
    # Each request's mean time per output token is at most its decode time (it has 2+ tokens).
    assert 0 < value(m, "vllm:request_time_per_output_token_seconds_sum") < decode

    assert value(m, "vllm:iteration_tokens_total_count") > 0
    assert value(m, "vllm:num_preemptions_total", mode="recompute") == 0
    # The two chats share their template's opening blocks; the second found them in the prefix cache.
    assert value(m, "vllm:prefix_cache_hits_total") >= 16
    assert value(m, "vllm:prefix_cache_queries_total") >= value(m, "vllm:prefix_cache_hits_total")
    assert not any("spec_decode" in name for name in names)  # no speculative decoding, no series for it

    (info,) = [dict(labels) for name, labels in m if name == "vllm:cache_config_info"]
    assert info == {
        "block_size": "16",
        "cache_dtype": "float32",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "num_gpu_blocks": "512",
        "kv_cache_size_tokens": "8192",
        "calculate_kv_scales": "False",
        "num_gpu_blocks_override": "512",
        "num_cpu_blocks": "0",
        "swap_space": "4.0",
    }
    assert m[("vllm:cache_config_info", tuple(sorted(info.items())))] == 1


def test_spec_decode_counters_exist_only_when_declared():
    from engine.llm_engine import StepStats
    from server.metrics import Metrics

    assert not any("spec_decode" in m.name for m in Metrics("m", 64, 256).registry.collect())
    metrics = Metrics("m", 64, 256, prefix="vllm", spec_decode=3)
    metrics.on_step(
        StepStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4, num_accepted_tokens_per_pos=[2, 1, 1])
    )
    get = metrics.registry.get_sample_value
    assert get("vllm:spec_decode_num_drafts_total", {"model_name": "m"}) == 2
    assert get("vllm:spec_decode_num_draft_tokens_total", {"model_name": "m"}) == 6
    assert get("vllm:spec_decode_num_accepted_tokens_total", {"model_name": "m"}) == 4
    per_pos = [
        get("vllm:spec_decode_num_accepted_tokens_per_pos_total", {"model_name": "m", "position": str(i)})
        for i in range(3)
    ]
    assert per_pos == [2, 1, 1]


def test_the_opentelemetry_sdk_is_not_imported_without_tracing():
    # FastAPI itself imports opentelemetry's API package; the SDK, the exporter and server/tracing.py are
    # what tracing adds, and they stay out.
    code = (
        "import sys, server.api, server.cli; "
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter', "
        "'server.tracing'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"


# ----- traces -----


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_span_per_request_with_vllms_attributes(default_model_dir):
    import uvicorn
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from server.api import ServerSettings, build_app

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine = AsyncEngine(
        EngineConfig(
            model=str(default_model_dir), dtype="float32", device="cpu", max_model_len=512, num_gpu_blocks_override=64
        )
    )
    app = build_app(engine, ServerSettings([MODEL], str(default_model_dir), tracer_provider=provider))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
        chat = client.chat.completions.create(
            model=MODEL,
            messages=FRANCE,
            max_tokens=4,
            temperature=0,
            top_p=0.9,
            extra_body={"ignore_eos": True},
            extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Request-Id": "traced-chat"},
        )
        stream = client.completions.with_raw_response.create(
            model=MODEL, prompt="Hello", max_tokens=3, stream=True, temperature=0.5
        )
        completion_id = stream.headers["x-request-id"]  # the server made it: the client sent none
        list(stream.parse())
    finally:
        server.should_exit = True
        thread.join(30)

    first, second = exporter.get_finished_spans()
    assert first.name == second.name == "llm_request"
    assert first.kind is SpanKind.SERVER
    a = first.attributes
    # The engine request id: the client's X-Request-Id, then the server's serial number.
    assert a["gen_ai.request.id"].startswith("traced-chat-")
    assert a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.usage.prompt_tokens"] == chat.usage.prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == 4
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.request.temperature"] == 0 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.request.n"] == 1
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert 0 < a["gen_ai.latency.time_in_queue"] < a["gen_ai.latency.time_to_first_token"] < a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.time_in_model_prefill"] + a["gen_ai.latency.time_in_model_decode"] == pytest.approx(
        a["gen_ai.latency.time_in_model_inference"]
    )
    assert first.end_time - first.start_time == pytest.approx(a["gen_ai.latency.e2e"] * 1e9, abs=1e3)
    # The client's traceparent made the span a child in the client's trace.
    assert format(first.context.trace_id, "032x") == trace_id
    assert format(first.parent.span_id, "016x") == parent_id
    b = second.attributes
    assert b["gen_ai.request.id"].startswith(completion_id + "-") and b["gen_ai.usage.completion_tokens"] <= 3
    assert b["gen_ai.request.temperature"] == 0.5
    assert second.parent is None
