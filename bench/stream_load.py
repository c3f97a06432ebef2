"""Concurrent streams against `pagoda serve`: inter-token latency seen by clients vs the engine's step time.

    python bench/stream_load.py --concurrency 64 --input-len 32 --output-len 64 --dtype float32

1. The engine alone (no server): the same requests through LLMEngine.step() in this process;
   the duration of every step is the engine's own step time.
2. `pagoda serve` started as a subprocess (or --base-url for a running server), and
   --concurrency streaming /v1/completions clients, one token-id prompt each, ignore_eos.
   Each client stamps every SSE event; inter-token latency (ITL) is the gap between successive
   events of a stream. The server's /metrics before and after give its step count and its own
   view of ITL (outputs as the asyncio side receives them from the engine thread).

The difference between the client ITL and the engine step time is what the server costs:
event-loop hand-off, JSON + SSE, HTTP, and the GIL shared with the engine thread.
Appends one JSON line to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.naming import results_path


def random_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(length)] for _ in range(num)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(values: list[float]) -> dict:
    return {
        "mean_ms": 1e3 * statistics.fmean(values),
        "p50_ms": 1e3 * percentile(values, 0.5),
        "p95_ms": 1e3 * percentile(values, 0.95),
        "n": len(values),
    }


def engine_alone(args, prompts) -> dict:
    """Step times of the same workload through LLMEngine, with no server in the process."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    decode, prefill = [], []
    # The warm-up uses other prompts, so the measured prefill finds nothing in the prefix cache.
    warm_up = random_prompts(len(prompts), len(prompts[0]), seed=1)
    for round_, round_prompts in (("warm-up", warm_up), ("measured", prompts)):
        for i, prompt in enumerate(round_prompts):
            engine.add_request(f"{round_}-{i}", prompt, params)
        round_start, cpu0 = time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - t0
            if round_ == "measured":
                (prefill if engine.last_step.num_prefill_tokens else decode).append(elapsed)
    cpu_cores = (time.process_time() - cpu0) / (time.perf_counter() - round_start)
    return {
        "decode_step": summary(decode),
        "prefill_steps": len(prefill),
        "prefill_s": sum(prefill),
        "cpu_cores": cpu_cores,
    }


def scrape(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.get("le")}


async def one_stream(client: httpx.AsyncClient, model: str, prompt: list[int], args, start: asyncio.Event):
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    await start.wait()
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return t0, stamps


async def load(args, base_url: str, prompts) -> dict:
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # Warm-up: one short request (a prompt of its own), so first-call costs are not measured.
        warm_up = random_prompts(1, len(prompts[0]), seed=1)[0]
        await client.post("/v1/completions", json={"model": model, "prompt": warm_up, "max_tokens": 4})
        before = scrape(base_url)
        start = asyncio.Event()
        tasks = [asyncio.create_task(one_stream(client, model, p, args, start)) for p in prompts]
        t0, cpu0 = time.perf_counter(), time.process_time()
        start.set()
        results = await asyncio.gather(*tasks)
        elapsed, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        after = scrape(base_url)
    ttft = [stamps[0] - t for t, stamps in results]
    itl = [b - a for _, stamps in results for a, b in zip(stamps[:-1], stamps[1:], strict=True)]
    tokens = sum(len(stamps) for _, stamps in results)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = moved("pagoda:iteration_tokens_total_count")
    server_itl_n = moved("pagoda:inter_token_latency_seconds_count")
    return {
        "client_itl": summary(itl),
        "client_ttft": summary(ttft),
        "elapsed_s": elapsed,
        "output_tok_s": tokens / elapsed,
        "events": tokens,
        # CPU seconds per wall second: how much of the machine the clients and the server took.
        "client_cpu_cores": client_cpu / elapsed,
        "server_cpu_cores": moved("process_cpu_seconds_total") / elapsed,
        "server_steps": steps,
        # Wall time per engine step while the clients ran: step + the loop's own work between steps.
        "server_step_interval_ms": 1e3 * elapsed / steps if steps else None,
        "server_itl_mean_ms": 1e3 * moved("pagoda:inter_token_latency_seconds_sum") / server_itl_n
        if server_itl_n
        else None,
    }


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = args.port
    cmd = [
        str(Path(sys.executable).with_name("pagoda")),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--disable-uvicorn-access-log",
    ]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open("/tmp/stream_load_server.log", "w"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.5)
    raise SystemExit("the server did not start; see /tmp/stream_load_server.log")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--base-url", default=None, help="a running server; then no server is started")
    parser.add_argument("--skip-engine-alone", action="store_true")
    parser.add_argument(
        "--out", default=None, help="default: $OUT or ./bench-results, <date>-<device>-<commit>-stream-load.jsonl"
    )
    args = parser.parse_args()

    prompts = random_prompts(args.concurrency, args.input_len)
    record = {
        "concurrency": args.concurrency,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "dtype": args.dtype,
        "device": args.device,
    }
    if not args.skip_engine_alone:
        record["engine_alone"] = engine_alone(args, prompts)
        print(json.dumps(record["engine_alone"]), flush=True)
    process = None
    base_url = args.base_url
    if base_url is None:
        process, base_url = start_server(args)
    try:
        record["server"] = asyncio.run(load(args, base_url, prompts))
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            record["server_exit_code"] = process.wait(120)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record.update(
        machine=platform.processor() or platform.machine(),
        commit=commit,
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        command=" ".join(sys.argv),
    )
    print(json.dumps(record, indent=1))
    out = Path(args.out or results_path("stream-load", args.device))
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
