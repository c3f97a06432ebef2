"""What a step that carries prompt tokens costs beside a decode step, on the default model's architecture
(SmolLM2-135M, dummy weights), by how many prompts it carries: the price of prompts that arrive one at a time
instead of together (speculation puts a closed loop's sequences out of step, so their successors arrive apart).

    python3 bench/prompt_step_cost.py [--device cuda] [--batch 8] [--prompt-len 150] [--out FILE.jsonl]

Synchronous steps (async scheduling off, so each step() is one whole step): `--batch` - j sequences decoding and j
prompts of --prompt-len tokens joining in one step, for j = 1 and j = --batch (all start together: the step is
prompts only), against plain decode steps of the --batch - 1 sequences the one-prompt steps join. Prints the
median ms of each kind over --repeats (and the lower and upper quartiles), then, for the one-prompt step, a
cProfile of the host's work (own time per function) and a torch.profiler table of its kernels (on cuda).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.naming import short_commit
from bench.spec_overhead import SMOLLM2
from engine import LLM, SamplingParams


def prompt(i: int, length: int) -> list[int]:
    return [1 + (i * 7919 + j * 104729) % 49000 for j in range(length)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(SMOLLM2))
        kw = {"gpu_memory_utilization": 0.4, "dtype": "bfloat16"} if a.device == "cuda" else {"dtype": "float32"}
        llm = LLM(model_dir, load_format="dummy", device=a.device, max_num_seqs=a.batch, async_scheduling=False, **kw)
        eng = llm.engine
        long = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
        short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        ids = itertools.count()

        def timed_step() -> float:
            t0 = time.perf_counter()
            eng.step()
            if a.device == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        def joined(j: int) -> float:
            """A step of batch - j decoding sequences with j prompts joining; the joiners leave after it."""
            for _ in range(j):
                eng.add_request(f"j{next(ids)}", prompt(next(ids), a.prompt_len), short)
            seconds = timed_step()
            while len(eng.scheduler.running) > a.batch - j:  # let the joiners finish (their second token)
                eng.step()
            return seconds

        results = {}
        for j in (1, a.batch):
            # batch - j decoding sequences, started afresh for each j.
            while eng.has_unfinished_requests():
                for r in [s.request.request_id for s in eng.scheduler.running]:
                    eng.abort_request(r)
                eng.step()
            for _ in range(a.batch - j):
                eng.add_request(f"d{next(ids)}", prompt(next(ids), a.prompt_len), long)
            for _ in range(5):
                eng.step()
            joined(j)  # warm-up
            results[f"join_{j}"] = [joined(j) for _ in range(a.repeats)]
            if j == 1:
                results["decode"] = [timed_step() for _ in range(a.repeats)]
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(10):
                    joined(1)
                prof.disable()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
                host_profile = text.getvalue()
                kernels = None
                if a.device == "cuda":
                    with torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                    ) as tp:
                        for _ in range(5):
                            joined(1)
                    kernels = tp.key_averages().table(sort_by="self_device_time_total", row_limit=15)
        row = {k: round(1e3 * statistics.median(v), 3) for k, v in results.items()}
        # The quartiles too: between runs (and machines) the medians move by more than a change may (see WRITEUP).
        spread = {k: [round(1e3 * q, 3) for q in statistics.quantiles(v, n=4)[::2]] for k, v in results.items()}
        print("median ms:", row)
        print("quartiles ms:", spread)
        print(host_profile)
        if kernels:
            print(kernels)
        commit = short_commit()
        row = {"mode": "prompt-step-cost", "device": a.device, "batch": a.batch, "prompt_len": a.prompt_len,
               "median_ms": row, "quartiles_ms": spread, "commit": commit}  # fmt: skip
        if a.device == "cuda":
            row["device_name"] = torch.cuda.get_device_name()
        print("RESULT", json.dumps(row))
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
