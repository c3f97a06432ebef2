"""The largest accepted stop list against another client's inter-token latency (issue 26, item 3).

    python bench/stop_strings_load.py --rounds 3

`pagoda serve` on the default model, then --rounds times, alternating:
  A: a streaming /v1/completions request with n=64, --background-tokens tokens, ignore_eos, no stop strings;
  B: the same request carrying the largest accepted stop list (64 strings of 256 random printable
     characters, which never match, so the matcher does its full work on every character).
Once the background request has sent its first chunk, the "other client" streams a greedy chat of
--chat-tokens tokens; its inter-token latency (ITL) is the gap between successive content events.
Reports the other client's ITL in A and B, the ratio B/A (the issue's target: at most 1.10) and the
background request's wall time. Appends one JSON line to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import signal
import socket
import statistics
import string
import sys
import time
from pathlib import Path

import openai

from bench.naming import results_path, short_commit
from bench.stream_load import start_server

MAX_STOP_STRINGS, MAX_STOP_LENGTH = 64, 256  # the server's bounds (README, "Limits and failure behaviour")


def largest_stop_list(seed: int = 0) -> list[str]:
    # No whitespace: the model's output never contains a 256-character run of random symbols.
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + string.punctuation
    return ["".join(rng.choices(alphabet, k=MAX_STOP_LENGTH)) for _ in range(MAX_STOP_STRINGS)]


def summary(gaps: list[float]) -> dict:
    ordered = sorted(gaps)
    return {
        "mean_ms": 1e3 * statistics.fmean(ordered),
        "p50_ms": 1e3 * statistics.median(ordered),
        "p90_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "n": len(ordered),
    }


async def background(client: openai.AsyncOpenAI, model: str, args, stop: list[str] | None, started: asyncio.Event):
    t0 = time.perf_counter()
    stream = await client.completions.create(
        model=model,
        prompt="Write a long story about a lighthouse keeper.",
        n=args.n,
        max_tokens=args.background_tokens,
        temperature=1.0,
        seed=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    reasons = []
    async for chunk in stream:
        started.set()
        reasons += [choice.finish_reason for choice in chunk.choices if choice.finish_reason]
    return time.perf_counter() - t0, reasons


async def other_client(client: openai.AsyncOpenAI, model: str, args) -> list[float]:
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the history of Paris."}],
        max_tokens=args.chat_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    stamps = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]


async def one_pair(client: openai.AsyncOpenAI, model: str, args, stop: list[str] | None) -> dict:
    started = asyncio.Event()
    task = asyncio.create_task(background(client, model, args, stop, started))
    await started.wait()  # the chat runs while the background request decodes
    gaps = await other_client(client, model, args)
    wall, reasons = await task
    if reasons != ["length"] * args.n:  # a stop string matched: B would not be the worst case
        raise SystemExit(f"the background request did not run to max_tokens: {reasons}")
    return {"gaps": gaps, "background_wall_s": wall}


async def measure(args, base_url: str) -> dict:
    stop_list = largest_stop_list()
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=600, max_retries=0)
    model = (await client.models.list()).data[0].id
    # Warm-up: both code paths once, so first-call costs are not measured.
    await client.completions.create(model=model, prompt="Hi", max_tokens=4, n=2, stop=stop_list)
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for round_ in range(args.rounds):
        for mode, stop in (("A", None), ("B", stop_list)):
            result = await one_pair(client, model, args, stop)
            runs[mode].append(result)
            print(round_, mode, summary(result["gaps"]), f"{result['background_wall_s']:.1f} s", flush=True)
    await client.close()
    out = {}
    for mode, results in runs.items():
        out[mode] = {
            "other_itl": summary([g for r in results for g in r["gaps"]]),
            "other_itl_mean_ms_per_run": [1e3 * statistics.fmean(r["gaps"]) for r in results],
            "background_wall_s": [r["background_wall_s"] for r in results],
        }
    out["ratio_b_over_a"] = {
        k: out["B"]["other_itl"][k] / out["A"]["other_itl"][k] for k in ("mean_ms", "p50_ms", "p90_ms")
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="A/B pairs, alternating")
    parser.add_argument("--n", type=int, default=64, help="n of the background request")
    parser.add_argument("--background-tokens", type=int, default=128)
    parser.add_argument("--chat-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--out", default=None, help="default: $OUT or ./bench-results, <date>-<device>-<commit>-stop-strings-load.jsonl"
    )
    args = parser.parse_args()
    with socket.socket() as sock:  # a free port, for stream_load's start_server
        sock.bind(("127.0.0.1", 0))
        args.port = sock.getsockname()[1]
    args.max_model_len = None

    process, base_url = start_server(args)
    try:
        record = {
            "n": args.n,
            "background_tokens": args.background_tokens,
            "chat_tokens": args.chat_tokens,
            "stop_strings": f"{MAX_STOP_STRINGS} x {MAX_STOP_LENGTH} chars in B, none in A",
            "dtype": args.dtype,
            "device": args.device,
            **asyncio.run(measure(args, base_url)),
        }
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    record.update(
        machine=platform.processor() or platform.machine(),
        cpus=len(os.sched_getaffinity(0)),
        commit=short_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join(sys.argv),
    )
    print(json.dumps(record, indent=1))
    out = Path(args.out or results_path("stop-strings-load", args.device))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
