"""Prefix caching and KV utilization, offline, in one call.

    python bench/prefix_cache.py --model bench/configs/llama3-8b --load-format dummy --dtype bfloat16 --device cuda

1. Shared prefix: N requests sharing a system prompt of S tokens, each with U unique tokens and
   O output tokens (all arriving at once), with prefix caching on and off: TTFT p50/p95 (first
   token time - arrival, from the engine's request times), output tok/s, prefill tokens computed.
2. KV utilization under a mixed load (input and output lengths uniform in [100, 1024], seeded):
   tokens held / token slots in allocated blocks, sampled after every step.
Writes one JSON line per measurement to --out.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from bench.naming import results_path
from engine import LLM, SamplingParams


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def shared_prefix(llm: LLM, args, vocab: int, num_requests: int) -> dict:
    rng = np.random.default_rng(num_requests)
    system = rng.integers(100, vocab, args.system_len).tolist()
    prompts = [system + rng.integers(100, vocab, args.unique_len).tolist() for _ in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine = llm.engine
    prefill_tokens = 0
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    start = time.perf_counter()
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        prefill_tokens += engine.last_step.num_prefill_tokens
    elapsed = time.perf_counter() - start
    ttft = [o.times.first_token - o.times.arrival for o in finished]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    bm = engine.block_manager
    return {
        "measure": "shared_prefix",
        "prefix_caching": bm.enable_prefix_caching,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p95_ms": percentile(ttft, 95) * 1e3,
        "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        "prefill_tokens_computed": prefill_tokens,
        "prompt_tokens": sum(len(p) for p in prompts),
        "prefix_hit_tokens": bm.prefix_hit_tokens,
    }


def kv_utilization(llm: LLM, args, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    inputs = rng.integers(100, 1025, args.mixed_requests)
    outputs = rng.integers(100, 1025, args.mixed_requests)
    engine = llm.engine
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs)):
        prompt = rng.integers(100, vocab, int(n_in)).tolist()
        engine.add_request(f"m{i}", prompt, SamplingParams(temperature=0.0, max_tokens=int(n_out), ignore_eos=True))
    samples = []
    bm = engine.block_manager
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.running
        slots = sum(len(s.block_table) for s in running) * bm.block_size
        if slots:
            samples.append(sum(s.num_computed_tokens for s in running) / slots)
    return {
        "measure": "kv_utilization",
        "mean": float(np.mean(samples)),
        "p5": percentile(samples, 5),
        "steps": len(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench/configs/llama3-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=2000)
    parser.add_argument("--unique-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--mixed-requests", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--out", default=None, help="default: $OUT or ./bench-results, <date>-<device>-<commit>-prefix-cache.jsonl"
    )
    args = parser.parse_args()
    from engine.loader import read_hf_config

    vocab = min(read_hf_config(args.model)["vocab_size"], 32000)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    rows = []
    for caching in (True, False):
        llm = LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            load_format=args.load_format,
            enable_prefix_caching=caching,
            max_model_len=args.max_model_len,
        )
        shared_prefix(llm, args, vocab, 4)  # warm-up, with another system prompt
        llm.engine.block_manager.prefix_hit_tokens = 0
        rows.append(shared_prefix(llm, args, vocab, args.num_requests))
        if caching:
            rows.append(kv_utilization(llm, args, vocab))
        del llm
        gc.collect()  # requests and sequences refer to each other: free the KV pool now
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    args.out = args.out or results_path("prefix-cache", args.device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for row in rows:
            row.update(
                model=Path(args.model).name,
                dtype=args.dtype,
                device_name=device_name,
                commit=commit,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                command="python " + " ".join(__import__("sys").argv),
            )
            print(json.dumps(row))
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
