"""Host cost of speculation configured but not speculating: the time of `LLMEngine.step()` with an n-gram
speculator whose steps never speculate, against an engine without one, on the CPU, step by step.

    .venv/bin/python bench/spec_overhead.py [--steps 3000] [--batch 32] [--async-scheduling] [--profile]
    python3 bench/spec_overhead.py --device cuda --shape smollm2 [--aa] [--ngram-first]   # on the GPU

Both engines serve a tiny Llama (dummy weights; a forward of a few hundred microseconds, so the engine's host work
is most of a step) and the same closed loop: `--batch` requests of 32-token prompts, greedy, ignore_eos, each
replaced by the next as it finishes (128 tokens out), so both engines run the same steps in the same order. The
speculator is issue 21's n-gram (k 4, lookup 2-5) with the default disable_by_batch_size (16), below the batch:
no step speculates, as at concurrency 32 on the H100, where fewer than 5 of ~2,000 steps did. The two engines'
steps are interleaved one by one, in ABBA order (none, ngram | ngram, none ...), so that a busy moment of the
shared host weighs on both; each pair of steps is the same step of the workload. Prints, after --warmup steps,
both engines' median and mean step time and the per-step difference (ngram - none): its median with a
distribution-free 95% interval, and its mean with the mean's, in microseconds. --aa makes the second engine one
without speculation too: what the method reads between equal engines (on the shared 2-core host, -9 to +2 us
over 3,000 steps: the resolution of one run); --ngram-first builds the n-gram engine first. --profile then runs
cProfile over a further stretch of both engines' steps and prints, per step, the own time of the functions where
the two differ most.

--device cuda runs both engines on the GPU (bfloat16, 0.4 of the card each, the second given the first's pool so
both have the same cache; async scheduling as served, unless --no-async-scheduling) and --shape smollm2 makes the
model the default model's architecture (SmolLM2-135M: 30 layers, hidden 576, vocabulary 49,152) with dummy weights:
a step of the real model's cost, as at concurrency 32 of bench/spec_h100.sh, where no step speculates either. With
async scheduling a step() launches the next forward and waits for the one before, so a step's time is the
engine's period; `diff_mean_pct` is the mean difference over none's mean step, the figure issue 21's 3% rule reads.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

# One OpenMP thread (set before torch loads): a second one, spinning after each parallel region of the forward,
# would share the cores with the host code being timed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.spec_host import TINY_LLAMA  # noqa: E402  (the same tiny Llama: a forward of a few hundred us)
from engine import LLM, SamplingParams  # after OMP_NUM_THREADS is set

# The default model's architecture (SmolLM2-135M-Instruct's config.json, as engine/default_model.py imports it).
SMOLLM2 = {
    **TINY_LLAMA,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 49152,
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
PROMPT_LEN, OUT_LEN = 32, 128


class Loop:
    """One engine's closed loop of `batch` requests; step() times one engine step (seconds)."""

    def __init__(
        self, model_dir: str, batch: int, spec: bool, async_scheduling: bool | None, device: str = "cpu", **kw
    ):
        if spec:
            kw["speculative_config"] = dict(NGRAM)
        if device == "cuda":
            kw.setdefault("gpu_memory_utilization", 0.4)
            kw["dtype"] = "bfloat16"
        else:
            kw.update(dtype="float32", cpu_kv_cache_bytes=256 << 20)
        self.llm = LLM(
            model_dir,
            load_format="dummy",
            device=device,
            max_num_seqs=batch,
            async_scheduling=async_scheduling,
            **kw,
        )
        self.eng = self.llm.engine
        self.params = SamplingParams(temperature=0.0, max_tokens=OUT_LEN, ignore_eos=True)
        self.next = 0
        self.speculated = 0  # steps that speculated (none should)
        for _ in range(batch):
            self._add()

    def _add(self) -> None:
        # The i-th request's prompt: the same on both engines; a phrase said 4 times (n-gram lookups would match).
        i = self.next
        phrase = [1 + (i * 7 + j * 13) % 500 for j in range(PROMPT_LEN // 4)]
        self.eng.add_request(f"r{i}", phrase * 4, self.params)
        self.next += 1

    def step(self) -> float:
        t0 = time.perf_counter()
        outputs = self.eng.step()
        seconds = time.perf_counter() - t0
        launched = self.eng.last_launch
        self.speculated += launched is not None and launched.speculated
        for o in outputs:
            if o.finished:
                self._add()
        return seconds


def interleaved(none: Loop, ngram: Loop, steps: int) -> tuple[list[float], list[float]]:
    """`steps` steps of each engine, alternating in ABBA order; each engine's step times."""
    a, b = [], []
    for i in range(steps):
        if i % 2 == 0:
            a.append(none.step())
            b.append(ngram.step())
        else:
            b.append(ngram.step())
            a.append(none.step())
    return a, b


def summary(none_s: list[float], ngram_s: list[float]) -> dict:
    diff = [y - x for x, y in zip(none_s, ngram_s)]
    sem = statistics.stdev(diff) / len(diff) ** 0.5
    # The median's distribution-free 95% interval (the sign test's order statistics): the mean's is wide on a shared
    # host, where a step now and then waits milliseconds for the core.
    ordered, k = sorted(diff), max(0, int((len(diff) - 1.96 * len(diff) ** 0.5) / 2))
    mean = statistics.fmean(diff)
    none_mean = statistics.fmean(none_s)
    return {
        "steps": len(diff),
        "none_median_us": round(1e6 * statistics.median(none_s), 1),
        "none_mean_us": round(1e6 * none_mean, 1),
        "ngram_median_us": round(1e6 * statistics.median(ngram_s), 1),
        "ngram_mean_us": round(1e6 * statistics.fmean(ngram_s), 1),
        "diff_median_us": round(1e6 * statistics.median(diff), 2),
        "diff_median_ci95_us": [round(1e6 * ordered[k], 2), round(1e6 * ordered[-1 - k], 2)],
        "diff_mean_us": round(1e6 * mean, 2),
        "diff_mean_ci95_us": [round(1e6 * (mean - 1.96 * sem), 2), round(1e6 * (mean + 1.96 * sem), 2)],
        # The same over none's mean step, in percent: how much slower the n-gram engine's steps are.
        "diff_mean_pct": round(100 * mean / none_mean, 3),
        "diff_mean_ci95_pct": [round(100 * (mean + d * 1.96 * sem) / none_mean, 3) for d in (-1, 1)],
    }


def profile(none: Loop, ngram: Loop, steps: int, top: int) -> None:
    """cProfile of `steps` more steps of each (interleaved); per step, the own time (us) of the functions whose
    own time differs most between the two engines."""
    profs = {"none": cProfile.Profile(), "ngram": cProfile.Profile()}
    for i in range(steps):
        for name, loop in (("none", none), ("ngram", ngram)) if i % 2 == 0 else (("ngram", ngram), ("none", none)):
            profs[name].enable()
            loop.step()
            profs[name].disable()
    own = {}
    for name, prof in profs.items():
        for (file, line, func), (_, calls, tottime, _, _) in pstats.Stats(prof).stats.items():
            key = f"{Path(file).name}:{line}({func})"
            own.setdefault(key, {"none": (0, 0.0), "ngram": (0, 0.0)})[name] = (calls, tottime)
    rows = sorted(own.items(), key=lambda kv: -abs(kv[1]["ngram"][1] - kv[1]["none"][1]))[:top]
    print(f"{'own us/step: ngram':>20} {'none':>8} {'calls/step ngram':>17} {'none':>6}  function")
    for key, v in rows:
        (cb, tb), (ca, ta) = v["ngram"], v["none"]
        print(f"{1e6 * tb / steps:20.2f} {1e6 * ta / steps:8.2f} {cb / steps:17.2f} {ca / steps:6.2f}  {key}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", default="tiny", choices=["tiny", "smollm2"], help="the model's architecture")
    # Off by default on the CPU, on (as served) on cuda; --no-async-scheduling turns it off there.
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    # A null measurement: the second engine without a speculator too (what the method reads between equal engines).
    ap.add_argument("--aa", action="store_true", help="both engines without speculation")
    # Which engine is built first (and takes the first memory): a verdict should not rest on one order.
    ap.add_argument("--ngram-first", action="store_true", help="build the n-gram engine first")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as model_dir:
        config = SMOLLM2 if a.shape == "smollm2" else TINY_LLAMA
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        asynchronous = a.async_scheduling if a.async_scheduling is not None else a.device == "cuda"
        first = Loop(model_dir, a.batch, a.ngram_first and not a.aa, asynchronous, a.device)
        # On cuda the budget of gpu_memory_utilization counts the first engine's tensors too: the second gets the
        # first's pool instead, so both have the same cache.
        kw = {"num_gpu_blocks_override": first.eng.block_manager.num_blocks} if a.device == "cuda" else {}
        second = Loop(model_dir, a.batch, not a.ngram_first and not a.aa, asynchronous, a.device, **kw)
        none, ngram = (second, first) if a.ngram_first else (first, second)
        interleaved(none, ngram, a.warmup)
        none_s, ngram_s = interleaved(none, ngram, a.steps)
        row = {"device": a.device, "shape": a.shape, "batch": a.batch, "async_scheduling": asynchronous}
        row.update(aa=a.aa, ngram_first=a.ngram_first)
        row.update(summary(none_s, ngram_s))
        row["speculative_steps"] = ngram.speculated
        print("RESULT", json.dumps(row), flush=True)
        if a.profile:
            profile(none, ngram, a.steps, a.top)


if __name__ == "__main__":
    main()
