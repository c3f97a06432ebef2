"""Per-client rate limits through the real server: 429 with Retry-After, per API key when the server has keys,
per address without them (X-Forwarded-For only from --forwarded-allow-ips); and the buckets."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from server.ratelimit import _PRUNE_EVERY, RateLimiter
from tests.test_server import ServerProcess, start_server

KEYS = ("alice", "bob", "carol", "dave")
RATE_FLAGS = ("--max-model-len", "512", "--num-gpu-blocks-override", "64", "--rate-limit-requests-per-minute", "2")


def wait_for_log(server: ServerProcess, text: str, timeout: float = 10.0) -> str:
    """The last log line holding `text`, once there is one."""
    deadline = time.monotonic() + timeout
    while not (lines := [line for line in server.log().splitlines() if text in line]):
        assert time.monotonic() < deadline, f"no log line holds {text!r}"
        time.sleep(0.1)
    return lines[-1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(
        tmp_path_factory.mktemp("server"),
        *(flag for key in KEYS for flag in ("--api-key", key)),
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
    # Without --forwarded-allow-ips a client's X-Forwarded-For is not believed: the access log shows its address.
    r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer bob", "X-Forwarded-For": "192.0.2.9"})
    assert r.status_code == 200
    line = wait_for_log(server, '"GET /v1/models HTTP/1.1" 200')
    assert "127.0.0.1" in line and "192.0.2.9" not in line


def test_without_api_keys_clients_are_told_apart_by_address_not_by_authorization(tmp_path):
    # 127.0.0.1 is a trusted proxy here: a request it forwards for another address has that address's budget.
    srv = start_server(tmp_path, *RATE_FLAGS, "--forwarded-allow-ips", "127.0.0.1")
    try:

        def complete(authorization: str, forwarded_for: str | None = None) -> httpx.Response:
            headers = {"Authorization": authorization, **({"X-Forwarded-For": forwarded_for} if forwarded_for else {})}
            body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 1}
            return httpx.post(f"{srv.url}/v1/completions", json=body, headers=headers, timeout=60)

        # Five made-up keys from one address share its budget of 2 a minute: a new header buys nothing.
        codes = [complete(f"Bearer a{i}").status_code for i in range(1, 6)]
        assert codes == [200, 200, 429, 429, 429]
        assert complete("Bearer a6", forwarded_for="198.51.100.7").status_code == 200
        assert complete("Bearer a7", forwarded_for="198.51.100.7").status_code == 200
        assert complete("Bearer a8", forwarded_for="198.51.100.7").status_code == 429
        assert complete("", forwarded_for="198.51.100.8").status_code == 200
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


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


def test_refilled_buckets_are_forgotten():
    limiter = RateLimiter(requests_per_minute=60, tokens_per_minute=None)
    for i in range(_PRUNE_EVERY - 1):
        limiter.acquire(f"address {i}", 1, now=0.0)
    assert len(limiter._buckets) == _PRUNE_EVERY - 1
    limiter.acquire("address x", 1, now=1.0)  # a second later every earlier bucket is full again
    assert list(limiter._buckets) == [("address x", "requests")]
