"""What a vLLM user meets first, against a real `pagoda serve` on loopback: the first stream chunk waits for
the first token, request ids and the per-request log line, the start-up log, a taken port, the shutdown
timeout, and 404s / docs for endpoints a client probes."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_server import FRANCE, MODEL, _free_port, start_server

FLAGS = ("--max-model-len", "2048", "--num-gpu-blocks-override", "160", "--disable-uvicorn-access-log")
# "request <id> finished (<reason>): prompt P tokens, generated G tokens, TTFT T s, e2e E s"
LOG_LINE = re.compile(
    r"request (\S+) finished \((\S+)\): prompt (\d+) tokens, generated (\d+) tokens, TTFT ([\d.]+) s, e2e ([\d.]+) s"
)
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("edges"), *FLAGS)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def finished_lines(server, request_id: str, count: int = 1, timeout: float = 10.0) -> list[re.Match]:
    """The log lines of the engine requests whose ids begin with `request_id`, once `count` are there."""
    deadline = time.monotonic() + timeout
    while True:
        found = [m for m in LOG_LINE.finditer(server.log()) if m[1].startswith(f"{request_id}-")]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_the_first_chat_chunk_waits_for_the_first_token(server, client):
    # ~500 prompt tokens: a prefill of a good fraction of a second on the CPU. Before the first token
    # exists the server has nothing to send, not even the role: the client's time to its first chunk
    # includes the server's own TTFT (measured inside it, so the comparison holds however loaded the machine).
    prompt = "Here is a list of numbers: " + " ".join(str(i) for i in range(130)) + ". What comes next?"
    started = time.monotonic()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=4,
        stream=True,
        extra_headers={"X-Request-Id": "ttft-check"},
    )
    chunks = iter(stream)
    first = next(chunks)
    to_first_chunk = time.monotonic() - started
    rest = list(chunks)
    assert stream.response.headers["x-request-id"] == "ttft-check"
    assert first.choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in rest if c.choices)
    (line,) = finished_lines(server, "ttft-check")
    assert int(line[3]) > 400 and int(line[4]) == 4
    server_ttft = float(line[5])
    assert server_ttft > 0.05, "the prefill should take measurable time"
    assert to_first_chunk >= server_ttft


def test_request_ids_are_echoed_generated_and_kept_apart(server, client):
    given = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "mine-42"})
    assert given.status_code == 200 and given.headers["x-request-id"] == "mine-42"
    made = [httpx.get(f"{server.url}/v1/models").headers["x-request-id"] for _ in range(2)]
    assert made[0] != made[1] and all(re.fullmatch(r"[0-9a-f]{32}", m) for m in made)
    # Errors carry it too.
    assert httpx.get(f"{server.url}/v1/nope", headers={"X-Request-Id": "e1"}).headers["x-request-id"] == "e1"

    async def two_at_once():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def one():
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=FRANCE,
                temperature=0,
                max_tokens=8,
                stream=True,
                extra_headers={"X-Request-Id": "twin"},
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async with aclient:
            return await asyncio.gather(one(), one())

    texts = asyncio.run(two_at_once())
    whole = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=8)
    assert texts == [whole.choices[0].message.content] * 2
    lines = finished_lines(server, "twin", 2)
    assert len(lines) == 2 and lines[0][1] != lines[1][1]  # two engine requests, two ids
    for line in lines:
        assert line[2] == whole.choices[0].finish_reason
        assert (int(line[3]), int(line[4])) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
        assert float(line[5]) <= float(line[6])

    # Several prompts in one request: an engine request (and a log line) each.
    out = client.completions.create(
        model=MODEL, prompt=["Hi", "Bye"], max_tokens=2, extra_headers={"X-Request-Id": "pair"}
    )
    assert out.usage.completion_tokens == 4
    assert len({line[1] for line in finished_lines(server, "pair", 2)}) == 2


def test_start_up_logs_each_step_in_order(server):
    log = server.log()
    deadline = time.monotonic() + 10  # the last line follows the first /health by a moment
    while f"ready at {server.url} " not in log:
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
        log = server.log()
    steps = [
        "loading the weights of",
        "weights loaded in",
        "160 KV blocks of 16 tokens",
        "no CUDA graphs: the device is cpu",
    ]
    steps.append(f"ready at {server.url} (serving {MODEL} at /v1;")
    where = [log.find(step) for step in steps]
    assert -1 not in where and where == sorted(where), log
    assert all(log.count(step) == 1 for step in steps), log  # each told once


def test_unserved_endpoints_are_openai_shaped_404s(server, client):
    for method, path in [("POST", "/v1/audio/transcriptions"), ("GET", "/v1/foo"), ("GET", "/redoc")]:
        r = httpx.request(method, f"{server.url}{path}")
        assert r.status_code == 404
        error = r.json()["error"]
        assert set(error) == ERROR_KEYS and f"{method} {path}" in error["message"]
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and "GET /v1/chat/completions" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.audio.transcriptions.create(model=MODEL, file=("a.wav", b"RIFF"))
    assert "POST /v1/audio/transcriptions" in err.value.body["message"]


def test_docs_need_no_network(server):
    page = httpx.get(f"{server.url}/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script" not in page.text and "<link" not in page.text  # nothing to fetch from a CDN
    assert "/v1/chat/completions" in page.text and "/openapi.json" in page.text
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert "/v1/completions" in schema["paths"] and "/docs" not in schema["paths"]


def test_a_taken_port_fails_at_once_in_one_line():
    pagoda = Path(sys.executable).with_name("pagoda")
    port = _free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        started = time.monotonic()
        out = subprocess.run(
            [str(pagoda), "serve", "--host", "127.0.0.1", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode != 0
    assert time.monotonic() - started < 20  # the process starts (imports torch), but loads no model
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "loading" not in text
    (line,) = text.strip().splitlines()
    assert str(port) in line and "in use" in line


def test_the_shutdown_timeout_ends_open_requests_with_an_error_and_exits_1(tmp_path):
    srv = start_server(tmp_path, *FLAGS, "--shutdown-timeout", "1", "--disable-log-requests")
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 1900, "ignore_eos": True}
    whole = {}

    def whole_request():  # a request that waits for its whole answer is cut off too: a 503
        whole["response"] = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60)

    waiter = threading.Thread(target=whole_request)
    waiter.start()
    streams = 6
    with contextlib.ExitStack() as stack:
        responses = [
            stack.enter_context(
                httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
            )
            for _ in range(streams)
        ]
        events = [(line[6:] for line in r.iter_lines() if line.startswith("data: ")) for r in responses]
        for stream in events:
            assert '"content"' in next(stream)
        signalled = time.monotonic()
        srv.process.terminate()
        rests = [list(stream) for stream in events]
    ended = time.monotonic() - signalled
    waiter.join(60)
    for rest in rests:  # every stream ends with one error event, then [DONE]
        assert rest[-1] == "[DONE]"
        error = httpx.Response(200, content=rest[-2]).json()["error"]
        assert set(error) == ERROR_KEYS and error["code"] == "server_shutting_down"
        assert all('"error"' not in event for event in rest[:-2])
    assert 1 <= ended < 5  # cut off at the timeout, well before uvicorn's own backstop (timeout + 5 s)
    response = whole["response"]
    assert response.status_code == 503 and response.json()["error"]["code"] == "server_shutting_down"
    assert srv.process.wait(30) == 1  # requests were lost: not a clean stop
    log = srv.log()
    for sign in ("Traceback", "CancelledError", "Exception in ASGI", "ASGI callable", "Cancel "):
        assert sign not in log, log[-3000:]
    assert [line for line in log.splitlines() if "shutdown timeout" in line or "cutting off" in line] == [
        next(line for line in log.splitlines() if f"cutting off {streams + 1} request(s)" in line)
    ]
    assert "finished (" not in log  # --disable-log-requests
