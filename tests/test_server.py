"""The HTTP server, end to end: a real `pagoda serve` process on a loopback port, the real `openai`
SDK (sync and async clients) as the client, the real default model.

Greedy decoding wherever exact text matters, and short outputs: every generated token costs a
forward pass of the whole model on the CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smol"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."


# ----- a server process, as a user starts it -----


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(log_dir: Path, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
    """`pagoda serve --port <free> --dtype float32 FLAGS` in the background; returns once /health is 200."""
    pagoda = Path(sys.executable).with_name("pagoda")  # the console script `pip install -e .` made
    port = _free_port()
    log_path = log_dir / f"pagoda-{port}.log"
    cmd = [str(pagoda), "serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", *flags]
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the server
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"pagoda serve exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    process.kill()
    pytest.fail(f"pagoda serve did not become healthy:\n{server.log()}")


def scrape(url: str) -> dict[tuple, float]:
    """/metrics parsed by prometheus_client: (sample name, (label, value)... without model_name) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def wait_for_metric(url: str, name: str, want, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(url)
        if want(metrics.get((name, ()), None)):
            return metrics
        if time.monotonic() > deadline:
            pytest.fail(f"{name} stayed at {metrics.get((name, ()))}")
        time.sleep(0.05)


# ----- fixtures -----


# The flags of the suite's shared server (the `default_server` fixture in tests/conftest.py, also used by
# test_bench_latency.py and test_docker.py): one start for the three modules.
SERVER_FLAGS = (
    "--max-model-len",
    "1024",
    "--num-gpu-blocks-override",
    "512",
    "--served-model-name",
    MODEL,
    ALIAS,
    "--disable-uvicorn-access-log",
)


@pytest.fixture(scope="module")
def server(default_server):
    # Shared: every test here reads metrics as differences and leaves the server idle.
    return default_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def async_client_factory(server):
    # An async client belongs to one event loop, so each asyncio.run gets its own.
    return lambda: openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from engine.tokenizer import Tokenizer

    return Tokenizer(default_model_dir)


# ----- endpoints -----


def test_startup_log_says_what_was_loaded_the_kv_capacity_and_the_url(server):
    log = server.log()
    assert "SmolLM2-135M-Instruct" in log and "512 KV blocks of 16 tokens = 8192 tokens" in log
    deadline = time.monotonic() + 10  # the line follows the server's start by a moment
    while f"ready at {server.url} (serving {MODEL} at /v1;" not in log:
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
        log = server.log()


def test_health_version_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, ALIAS]
    assert models.data[0].max_model_len == 1024 and models.data[0].owned_by == "pagoda"
    assert client.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_greedy_answer_and_usage_counts(client, tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == PARIS
    assert choice.finish_reason == "stop" and choice.index == 0
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MODEL
    assert abs(out.created - time.time()) < 60
    prompt_ids = tokenizer.apply_chat_template(FRANCE)
    assert out.usage.prompt_tokens == len(prompt_ids)
    # The answer's tokens plus the end-of-sequence token that stopped it.
    assert out.usage.completion_tokens == len(tokenizer.encode(PARIS, add_special_tokens=False)) + 1
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_alias_name_and_max_completion_tokens(client):
    out = client.chat.completions.create(model=ALIAS, messages=FRANCE, temperature=0, max_completion_tokens=3)
    assert out.model == MODEL  # responses carry the first served name
    assert out.choices[0].message.content == "The capital of"
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3


def test_chat_stream_equals_non_stream_for_the_same_seed(async_client_factory):
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story about a cat."}],
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        max_tokens=12,
    )

    async def main():
        client = async_client_factory()
        whole = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        return whole, chunks

    whole, chunks = asyncio.run(main())
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0] is chunks[-2]
    assert finish[0].choices[0].finish_reason == whole.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_n2_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", n=2, seed=7, temperature=0.9, max_tokens=10)
    whole = client.completions.create(**kwargs)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.choices[0].text != whole.choices[1].text  # n samples differ
    texts = {0: "", 1: ""}
    finish = {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert whole.usage.completion_tokens == 20


def test_completions_prompt_shapes_and_choice_order(client, tokenizer):
    prompts = ["The capital of France is", "One, two, three,"]
    ids = [tokenizer.encode(p) for p in prompts]
    common = dict(model=MODEL, temperature=0, max_tokens=4, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=prompts, n=2, **common)
    # One choice per prompt x n, numbered prompt by prompt.
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    texts = [c.text for c in by_text.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]  # greedy: n copies
    assert by_text.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert by_text.usage.completion_tokens == 8 * 2
    single = client.completions.create(prompt=prompts[1], **common)
    assert single.choices[0].text == texts[2]
    by_ids = client.completions.create(prompt=ids[1], **common)
    assert by_ids.choices[0].text == texts[2]
    by_id_lists = client.completions.create(prompt=ids, **common)
    assert [c.text for c in by_id_lists.choices] == [texts[0], texts[2]]


def test_completions_default_max_tokens_is_16(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_stop_strings(client):
    out = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=20, stop="Paris")
    assert out.choices[0].message.content == "The capital of France is "
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == "Paris"
    streamed = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=20, stop=["zzz", "France"], stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The capital of "
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content[:7]) == PARIS  # the 8th is the end-of-sequence token
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    stream = client.chat.completions.create(
        model=MODEL, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # The second request reuses the first one's prompt blocks (prefix cache), so its tail is computed in a
    # matmul of other row counts: the same values up to float32 summation order.
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_completions_logprobs_and_echo(client):
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and top[token] == logprob == max(top.values())
    echoed = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3, echo=True
    )
    assert echoed.choices[0].text == "The capital of France is" + out.choices[0].text
    stream = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text


