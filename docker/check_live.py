"""The live checks docker/check.sh runs against containers, with the openai SDK and plain HTTP.

    python docker/check_live.py server URL SERVED_NAME      # a `pagoda serve` container
    python docker/check_live.py prometheus PAGODA_URL PROMETHEUS_URL

Each prints what it saw and exits non-zero on the first thing that is wrong.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families


def check_server(url: str, served_name: str) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120)
    # PAGODA_ARGS reached `pagoda serve`: the model is served under the name it gave
    models = [m.id for m in client.models.list().data]
    assert models == [served_name], models
    messages = [{"role": "user", "content": "Name three colours."}]
    reply = client.chat.completions.create(model=served_name, messages=messages, max_tokens=24, temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.usage.completion_tokens > 0, reply
    print(f"chat: {text!r} ({reply.usage.completion_tokens} tokens)")

    stream = client.chat.completions.create(
        model=served_name, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == text, (streamed, text)  # greedy: the same text either way
    print("stream: the same text")

    # structured output goes through xgrammar, installed without triton in the CPU image
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["colour", "count"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=served_name,
        messages=[{"role": "user", "content": "Give a colour and a count as JSON."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
    )
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"colour", "count"} and isinstance(value["count"], int), value
    print(f"json_schema: {value}")

    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    samples = [s for family in text_string_to_metric_families(metrics) for s in family.samples]
    finished = sum(s.value for s in samples if s.name == "pagoda:request_success_total")  # by finished_reason
    assert finished >= 3, [s for s in samples if s.name == "pagoda:request_success_total"]
    names = {s.name for s in samples if s.name.startswith("pagoda:")}
    print(f"/metrics: pagoda:request_success_total {finished:g}, {len(names)} pagoda: sample names")


def check_prometheus(pagoda_url: str, prometheus_url: str, timeout: float = 120) -> None:
    """Prometheus scrapes pagoda: its target is up and a pagoda: series has samples."""
    # traffic to count, once pagoda answers
    deadline = time.monotonic() + timeout
    while True:
        try:
            reply = httpx.post(
                f"{pagoda_url}/v1/completions",
                json={"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 4},
                timeout=60,
            )
            reply.raise_for_status()
            break
        except httpx.HTTPError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"pagoda at {pagoda_url} did not answer: {exc}") from exc
            time.sleep(2)
    print("pagoda (compose) answered a completion")

    query = 'sum(pagoda:request_success_total{job="pagoda"})'
    target, value = None, None
    while time.monotonic() < deadline:
        try:
            targets = httpx.get(f"{prometheus_url}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            target = next((t for t in targets if t["labels"]["job"] == "pagoda"), None)
            result = httpx.get(f"{prometheus_url}/api/v1/query", params={"query": query}, timeout=10).json()
            value = float(result["data"]["result"][0]["value"][1]) if result["data"]["result"] else None
        except (httpx.HTTPError, KeyError, ValueError):
            pass  # Prometheus still starting
        if target and target["health"] == "up" and value and value >= 1:
            break
        time.sleep(2)
    assert target is not None, "no target of job pagoda"
    assert target["health"] == "up", target
    print(f"target {target['scrapeUrl']}: {target['health']}")
    assert value and value >= 1, f"{query} = {value}"
    names = httpx.get(f"{prometheus_url}/api/v1/label/__name__/values", timeout=10).json()["data"]
    print(f"{query} = {value}; Prometheus has {sum(n.startswith('pagoda:') for n in names)} pagoda: series names")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"server": check_server, "prometheus": check_prometheus}[command](*args)
