r"""Host time of a speculative (verify) step against a plain decode step, on the CPU, with a model whose forward
is cheap enough that the engine's own Python work dominates.

    python bench/spec_host.py [--steps 1000] [--batch 1 8] [--k 4] [--profile-steps 300] [--cpu-time] [--out FILE.md]

The model is a tiny Llama (hidden 64, 2 layers, vocab 512; dummy weights; float32) on one OpenMP thread: a decode
forward of a few hundred microseconds. Two engines serve the same workload: one without speculation, one with
n-gram speculation ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}) forced to draft the full k wherever the lookup finds a match and the room allows
(Speculator.speculate_always: no cost model). Each batch of B requests is greedy, ignore_eos, and its prompts
are a random 24-token text repeated 4 times, so the lookup matches from the first step (a random model's greedy
output soon repeats itself too, which keeps it matching).

Every `engine.step()` is timed (wall time; with --cpu-time the thread's CPU time, which leaves out the time other
processes hold the core). A speculative step is a decode-only step of B sequences that verified drafts
(synchronous: one step() call schedules, runs and completes it); a plain step is a decode-only step of B sequences
of the plain engine. Per kind: the median time per step, the median time in the model (its forward and lm_head,
timed around both), and the median of the rest, the non-model work (scheduling, proposing, inputs, sampling
rows, the sampler's tensor work, rejection, output processing). Then, with --profile-steps N > 0, a cProfile of
N speculative steps by own time, with the profiler switched off inside the model (so the table is the non-model
work alone).

What the CPU cannot show: on a GPU the verify step replays a CUDA graph (engine/runner/cuda_graphs.py) rather
than building attention metadata on the host, and the sampler's tensor work is kernel launches there.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# One OpenMP thread, and short spinning of idle workers (set before torch loads): on a shared 2-core machine a
# second thread spinning after each op of the forward would share the core with the host code being timed.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.naming import short_commit  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": 512,
    "eos_token_id": 0,
}
PERIOD, REPEATS = 24, 4  # each prompt: a random text of PERIOD tokens, REPEATS times


# What steps are timed with: wall time, or with --cpu-time this thread's CPU time, which leaves out the time other
# processes of a shared machine hold the core (the forward runs on this thread too: one OpenMP thread).
clock = time.perf_counter


def make_llm(model_dir: str, spec: dict | None) -> LLM:
    llm = LLM(
        model_dir,
        load_format="dummy",
        dtype="float32",
        device="cpu",
        max_model_len=4096,
        max_num_seqs=16,
        cpu_kv_cache_bytes=64 << 20,
        speculative_config=spec,
    )
    if spec is not None:
        llm.engine.speculator.speculate_always()
    return llm


class ModelTimer:
    """Times the model's forward and lm_head (wrapped on the instance), and switches a profiler off inside them."""

    def __init__(self, llm: LLM):
        self.seconds = 0.0
        self.profiler: cProfile.Profile | None = None
        model = llm.engine.runner.model
        for name in ("forward", "compute_logits"):
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            profiler = self.profiler
            if profiler is not None:
                profiler.disable()
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - t0
                if profiler is not None:
                    profiler.enable()

        return timed


def prompts(batch: int, round_: int) -> list[list[int]]:
    rng = np.random.default_rng(1000 * batch + round_)
    return [np.tile(rng.integers(1, TINY_LLAMA["vocab_size"], PERIOD), REPEATS).tolist() for _ in range(batch)]