def test_vllm_extra_parameters(client, tokenizer):
    base = dict(model=MODEL, messages=FRANCE, max_tokens=6)
    greedy = client.chat.completions.create(**base, temperature=0).choices[0].message.content
    top_k_1 = client.chat.completions.create(**base, temperature=1.5, seed=3, extra_body={"top_k": 1})
    assert top_k_1.choices[0].message.content == greedy
    forced = client.chat.completions.create(
        **base,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 6, "min_p": 0.1, "repetition_penalty": 1.2, "priority": 1},
    )
    assert forced.usage.completion_tokens == 6
    # Stop on the token " capital": the text ends before it, the reason names it.
    capital = tokenizer.encode(" capital", add_special_tokens=False)
    stopped = client.chat.completions.create(**base, temperature=0, extra_body={"stop_token_ids": capital})
    assert stopped.choices[0].message.content == "The" and stopped.choices[0].model_extra["stop_reason"] == capital[0]
    # Past an ignored end-of-sequence token, which is special: kept in the text only when asked.
    for skip in (True, False):
        special = client.chat.completions.create(
            **{**base, "max_tokens": 9}, temperature=0, extra_body={"skip_special_tokens": skip, "ignore_eos": True}
        )
        text = special.choices[0].message.content
        assert text.startswith(PARIS) and ("<|im_end|>" in text) is (not skip)


def test_sampling_parameters_take_effect(client):
    base = dict(model=MODEL, messages=FRANCE, max_tokens=5)
    a = client.chat.completions.create(
        **base, temperature=1.0, seed=11, presence_penalty=0.5, frequency_penalty=0.5, user="someone"
    )
    b = client.chat.completions.create(
        **base, temperature=1.0, seed=11, presence_penalty=0.5, frequency_penalty=0.5, user="someone"
    )
    assert a.choices[0].message.content == b.choices[0].message.content  # seeded: reproducible
    token = 28120  # "hello"
    biased = client.chat.completions.create(**base, temperature=1.0, logit_bias={str(token): 100}, logprobs=True)
    assert [t.token for t in biased.choices[0].logprobs.content] == ["hello"] * 5


def test_null_parameters_take_their_defaults(server):
    body = {
        "model": MODEL,
        "messages": FRANCE,
        "max_tokens": 3,
        "temperature": None,
        "top_p": None,
        "n": None,
        "stop": None,
        "seed": None,
        "tools": None,
        "logprobs": None,
        "stream": None,
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] <= 3


def test_message_shapes(client, server):
    messages = [
        {"role": "developer", "content": "You answer in one word."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Capital of France?"}, {"type": "text", "text": "Answer briefly."}],
        },
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?", "name": "bob"},
    ]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=4)
    counted = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert out.usage.prompt_tokens == counted["count"]
    as_system = [{"role": "system", "content": "You answer in one word."}] + messages[1:]
    assert httpx.post(f"{server.url}/tokenize", json={"messages": as_system}).json()["tokens"] == counted["tokens"]


def test_tokenize_and_detokenize(server, tokenizer):
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": FRANCE}).json()
    assert chat["tokens"] == tokenizer.apply_chat_template(FRANCE)
    back = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json()
    assert back == {"prompt": "Hello world"}


# ----- errors -----

