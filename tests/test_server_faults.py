"""Faults inside the engine, through a real `pagoda serve` and the openai SDK: faults are injected with the
test-only PAGODA_INJECT_FAULTS (engine/faults.py), picked by the client's X-Request-Id.

A failed request gets an OpenAI-shaped 500 (streaming: an error event, then [DONE]); the others go on; a
fault that does not go away kills the engine: /health says 503 and the process exits 1 within seconds."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.llm_engine import MAX_CONSECUTIVE_STEP_FAILURES
from tests.test_server import FRANCE, PARIS, scrape, start_server, wait_for_metric

FLAGS = ("--max-model-len", "512", "--num-gpu-blocks-override", "128", "--disable-uvicorn-access-log")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("server"),
        *FLAGS,
        env={"PAGODA_INJECT_FAULTS": "step:fault-step:always,nan:fault-nan:always"},
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, request_id: str | None = None, stream: bool = False, max_tokens: int = 12):
    headers = {"X-Request-Id": request_id} if request_id else None
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=FRANCE,
        temperature=0,
        max_tokens=max_tokens,
        stream=stream,
        extra_headers=headers,
    )


def _streamed_text(client, request_id: str | None = None) -> str:
    return "".join(c.choices[0].delta.content or "" for c in _chat(client, request_id, stream=True) if c.choices)


def _assert_idle(server) -> None:
    metrics = wait_for_metric(server.url, "pagoda:kv_cache_usage_perc", lambda v: v == 0, timeout=10)
    assert metrics[("pagoda:num_requests_running", ())] == 0
    assert metrics[("pagoda:num_requests_waiting", ())] == 0
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_failed_step_is_a_500_and_the_server_goes_on(server, client):
    # Each failure is followed by a good request: its steps succeed, so the failures never add up to the
    # engine's limit of failed steps in a row.
    with pytest.raises(openai.InternalServerError) as info:
        _chat(client, "fault-step-1")
    error = info.value.body
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "the engine failed this request" in error["message"]
    assert _chat(client).choices[0].message.content == PARIS
    # Streaming: the SDK raises on the error event; the raw stream ends with [DONE] after it.
    with pytest.raises(openai.APIError, match="the engine failed this request"):
        _streamed_text(client, "fault-step-2")
    assert _streamed_text(client) == PARIS
    body = {"model": "SmolLM2-135M-Instruct", "messages": FRANCE, "max_tokens": 8, "stream": True}
    raw = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "fault-step-3"})
    events = [line for line in raw.text.splitlines() if line.startswith("data: ")]
    assert '"engine_error"' in events[-2] and events[-1] == "data: [DONE]"
    assert _chat(client).choices[0].message.content == PARIS
    _assert_idle(server)


def test_nan_logits_fail_one_request_while_its_batch_finishes(server, client):
    errors_before = scrape(server.url).get(("pagoda:request_success_total", (("finished_reason", "error"),)), 0)
    results: dict[str, object] = {}

    def run(name: str, request_id: str | None) -> None:
        try:
            results[name] = _streamed_text(client, request_id)
        except openai.APIError as exc:
            results[name] = exc

    threads = [threading.Thread(target=run, args=(f"ok-{i}", None)) for i in range(3)]
    threads.append(threading.Thread(target=run, args=("victim", "fault-nan-1")))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert isinstance(results["victim"], openai.APIError), results["victim"]
    assert "non-finite logits" in str(results["victim"])
    assert [results[f"ok-{i}"] for i in range(3)] == [PARIS] * 3
    _assert_idle(server)
    errors = scrape(server.url)[("pagoda:request_success_total", (("finished_reason", "error"),))]
    assert errors == errors_before + 1


def test_an_engine_that_keeps_failing_turns_health_503_and_exits_1(tmp_path, tiny_model_dir, default_model_dir):
    # The tiny random model (it starts in a moment), with the default model's tokenizer files.
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(default_model_dir) / name, model / name)
    flags = ("--num-gpu-blocks-override", "32", "--disable-uvicorn-access-log")
    srv = start_server(tmp_path, str(model), *flags, env={"PAGODA_INJECT_FAULTS": "step:*:always"})
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    served = client.models.list().data[0].id

    def complete():
        return client.completions.create(model=served, prompt=[1, 2, 3], max_tokens=4)

    try:
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
            with pytest.raises(openai.InternalServerError):
                complete()
        with pytest.raises(openai.APIStatusError) as info:  # the step that kills the engine
            complete()
        assert info.value.status_code == 503 and info.value.body["code"] == "engine_dead"
        died = time.monotonic()
        assert httpx.get(f"{srv.url}/health").status_code == 503
        assert srv.process.wait(15) == 1, srv.log()[-3000:]
        assert time.monotonic() - died < 10
        assert "the engine died" in srv.log()
    finally:
        if srv.process.poll() is None:
            srv.process.kill()
