"""Host time per engine step, by component, on the W2 request mix with a tiny model on the CPU.

    .venv/bin/python bench/host_overhead.py [--runs 3] [--sync] [--cpu-time] [--profile] [--out FILE.jsonl]

W2 is 256 requests, prompt and output lengths uniform in [100, 1024] (seed 0), greedy, ignore_eos,
max_num_batched_tokens 8192, max_num_seqs 256 (bench/gpu_check.py `_workload("w2")`). The model is a
Qwen3 with W2's request shapes but a tiny body (dummy weights), so its forward is cheap; the forward,
the lm_head, the sampler's tensor work and the runner's check for non-finite logits (`sample_checks`: a
sum over the step's logits, a kernel on a GPU) are timed and subtracted, and what remains is the engine's
host work: scheduling, block allocation, prefix-cache names, inputs and attention metadata, sampler
rows, output processing. With async scheduling (the default, as on CUDA) a `step()` call launches one
step and completes another; each component is charged to the step it belongs to.

The first table gives, per kind of step (prompt steps of 8,192 tokens; pure decode steps at batch 256),
the median milliseconds of each component over all such steps of all runs; the second, per run, the
host seconds summed over all steps and the time in Python's cyclic garbage collector. --profile prints
cProfile's top functions (by own time) over one run's steps of each kind.

What it leaves out or differs in from a GPU: the host cost of the forward itself (kernel launches of
an eager step) is inside "forward"; CUDA decode steps replay a graph instead of building attention
metadata; and on the CPU, freeing the forward's big tensors (page faults, unmapping) lands in
whichever host component drops them, so compare runs alternately and by medians. On a machine shared
with other work, --cpu-time times everything with the stepping thread's CPU time instead of wall time,
so the time other processes hold the core is left out.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import functools
import gc
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# One OpenMP thread (set before torch loads): on this 2-core machine a second one, spinning after each
# parallel region of the forward, would share the cores with the host code being timed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.throughput import ranged_workload  # after ROOT is on the path
from engine import LLM, SamplingParams
from engine.runner import model_runner

# Qwen3 at a tiny size (one layer, 4 query and 2 KV heads of 8): W2's request shapes, a cheap forward.
# W2's token ids are below 10,000.
TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 64,
    "max_position_embeddings": 4096,
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_sliding_window": False,
    "vocab_size": 10240,
    "eos_token_id": 0,
}
# About what the H100's pool holds for Qwen3-0.6B at gpu_memory_utilization 0.9 (~114 KiB of KV a token).
NUM_BLOCKS = 32768
# Components that are device work on a GPU; everything else in a step is host work.
DEVICE_PARTS = ("forward", "logits", "sampler_device", "sample_checks")
PARTS = (
    "host",
    "schedule",
    "metadata",
    "runner_other",
    "sampler_prep",
    "engine_launch_other",
    "collect",
    "name_blocks",
    "engine_complete_other",
    "gc",
    "forward",
    "logits",
    "sampler_device",
    "sample_checks",
)


# What the components are timed with: wall time, or with --cpu-time the stepping thread's CPU time, which
# leaves out the time other processes on a shared machine take the core away (the forward runs on this
# thread too: one OpenMP thread).
clock = time.perf_counter


class StepTimer:
    """Wraps engine methods to charge their wall time to the step being launched or completed."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.engine = engine = llm.engine
        self.current: dict[str, float] | None = None
        self.records: list[dict] = []
        self._by_step: dict[int, dict] = {}
        runner, model, sampler = engine.runner, engine.runner.model, engine.runner.sampler
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(model_runner, "attention_metadata", "metadata")  # the runner calls it by its module's name
        self._wrap(runner, "collect", "collect")
        self._wrap(engine.block_manager, "name_full_blocks", "name_blocks")
        self._wrap(model, "forward", "forward")
        self._wrap(model, "compute_logits", "logits")
        self._wrap(sampler, "_upload", "sampler_prep")
        self._wrap(runner, "launch", "runner")
        self._wrap(runner, "sample", "runner_sample")
        runner.sampler = self._timed_call(sampler, "sampler")  # a __call__ cannot be wrapped on the instance
        launch, complete = engine._launch, engine._complete

        def timed_launch(previous=None):
            self.current = defaultdict(float)
            t0 = clock()
            step = launch(previous)
            self.current["launch"] = clock() - t0
            if step is not None:
                self._by_step[id(step)] = self.current
            self.current = None
            return step

        def timed_complete(step, *args):
            self.current = record = self._by_step.pop(id(step))
            t0 = clock()
            outputs = complete(step, *args)
            record["complete"] = clock() - t0
            self.current = None
            stats = step.stats
            batched, prefill, generated = stats.num_batched_tokens, stats.num_prefill_tokens, stats.num_generated_tokens
            self.records.append(_finish(record, batched, prefill, generated, len(step.plan.scheduled)))
            return outputs

        engine._launch, engine._complete = timed_launch, timed_complete
        self.gc_seconds = 0.0  # Python's cyclic garbage collector, in all the steps of a run
        self.gc_full = 0  # of its collections, those of the oldest generation (they walk every object)
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = clock()
            return
        seconds = clock() - self._gc_start
        self.gc_seconds += seconds
        self.gc_full += info["generation"] == 2
        self._add("gc", seconds)

    def _add(self, name: str, seconds: float) -> None:
        if self.current is not None:
            self.current[name] += seconds

    def _wrap(self, obj, attr: str, name: str) -> None:
        setattr(obj, attr, self._timed_call(getattr(obj, attr), name))

    def _timed_call(self, fn, name: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self._add(name, clock() - t0)

        return timed


def _finish(r: dict, batched: int, prefill: int, generated: int, num_seqs: int) -> dict:
    """Milliseconds per component of one step, the host's share derived."""
    r = defaultdict(float, r)
    sampler_device = r["sampler"] - r["sampler_prep"]
    # ModelRunner.sample beyond the sampler: the check for non-finite logits (a sum over every row's
    # logits) and the host copies' set-up: tensor work, on a GPU enqueued behind the sampler.
    sample_checks = r["runner_sample"] - r["sampler"]
    out = {
        "schedule": r["schedule"],
        "metadata": r["metadata"],
        "sampler_prep": r["sampler_prep"],
        "runner_other": r["runner"] - r["metadata"] - r["forward"] - r["logits"] - r["runner_sample"],
        "engine_launch_other": r["launch"] - r["schedule"] - r["runner"],
        "collect": r["collect"],
        "name_blocks": r["name_blocks"],
        "engine_complete_other": r["complete"] - r["collect"] - r["name_blocks"],
        "forward": r["forward"],
        "logits": r["logits"],
        "sampler_device": sampler_device,
        "sample_checks": sample_checks,
        "gc": r["gc"],
    }
    out["host"] = r["launch"] + r["complete"] - r["forward"] - r["logits"] - sampler_device - sample_checks
    row = {k: v * 1e3 for k, v in out.items()}
    row.update(batched=batched, prefill=prefill, generated=generated, num_seqs=num_seqs)
    return row


def kind_of(row: dict) -> str | None:
    if row["prefill"] and row["batched"] == 8192:
        return "prompt-8192"
    if not row["prefill"] and row["batched"] == 256:
        return "decode-256"
    return None


def make_llm(model_dir: str, async_scheduling: bool) -> LLM:
    return LLM(
        model_dir,
        load_format="dummy",
        dtype="float32",
        device="cpu",
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        num_gpu_blocks_override=NUM_BLOCKS,
        async_scheduling=async_scheduling,
    )


def run_w2(timer: StepTimer, run: int, profile_kinds: dict | None = None) -> tuple[list[dict], dict]:
    """One W2 run to the end: each completed step's component times (ms), and the run's totals. With
    `profile_kinds` ({kind: [cProfile.Profile]}), every step() call that completes a step of that kind
    is profiled."""
    engine = timer.engine
    engine.block_manager.reset_prefix_cache()  # every run starts cold, as on the GPU
    prompts, outs = ranged_workload(256, 100, 1024, 151936, 0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    timer.records = []
    timer.gc_seconds, timer.gc_full = 0.0, 0
    step = engine.step
    if profile_kinds is not None:

        def profiled_step():
            # The kind of the step a call completes is known only afterwards: profile every call and
            # keep it under that kind.
            profiler = cProfile.Profile()
            count = len(timer.records)
            profiler.enable()
            outputs = step()
            profiler.disable()
            if len(timer.records) > count and (kind := kind_of(timer.records[-1])) in profile_kinds:
                profile_kinds[kind].append(profiler)
            return outputs

        engine.step = profiled_step
    start = time.perf_counter()
    try:
        timer.llm.generate(prompts, params, use_tqdm=False)  # as bench/gpu_check.py's workload mode does
    finally:
        if profile_kinds is not None:
            del engine.step  # back to the class's method
    totals = {
        "steps": len(timer.records),
        "wall_s": time.perf_counter() - start,
        "host_s": sum(r["host"] for r in timer.records) / 1e3,
        "gc_ms": timer.gc_seconds * 1e3,
        "gc_full": timer.gc_full,
    }
    return timer.records, totals


def summarize(records: list[dict]) -> dict[str, dict[str, float]]:
    by_kind: dict[str, list[dict]] = defaultdict(list)
    for row in records:
        if (kind := kind_of(row)) is not None:
            by_kind[kind].append(row)
    return {
        kind: {"steps": len(rows), **{p: statistics.median(r[p] for r in rows) for p in PARTS}}
        for kind, rows in sorted(by_kind.items())
    }


def print_tables(summary: dict[str, dict[str, float]], totals: list[dict]) -> None:
    kinds = list(summary)
    print(f"{'median ms per step':24s}" + "".join(f"{k:>14s}" for k in kinds))
    print(f"{'steps':24s}" + "".join(f"{summary[k]['steps']:14d}" for k in kinds))
    for part in PARTS:
        label = part + (" (device)" if part in DEVICE_PARTS else "")
        print(f"{label:24s}" + "".join(f"{summary[k][part]:14.2f}" for k in kinds))
    print(f"\n{'whole runs':24s}{'steps':>8s}{'wall s':>9s}{'host s':>9s}{'gc ms':>9s}{'full gc':>9s}")
    for i, t in enumerate(totals):
        print(
            f"{'run ' + str(i):24s}{t['steps']:8d}{t['wall_s']:9.2f}{t['host_s']:9.2f}"
            f"{t['gc_ms']:9.1f}{t['gc_full']:9d}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="W2 runs after one warm-up run")
    parser.add_argument("--sync", action="store_true", help="no async scheduling (on by default, as on CUDA)")
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions per kind of step")
    parser.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU time, not wall time")
    parser.add_argument("--label", default="", help="a name for this run in the JSON line")
    parser.add_argument("--out", default=None, help="append one JSON line of the summary here")
    args = parser.parse_args()
    if args.cpu_time:
        global clock
        clock = time.thread_time

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(TINY_QWEN3))
        timer = StepTimer(make_llm(model_dir, not args.sync))
        run_w2(timer, -1)  # warm-up: oneDNN and allocator set-up
        records: list[dict] = []
        totals: list[dict] = []
        for run in range(args.runs):
            run_records, run_totals = run_w2(timer, run)
            records += run_records
            totals.append(run_totals)
        summary = summarize(records)
        print_tables(summary, totals)
        if args.profile:
            profiles: dict[str, list] = {"prompt-8192": [], "decode-256": []}
            run_w2(timer, args.runs, profiles)
            for kind, profilers in profiles.items():
                text = io.StringIO()
                stats = pstats.Stats(profilers[0], stream=text)
                for p in profilers[1:]:
                    stats.add(p)
                print(f"\n==== {kind}: {len(profilers)} step() calls, top functions by own time")
                stats.sort_stats("tottime").print_stats(25)
                print(text.getvalue())
    if args.out:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
        ).stdout.strip()
        row = {
            "label": args.label,
            "summary": summary,
            "totals": totals,
            "runs": args.runs,
            "async_scheduling": not args.sync,
            "clock": "thread CPU time" if args.cpu_time else "wall",
            "commit": commit,
            "machine": platform.processor() or platform.machine(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python " + " ".join(sys.argv),
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
