"""Per-client rate limits through the real server: 429 with Retry-After, per key; and the buckets."""

from __future__ import annotations

import openai
import pytest

from server.ratelimit import RateLimiter
from tests.test_server import start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("server"),
        "--rate-limit-requests-per-minute",
        "2",
        "--rate-limit-tokens-per-minute",
        "600",
        "--max-model-len",
        "512",
        "--num-gpu-blocks-override",
        "64",
    )
    yield srv
    srv.stop()


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_over_the_request_limit_answers_429_per_key(server):
    alice = client(server, "alice")
    for _ in range(2):
        assert alice.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2).choices
    with pytest.raises(openai.RateLimitError) as err:
        alice.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert err.value.status_code == 429
    assert err.value.body["code"] == "rate_limit_exceeded" and err.value.body["type"] == "requests"
    retry_after = float(err.value.response.headers["Retry-After"])
    assert 1 <= retry_after <= 31  # half a minute refills one of the 2 requests
    # Another key has its own buckets.
    assert client(server, "bob").completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)


def test_over_the_token_limit_answers_429(server):
    carol = client(server, "carol")
    # Charged at admission for prompt + max_tokens (~501 of 600 tokens), whatever it then generates:
    # read one chunk and leave, so little time passes (the bucket refills 10 tokens a second).
    stream = carol.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=500, stream=True)
    next(iter(stream))
    stream.close()
    with pytest.raises(openai.RateLimitError) as err:
        carol.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=300)
    assert err.value.body["type"] == "tokens"
    assert 1 <= float(err.value.response.headers["Retry-After"]) <= 61


def test_an_embedding_request_is_charged_its_input_tokens_only(server):
    dave = client(server, "dave")
    text = "hello " * 250  # ~250 tokens: two fit in the 600-token bucket only if nothing is charged for output
    for _ in range(2):
        assert dave.embeddings.create(model="SmolLM2-135M-Instruct", input=text).usage.prompt_tokens < 300
    with pytest.raises(openai.RateLimitError):  # the third is over the request limit
        dave.embeddings.create(model="SmolLM2-135M-Instruct", input=text)


def test_buckets_refill_over_time():
    limiter = RateLimiter(requests_per_minute=60, tokens_per_minute=None)
    assert limiter.acquire("k", 1, now=0.0) == (0.0, None)
    for _ in range(59):
        limiter.acquire("k", 1, now=0.0)
    wait, kind = limiter.acquire("k", 1, now=0.0)
    assert kind == "requests" and wait == pytest.approx(1.0)
    assert limiter.acquire("k", 1, now=1.0) == (0.0, None)  # one request refilled per second
    big = RateLimiter(requests_per_minute=None, tokens_per_minute=100)
    assert big.acquire("k", 1000, now=0.0) == (0.0, None)  # larger than the bucket: slowed, never refused
    assert big.acquire("k", 10, now=0.0)[1] == "tokens"
