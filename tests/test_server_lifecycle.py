"""`pagoda serve` with an API key and a bounded queue; SIGTERM draining; the command's help."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_server import FRANCE, scrape, start_server, wait_for_metric

KEY = "sekret-key"
NAME = "tiny-queue"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # One sequence at a time and one waiting at most: the third concurrent request is refused;
    # a request that waits 4 s without a seat is refused too.
    srv = start_server(
        tmp_path_factory.mktemp("server"),
        "--api-key",
        KEY,
        "--served-model-name",
        NAME,
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        "--max-model-len",
        "512",
        "--num-gpu-blocks-override",
        "64",
        "--queue-timeout",
        "4",
    )
    yield srv
    srv.stop()


def client_for(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_api_key_is_required_except_on_health_metrics_and_the_playground(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200
    page = httpx.get(f"{server.url}/")  # the page asks for the key; its API calls send it
    assert page.status_code == 200 and 'id="key"' in page.text
    for key in ("wrong", KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as err:
            client_for(server, key).models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    for path in ("/tokenize", "/detokenize", "/v1/completions", "/v1/embeddings"):  # no Authorization header at all
        r = httpx.post(f"{server.url}{path}", json={})
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": KEY}).status_code == 401  # no Bearer
    # Checked before the body is read: a malformed body without a key is still a 401.
    assert httpx.post(f"{server.url}/v1/chat/completions", content=b"{").status_code == 401
    good = client_for(server, KEY)
    assert [m.id for m in good.models.list().data] == [NAME]
    out = good.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_tokens=3)
    assert out.choices[0].message.content == "The capital of"
    assert len(good.embeddings.create(model=NAME, input="Hi").data[0].embedding) == 576


def test_a_full_queue_answers_503_with_retry_after(server):
    client = client_for(server, KEY)
    running = client.completions.create(
        model=NAME, prompt="Count:", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(running))  # it holds the only sequence seat now
    waiting_result = {}

    def waiting_request():
        waiting_result["out"] = client.completions.create(model=NAME, prompt="Hi", max_tokens=2)

    waiter = threading.Thread(target=waiting_request)
    waiter.start()
    wait_for_metric(server.url, "pagoda:num_requests_waiting", lambda v: v == 1)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
    assert err.value.status_code == 503 and err.value.body["code"] == "queue_full"
    assert int(err.value.response.headers["retry-after"]) >= 1
    running.close()  # frees the seat: the waiting request runs
    waiter.join(60)
    assert waiting_result["out"].usage.completion_tokens == 2


def test_a_request_that_waits_past_the_queue_timeout_is_answered_503(server):
    client = client_for(server, KEY)
    before = scrape(server.url)
    running = client.completions.create(
        model=NAME, prompt="Count:", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(running))
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
    assert 4 <= time.monotonic() - t0 < 30
    assert err.value.status_code == 503 and err.value.body["code"] == "queue_timeout"
    assert err.value.response.headers["retry-after"]
    running.close()
    timeout = ("pagoda:request_success_total", (("finished_reason", "timeout"),))
    assert scrape(server.url)[timeout] == before.get(timeout, 0) + 1


def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path):
    srv = start_server(tmp_path, "--max-model-len", "512", "--num-gpu-blocks-override", "64")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Count:", max_tokens=25, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = [next(iter(stream))]
    srv.process.terminate()  # SIGTERM while the stream is in flight
    chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices[0].text) == 25
    assert srv.process.wait(60) == 0, srv.log()[-3000:]
    with pytest.raises(httpx.TransportError):  # no longer listening
        httpx.get(f"{srv.url}/health", timeout=2)


def test_help_explains_every_flag():
    pagoda = Path(sys.executable).with_name("pagoda")
    out = subprocess.run([str(pagoda), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--dtype",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--gpu-memory-utilization",
        "--load-format",
        "--device",
        "--seed",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--max-waiting-requests",
        "--uvicorn-log-level",
        "--shutdown-timeout",
        "--disable-uvicorn-access-log",
        "--num-gpu-blocks-override",
        "--enable-prefix-caching",
        "--preemption-mode",
        "--swap-space",
        "--queue-timeout",
    ):
        assert flag in out.stdout, flag
    bad = subprocess.run([str(pagoda), "serve", "--max-num-seqs", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--max-num-seqs" in bad.stderr


def test_async_scheduling_serves_the_same_answers_and_frees_aborted_blocks(tmp_path):
    srv = start_server(tmp_path, "--async-scheduling", "--max-model-len", "512", "--num-gpu-blocks-override", "64")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        greedy = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=FRANCE, temperature=0, max_tokens=20
        )
        assert greedy.choices[0].message.content.startswith("The capital of France is Paris.")
        kwargs = dict(
            model="SmolLM2-135M-Instruct", prompt="Once upon a time", n=2, seed=7, temperature=0.9, max_tokens=10
        )
        whole = client.completions.create(**kwargs)
        streamed = {0: "", 1: ""}
        for chunk in client.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        assert streamed == {c.index: c.text for c in whole.choices} and whole.usage.completion_tokens == 20
        body = {
            "model": "SmolLM2-135M-Instruct",
            "prompt": "Count:",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(3):
                assert next(line for line in lines if line.startswith("data:"))
        after = wait_for_metric(srv.url, "pagoda:kv_cache_usage_perc", lambda v: v == 0, timeout=10)
        assert after[("pagoda:num_requests_running", ())] == 0
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_a_request_whose_sequences_alone_pass_the_queue_bound_is_a_400(server):
    # --max-waiting-requests 1 bounds sequences: two prompts, or n=2, could never be let in, so no retry helps.
    for body, param in (({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "a", "n": 2}, "n")):
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": NAME, "max_tokens": 1, **body},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "queues at most 1" in r.json()["error"]["message"]