LONG_PROMPT = "hello " * 1100  # over the 1024-token context

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ERRORS = [
    # (path, body, status, param)
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": FRANCE, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": FRANCE, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": FRANCE, "n": 100000}, 400, "n"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {"messages": FRANCE, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": FRANCE, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": FRANCE, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": FRANCE, "stream": "maybe"}, 400, "stream"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "txt": "x"}]}]},
        400,
        "messages[0].content[0].text",
    ),
    ("/v1/chat/completions", {"messages": FRANCE, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": FRANCE, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    # This server runs without --enable-auto-tool-choice: tools alone mean tool_choice "auto", which it cannot do.
    ("/v1/chat/completions", {"messages": FRANCE, "tools": [WEATHER_TOOL]}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": FRANCE, "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"messages": FRANCE, "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": FRANCE}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["fine", LONG_PROMPT]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2, 10**7]}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": FRANCE, "stop_token_ids": [10**7]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop": [str(i) for i in range(100_000)]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": FRANCE, "stop": ["x" * 257]}, 400, "stop"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", ERRORS, ids=[f"{e[0]}-{e[3]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_are_openai_shaped(server, path, body, status, param):
    if path.startswith("/v1/") and "model" not in body:
        body = {"model": MODEL, **body}
    r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert "Traceback" not in r.text


def test_malformed_json_and_wrong_content(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json=["not", "an", "object"])
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{server.url}/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_sdk_raises_the_matching_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=-5)
    assert err.value.status_code == 400 and err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=FRANCE, tools=[WEATHER_TOOL])
    assert "--enable-auto-tool-choice" in err.value.message


def test_bad_requests_do_not_disturb_a_stream(async_client_factory, client):
    reference = client.completions.create(model=MODEL, prompt="The alphabet:", temperature=0, max_tokens=10)

    async def main():
        c = async_client_factory()
        stream = await c.completions.create(
            model=MODEL, prompt="The alphabet:", temperature=0, max_tokens=10, stream=True
        )
        bad = [c.completions.create(model=MODEL, prompt=[1, 10**9]) for _ in range(5)]
        bad += [c.chat.completions.create(model=MODEL, messages=FRANCE, temperature=9) for _ in range(5)]
        results = await asyncio.gather(*bad, return_exceptions=True)
        text = "".join([chunk.choices[0].text async for chunk in stream])
        return text, results

    text, results = asyncio.run(main())
    assert all(isinstance(r, openai.BadRequestError) for r in results)
    assert text == reference.choices[0].text


# ----- aborts, load, metrics -----


def test_disconnect_mid_stream_frees_the_blocks(server):
    before = scrape(server.url)
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(3):
            assert next(line for line in lines if line.startswith("data:"))
        busy = scrape(server.url)
        assert busy[("pagoda:num_requests_running", ())] == 1
        assert busy[("pagoda:kv_cache_usage_perc", ())] > 0
    # Closing the response dropped the connection: the request is aborted and its blocks freed,
    # long before its 900 tokens could have been generated.
    after = wait_for_metric(server.url, "pagoda:kv_cache_usage_perc", lambda v: v == 0, timeout=10)
    assert after[("pagoda:num_requests_running", ())] == 0
    abort = ("pagoda:request_success_total", (("finished_reason", "abort"),))
    assert after[abort] == before.get(abort, 0) + 1


def test_disconnect_while_waiting_for_a_whole_response_frees_the_blocks(server):
    body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    wait_for_metric(server.url, "pagoda:num_requests_running", lambda v: v == 0, timeout=10)
    assert scrape(server.url)[("pagoda:kv_cache_usage_perc", ())] == 0


def test_64_concurrent_streams_complete_with_correct_outputs(async_client_factory, client):
    topics = ["cats", "the sea", "bread", "trains", "winter", "music", "Paris", "bees"]
    prompts = [f"A short poem about {t}:" for t in topics]
    reference = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6)
    expected = [c.text for c in reference.choices]

    async def one(c, i):
        stream = await c.completions.create(
            model=MODEL, prompt=prompts[i % 8], temperature=0, max_tokens=6, stream=True
        )
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def main():
        c = async_client_factory()
        return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(main())
    assert [text for text, _ in results] == [expected[i % 8] for i in range(64)]
    assert all(finish in ("length", "stop") for _, finish in results)


