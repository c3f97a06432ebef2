"""Host time per engine step with every request under a JSON schema, on the CPU, with a tiny model.

    .venv/bin/python bench/grammar_overlap.py [--runs 2] [--plain] [--cpu-time] [--grammar-inline] [--label NAME]
        [--out FILE.jsonl]

The workload: 256 requests, prompt lengths uniform in [100, 400] and output lengths in [100, 200]
(bench/throughput.py's ranged_workload, seed 0; ids below 10,000), greedy, ignore_eos, every request held
to bench/structured.py's SCHEMA (--plain: none), 8,192-token budget, 256 seats, async scheduling as on
CUDA. The model is a one-layer Qwen3 (hidden 32, dummy weights, float32) with the default model's
tokenizer (SmolLM2, 49,152 tokens), so grammars compile against a real vocabulary and the forward is cheap.

Per step() call: its wall time, less the work that a GPU does (the forward, the lm_head, and
ModelRunner.sample: the sampler with the mask applied and the check for non-finite logits), is the
host time of the step. Also per call: the grammar work done inline on the engine thread (masks filled
there; before the grammar thread, the matchers advanced there too), the engine thread's wait for the
grammar thread, and the grammar thread's own time. The table gives medians over the decode steps at
the full batch of 256 (`decode-256`) and over every step (`all`), in ms. On a machine shared with
other work, wall times mostly measure who else holds the cores; --cpu-time times each thread by its
own CPU time instead (the wait for the grammar thread stays wall time), which is what a GPU host with
idle cores would see on its engine thread: the grammar thread's time is off it, the wait is not.

The harness wraps methods by name and only those a tree has, so the same file times an older tree:
copy it there and run it with that tree first on the path (it puts its own parent first).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# One OpenMP thread (before torch loads): on a 2-core machine a second one would take the core the
# grammar thread and xgrammar's own thread need.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench import host_overhead  # noqa: E402
from bench.structured import SCHEMA  # noqa: E402
from bench.throughput import ranged_workload  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.default_model import default_model_dir  # noqa: E402
from engine.sampling_params import Constraint  # noqa: E402

# host_overhead.py's one-layer Qwen3 with the default model's vocabulary and special tokens.
TINY_QWEN3 = {**host_overhead.TINY_QWEN3, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}
# What the parts are timed with: wall time, or with --cpu-time each thread's own CPU time (the engine
# thread's for the step and its parts, the grammar thread's for its work), which leaves out the time
# other processes on a shared machine hold the core; waits are timed by the wall clock either way.
clock = time.perf_counter
PARTS = ("step", "host", "device", "grammar_inline", "grammar_wait", "grammar_thread")


class Timer:
    """Charges the time of wrapped methods to the step() call running (the grammar thread's too)."""

    def __init__(self, llm: LLM):
        engine = llm.engine
        self.current: dict[str, float] | None = None
        self.records: list[dict] = []
        runner = engine.runner
        self._wrap(runner.model, "forward", "device")
        self._wrap(runner.model, "compute_logits", "device")
        self._wrap(runner, "sample", "device")
        # Inline grammar work: the old tree's fill and advance, the new tree's inline fill and its
        # advance where no step waits for a mask (run() called on the engine thread).
        self._wrap(engine, "_mask", "grammar_inline")
        self._wrap(engine, "_advance_matchers", "grammar_inline")
        self._wrap(engine, "_grammar_done", "grammar_wait")
        grammars = engine._grammars
        if grammars is not None and hasattr(grammars, "start"):
            self._wrap(grammars, "run", "grammar_thread")  # start() submits self.run: this wrapper
        step = engine.step

        def timed_step():
            self.current = record = dict.fromkeys(PARTS, 0.0)
            t0 = clock()
            outputs = step()
            record["step"] = clock() - t0
            self.current = None
            last = engine.last_step
            self.records.append(
                {
                    **{k: v * 1e3 for k, v in record.items()},
                    "num_seqs": last.num_running,
                    "prefill": last.num_prefill_tokens,
                }
            )
            return outputs

        engine.step = timed_step

    def _wrap(self, obj, attr: str, part: str) -> None:
        fn = getattr(obj, attr, None)
        if fn is None:
            return

        # A wait is timed by the wall clock whatever the clock: blocked, the thread uses no CPU time.
        timer = time.perf_counter if part == "grammar_wait" else clock

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = timer()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.current is not None:
                    # Grammars.run on the engine thread itself (no step waiting for a mask) is inline work.
                    where = part if threading.current_thread() is not threading.main_thread() else "grammar_inline"
                    self.current[where if part == "grammar_thread" else part] += timer() - t0

        setattr(obj, attr, timed)


def run(llm: LLM, timer: Timer, constraint: Constraint | None) -> tuple[list[dict], float]:
    prompts, _ = ranged_workload(256, 100, 400, 49152, 0)
    _, outs = ranged_workload(256, 100, 200, 49152, 0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, constraint=constraint) for n in outs]
    llm.engine.block_manager.reset_prefix_cache()
    timer.records = []
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    assert sum(len(r.outputs[0].token_ids) for r in results) == sum(outs)
    for r in timer.records:
        r["host"] = r["step"] - r["device"]
    return timer.records, wall