def run(llm: LLM, timer: ModelTimer, batch: int, steps: int, speculative: bool, max_tokens: int, profile: bool = False):
    """Rounds of `batch` requests until `steps` steps of the kind are timed: per step (wall s, model s), the
    drafted and accepted tokens, and with `profile` the cProfile of those steps."""
    engine = llm.engine
    out: list[tuple[float, float]] = []
    drafted = accepted = 0
    stats: pstats.Stats | None = None
    round_ = 0
    while len(out) < steps:
        for i, prompt in enumerate(prompts(batch, round_)):
            engine.add_request(
                f"{round_}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            )
        round_ += 1
        while engine.has_unfinished_requests() and len(out) < steps:
            timer.seconds = 0.0
            if profile:
                # Every call is profiled into a scratch profiler, kept only if it was a step of the kind.
                timer.profiler = scratch = cProfile.Profile()
                scratch.enable()
            t0 = clock()
            engine.step()
            dt = clock() - t0
            if profile:
                scratch.disable()
                timer.profiler = None
            s = engine.last_step
            decoding = s.num_batched_tokens - s.num_draft_tokens
            if s.num_prefill_tokens or decoding != batch or bool(s.num_draft_tokens) != speculative:
                continue
            out.append((dt, timer.seconds))
            drafted += s.num_draft_tokens
            accepted += s.num_accepted_tokens
            if profile:
                stats = pstats.Stats(scratch) if stats is None else stats.add(scratch)
        for request_id in list(engine.requests):  # the round's leftovers, if `steps` were reached mid-round
            engine.abort_request(request_id)
    return out, drafted, accepted, stats


def summarize(times: list[tuple[float, float]]) -> dict:
    ms = 1e3
    return {
        "steps": len(times),
        "step_ms": round(statistics.median(t for t, _ in times) * ms, 4),
        "model_ms": round(statistics.median(m for _, m in times) * ms, 4),
        "non_model_ms": round(statistics.median(t - m for t, m in times) * ms, 4),
    }


def profile_table(stats: pstats.Stats, steps: int, limit: int = 40) -> str:
    text = io.StringIO()
    stats.stream = text
    stats.strip_dirs().sort_stats("tottime").print_stats(limit)
    return (
        f"cProfile of {steps} speculative steps (model forward and lm_head excluded), by own time:\n" + text.getvalue()
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per engine and batch size")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=600, help="per request")
    parser.add_argument("--profile-steps", type=int, default=300, help="speculative steps profiled per batch (0: none)")
    parser.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU time, not wall time")
    parser.add_argument("--out", default=None, help="append the results, as markdown, to this file")
    args = parser.parse_args(argv)
    global clock
    clock = time.thread_time if args.cpu_time else time.perf_counter
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    command = "python bench/spec_host.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    results: dict = {"command": command, "commit": short_commit(), "speculative_config": spec, "batches": {}}
    results["clock"] = "thread CPU time" if args.cpu_time else "wall time"
    profiles = []
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(TINY_LLAMA))
        engines = {"plain": make_llm(model_dir, None), "spec": make_llm(model_dir, spec)}
        timers = {name: ModelTimer(llm) for name, llm in engines.items()}
        for name, llm in engines.items():  # warm-up: first-call costs (allocator, oneDNN) are not timed
            run(llm, timers[name], 1, 20, name == "spec", 64)
        for batch in args.batch:
            # Alternating, a few blocks each: a busy spell of the shared machine lands on both kinds.
            times: dict[str, list] = {"plain": [], "spec": []}
            drafted = accepted = 0
            blocks = 4
            for _ in range(blocks):
                for name in ("plain", "spec"):
                    steps = -(-args.steps // blocks)
                    t, d, a, _ = run(engines[name], timers[name], batch, steps, name == "spec", args.max_tokens)
                    times[name] += t
                    drafted, accepted = drafted + d, accepted + a
            row = {name: summarize(t) for name, t in times.items()}
            row["spec"]["draft_tokens_per_step"] = round(drafted / len(times["spec"]), 3)
            row["spec"]["acceptance"] = round(accepted / max(1, drafted), 4)
            results["batches"][batch] = row
            print(json.dumps({"batch": batch, **row}), flush=True)
            if args.profile_steps > 0:
                llm, steps = engines["spec"], args.profile_steps
                _, _, _, stats = run(llm, timers["spec"], batch, steps, True, args.max_tokens, profile=True)
                profiles.append((batch, profile_table(stats, args.profile_steps)))
                print(f"\n==== batch {batch}: " + profiles[-1][1], flush=True)
    if args.out:
        write_markdown(args.out, results, profiles)
    return results


def write_markdown(path: str, results: dict, profiles: list[tuple[int, str]]) -> None:
    machine = platform.processor() or platform.machine()
    lines = [
        f"## {results['commit']}: `{results['command']}`",
        "",
        f"{machine}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), {results['clock']}, load average "
        f"{os.getloadavg()[0]:.2f} at the end; speculative_config {json.dumps(results['speculative_config'])}",
        "",
        "| batch | kind | steps | step ms | model ms | non-model ms | draft tokens / step | acceptance |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch, row in results["batches"].items():
        for name in ("plain", "spec"):
            r = row[name]
            extra = f"{r['draft_tokens_per_step']} | {r['acceptance']}" if name == "spec" else " | "
            lines.append(
                f"| {batch} | {name} | {r['steps']} | {r['step_ms']:.3f} | {r['model_ms']:.3f} | "
                f"{r['non_model_ms']:.3f} | {extra} |"
            )
    for batch, table in profiles:
        lines += ["", f"Batch {batch}. " + table.split("\n", 1)[0], "", "```", table.split("\n", 1)[1].strip(), "```"]
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