def test_metrics_parse_and_move_with_requests(server, client):
    before = scrape(server.url)
    names = {name for name, _ in before}
    for family in (
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_swapped",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "iteration_tokens_total_count",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "request_prefill_time_seconds_count",
        "request_decode_time_seconds_count",
        "request_inference_time_seconds_count",
        "request_time_per_output_token_seconds_count",
        "time_per_output_token_seconds_count",
        "request_prompt_tokens_count",
        "request_generation_tokens_count",
        "cache_config_info",
    ):
        assert f"pagoda:{family}" in names, family
    text = httpx.get(f"{server.url}/metrics").text
    assert f'pagoda:num_requests_running{{model_name="{MODEL}"}}' in text

    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape(server.url)

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("pagoda:prompt_tokens_total") == out.usage.prompt_tokens
    assert moved("pagoda:generation_tokens_total") == 5
    assert moved("pagoda:request_success_total", (("finished_reason", "length"),)) == 1
    assert moved("pagoda:time_to_first_token_seconds_count") == 1
    assert moved("pagoda:request_queue_time_seconds_count") == 1
    assert moved("pagoda:e2e_request_latency_seconds_count") == 1
    assert moved("pagoda:inter_token_latency_seconds_count") == 4
    assert moved("pagoda:request_prompt_tokens_sum") == out.usage.prompt_tokens
    assert moved("pagoda:request_generation_tokens_sum") == 5
    for phase in ("prefill", "decode", "inference"):
        assert moved(f"pagoda:request_{phase}_time_seconds_count") == 1
    assert moved("pagoda:iteration_tokens_total_count") == 5  # a prefill step, then 4 decode steps
    assert moved("pagoda:iteration_tokens_total_sum") == out.usage.prompt_tokens + 4
    assert after[("pagoda:num_requests_running", ())] == 0


# ----- the engine loop dead, in-process: a real engine that has been shut down -----


def test_health_and_requests_are_503_when_the_engine_is_dead(tiny_model_dir, default_model_dir, tmp_path):
    import shutil

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from server.api import ServerSettings, build_app

    # The tiny random model, with the default model's tokenizer files so the server can start.
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(default_model_dir) / name, model / name)
    engine = AsyncEngine(EngineConfig(model=str(model), dtype="float32", device="cpu", num_gpu_blocks_override=32))
    app = build_app(engine, ServerSettings(["tiny"], str(model)))
    engine.start()
    engine.shutdown()

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            health = await c.get("/health")
            completion = await c.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3]})
            return health, completion

    health, completion = asyncio.run(main())
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    assert completion.status_code == 503 and completion.headers["retry-after"]
    assert json.loads(completion.text)["error"]["type"] == "server_error"


def test_sequences_per_request_are_bounded(client):
    # --max-sequences-per-request's default, 1024, counts prompts x n; refused before any prompt is tokenized.
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[[1, 2]] * 1025, max_tokens=1)
    assert err.value.body["param"] == "prompt" and "1025 sequences" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=["x"] * 5, n=256, max_tokens=1)
    assert err.value.body["param"] == "n" and "1280 sequences" in err.value.body["message"]


# ----- hostile load: big bodies and prompts -----


def _raw_post(url: str, head: bytes, body: bytes = b"") -> tuple[bytes, float]:
    """Send a request's head and `body` over a plain socket; the response head and body, and the seconds to it."""
    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + body)
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
            if b"\r\n\r\n" in response and response.endswith(b"}"):
                break
    return response, time.monotonic() - started


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    # The default limit, 16 MiB. A Content-Length over it is refused without waiting for a byte of the body...
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (17 * 1024 * 1024)
    )
    response, seconds = _raw_post(server.url, head)
    assert response.startswith(b"HTTP/1.1 413") and seconds < 5
    error = json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "request_too_large"
    # ... and a chunked one (no Content-Length) as soon as more than that has come, never parsed as JSON.
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    mib = b"x" * (1024 * 1024)
    response, seconds = _raw_post(server.url, head, (b"100000\r\n" + mib + b"\r\n") * 17)
    assert response.startswith(b"HTTP/1.1 413") and seconds < 10
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_too_large"


def test_a_prompt_longer_than_the_context_can_hold_is_refused_without_tokenizing(client):
    # --max-model-len 1024: at most 1024 x 64 characters. 10 MB of words would take seconds to tokenize.
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="word " * 2_000_000, max_tokens=1)
    assert err.value.body["param"] == "prompt" and "65536" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 20_000}])
    assert err.value.body["param"] == "messages"
    assert time.monotonic() - started < 5


def test_a_small_request_does_not_wait_for_a_large_prompt_to_be_tokenized(server, client):
    # 250 prompts of 60,000 characters each: within every bound (the body is ~15 MB), but seconds of tokenizing
    # (their tokens then pass the context, a 400).
    body = {"model": MODEL, "prompt": ["word " * 12_000] * 250, "max_tokens": 1}
    large = {}

    def send_large():
        started = time.monotonic()
        large["status"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code
        large["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=send_large)
    thread.start()
    time.sleep(1.0)  # its body is in; its tokenizing has begun
    started = time.monotonic()
    out = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3)
    small_seconds = time.monotonic() - started
    thread.join()
    assert out.choices[0].message.content == "The capital of"
    assert large["status"] == 400
    assert small_seconds < 3 and large["seconds"] > small_seconds + 1, (small_seconds, large)