def summarize(records: list[dict]) -> dict[str, dict[str, float]]:
    kinds = {
        "decode-256": [r for r in records if not r["prefill"] and r["num_seqs"] == 256],
        "all": records,
    }
    return {
        kind: {"steps": len(rows), **{p: round(statistics.median(r[p] for r in rows), 3) for p in PARTS}}
        for kind, rows in kinds.items()
        if rows
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="timed runs after one warm-up run")
    parser.add_argument("--plain", action="store_true", help="no schema")
    parser.add_argument("--label", default="", help="a name for this run in the JSON line")
    parser.add_argument("--out", default=None, help="append one JSON line of the summary here")
    parser.add_argument("--cpu-time", action="store_true", help="time with each thread's CPU time, not wall time")
    parser.add_argument(
        "--grammar-inline", action="store_true", help="grammar work on the engine thread (grammar_thread_min_rows 0)"
    )
    args = parser.parse_args()
    if args.cpu_time:
        global clock
        clock = time.thread_time
    constraint = None if args.plain else Constraint("json", json.dumps(SCHEMA))
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(TINY_QWEN3))
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (default_model_dir() / name).exists():
                shutil.copy(default_model_dir() / name, Path(model_dir) / name)
        llm = LLM(
            model_dir,
            load_format="dummy",
            dtype="float32",
            device="cpu",
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            num_gpu_blocks_override=8192,
            async_scheduling=True,
            grammar_thread_min_rows=0 if args.grammar_inline else 16,  # the engine default is 0 (inline)
        )
        if constraint is not None:
            llm.engine.compile_constraint(SamplingParams(constraint=constraint))  # the grammar thread exists now
        timer = Timer(llm)
        run(llm, timer, constraint)  # warm-up
        records, walls = [], []
        for _ in range(args.runs):
            rows, wall = run(llm, timer, constraint)
            records += rows
            walls.append(round(wall, 3))
    summary = summarize(records)
    print(f"{'median ms per step':22s}" + "".join(f"{k:>12s}" for k in summary))
    print(f"{'steps':22s}" + "".join(f"{s['steps']:12d}" for s in summary.values()))
    for part in PARTS:
        print(f"{part:22s}" + "".join(f"{s[part]:12.3f}" for s in summary.values()))
    print("run wall seconds:", walls)
    if args.out:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=False
        ).stdout.strip()
        row = {
            "label": args.label,
            "constrained": constraint is not None,
            "summary": summary,
            "run_wall_s": walls,
            "runs": args.runs,
            "clock": "thread CPU time (waits: wall)" if args.cpu_time else "wall",
            "grammar_inline": args.grammar_inline,
            "commit": commit or None,
            "tree": str(ROOT),
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": "python " + " ".join(sys.argv),
        }
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
