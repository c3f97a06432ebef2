"""Offline closed-loop trace of the speculative step decision: at each concurrency, the same prompts (the
`repeat` workload, chat template, greedy, ignore_eos) through an engine without speculation and one with n-gram
(k 4, lookup 2-5), each request replaced by the next as it finishes (as the online benchmark's clients do);
prints tok/s of both, the ratio, the step pattern (S speculative, p pipelined, . synchronous plain), the
speculator's StepTimes per bucket (decode, spec) in ms, and its guard per bucket (tokens per second with
speculation on and held off, steps counted in each).

    PYTHONPATH=. python bench/spec_steps.py MODEL_DIR [--device cuda] [--concurrency 1,8,32]
    PYTHONPATH=. python bench/spec_steps.py MODEL_DIR --device cpu --async-scheduling --concurrency 8
    PYTHONPATH=. python bench/spec_steps.py MODEL_DIR --paired [--chunks 8] [--concurrency 8,32]

Unpaired (the default), each round runs one engine and then the other, each alone in the process: the two runs'
tok/s differ by the drift between them as well (on the H100, ratios of 0.87-1.03 over rounds at concurrency 8).
--paired keeps both engines alive in one process (on cuda the first takes 0.4 of the GPU, the second a pool of
the same size) and splits the workload in --chunks chunks of consecutive prompts; each chunk runs through both
engines, alternately in ABBA order (none, ngram | ngram, none | none, ngram ...), so each chunk gives a ratio of
ngram's tok/s to none's on the same prompts taken moments apart. One RESULT line per concurrency and round:
`chunks` (each chunk's order, seconds of both and ratio), `ratio_of_sums` (the verdict: none's summed seconds over
ngram's), the chunks' `ratio_mean`, `ratio_sd`, `ratio_min`, `ratio_max` and `ratio_ci95` (Student's t
interval of the mean), then `none` and `ngram` with the unpaired run's fields over all chunks; then a PAIRED line
with the same figures in words. Issue 21's rule
(speculation never more than 3% slower than none) fails where ratio_ci95 lies below 0.97, and holds where it lies
above. A chunk should hold a few waves of requests (conc x 2 or more; with ignore_eos the requests of a wave end
together).

On the lent H100 (the default model: bench/spec_h100.sh's calls 3-4, `stage 1`, then `stage 2 && install`, leave
it in /root/spec_model with the packages it needs in /root/spec_site; a warm machine keeps both), one call:

    run(command="for c in 8 32 1; do timeout 190 env PYTHONPATH=.:/root/spec_site python3 bench/spec_steps.py
        /root/spec_model/SmolLM2-135M-Instruct --paired --concurrency $c --chunks 16 --requests-per-concurrency 32
        --min-requests 48 --rounds 1 2>&1 | tee $OUT/spec_paired_$c.txt | grep -E 'PAIRED|Error|error'; done")

one process per concurrency: in one process the engines of a concurrency are not all freed before the next
one's are made, and on the H100 the third found no memory for its KV cache. Then again (another round, on the
same warm machine) where a 95% interval still straddles 0.97. 16 chunks of 16
requests at concurrency 8 (two waves a chunk), of 64 at 32, of 3 at 1. At the online figures (best configuration
~5,300 / ~11,000 / ~900 tok/s at 8 / 32 / 1, 2026-11-26-h100-3c3485c-spec-online) the timed chunks take ~6 / ~12
/ ~7 s an engine, besides two engine starts (load, graph capture) per concurrency.

periods_ms: every step of the n-gram engine's timed loop (warm-up excluded) by kind: S speculative / p pipelined
/ . synchronous plain, then d decode-only / P with prompt tokens, then >p / >. for how the next step launched
(n, mean ms, total s): "SP>." against "pP>p" is what a prompt step costs in speculative runs against plain ones;
"pd>." (drains) and ".d>p" (refills) are the switch's edges.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from bench.spec_workload import line_passages, prompt_of
from engine import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
# Student's t at 97.5% for 1..30 degrees of freedom (the 95% interval of a mean over few chunks); beyond, 2.0.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)
_T975 += (2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def make_llm(model: str, device: str, conc: int, spec: bool, async_scheduling: bool | None = None, **kw) -> LLM:
    """An engine for the trace: without speculation, or with n-gram (k 4, lookup 2-5). On cuda it takes 0.4 of the
    GPU unless `kw` says otherwise (two engines share the card: one after the other, or both alive in --paired)."""
    kw = dict(device=device, max_num_seqs=max(conc, 1), async_scheduling=async_scheduling, **kw)
    if device == "cuda":
        kw.setdefault("gpu_memory_utilization", 0.4)
    if spec:
        kw["speculative_config"] = dict(NGRAM)
    return LLM(model, **kw)


def chat_prompts(llm: LLM, count: int) -> list[list[int]]:
    """The `repeat` workload's first `count` prompts, chat template applied, as token ids."""
    tok = llm.tokenizer
    hf = getattr(tok, "hf", None) or getattr(tok, "tokenizer", None) or tok
    prompts = []
    for p in line_passages(count, chars=400):
        text = hf.apply_chat_template(prompt_of(p), add_generation_prompt=True, tokenize=False)
        prompts.append(hf(text)["input_ids"])
    return prompts


class Trace:
    """One engine's closed loops (greedy, ignore_eos, `out_len` tokens a request), with what the existing output
    reports summed over every timed loop: tokens, seconds, the step pattern and, with a speculator, each step's
    period by kind."""

    def __init__(self, llm: LLM, conc: int, out_len: int):
        self.llm, self.eng = llm, llm.engine
        eng = llm.engine
        self.conc, self.out_len = conc, out_len
        self.params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        self.spec = eng.speculator is not None
        self.timing = False  # the warm-up's steps are left out of the periods
        self.elapsed, self.done, self.loops = 0.0, 0, 0
        self.pattern: list[str] = []
        self.periods: dict[str, list[float]] = {}
        self._ids = 0
        if self.spec:
            # Every step's period (launch to next launch) by kind: S speculative / p pipelined / . synchronous plain,
            # d decode-only / P with prompt tokens, then >p or >. for how the next step was launched.
            timed = eng._time_last_step

            def time_last_step(now: float, overlapped: bool) -> None:
                step = eng.last_launch
                if step is not None and self.timing:
                    kind = "S" if step.speculated else ("p" if step.overlapped else ".")
                    kind += ("d" if step.decode_only else "P") + (">p" if overlapped else ">.")
                    self.periods.setdefault(kind, []).append(now - step.started)
                timed(now, overlapped)

            eng._time_last_step = time_last_step

    def _add(self, prompt: list[int]) -> None:
        self.eng.add_request(f"r{self._ids}", prompt, self.params)
        self._ids += 1

    def warm_up(self, prompts: list[list[int]]) -> None:
        for p in prompts:
            self._add(p)
        while self.eng.has_unfinished_requests():
            self.eng.step()

    def closed_loop(self, prompts: list[list[int]]) -> float:
        """`prompts` at concurrency `conc`, each finished request replaced by the next (as the online benchmark's
        clients do); its seconds, also added to the totals."""
        eng, nxt, done = self.eng, min(self.conc, len(prompts)), 0
        for p in prompts[:nxt]:
            self._add(p)
        self.timing = True
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done += 1
                    if nxt < len(prompts):
                        self._add(prompts[nxt])
                        nxt += 1
            ll = eng.last_launch
            if ll is not None:
                self.pattern.append("S" if ll.speculated else ("p" if ll.overlapped else "."))
        seconds = time.perf_counter() - t0
        self.timing = False
        self.elapsed, self.done, self.loops = self.elapsed + seconds, self.done + done, self.loops + 1
        return seconds

    def row(self) -> dict:
        """The summary over every timed loop (the fields of the unpaired run)."""
        row = {
            "concurrency": self.conc,
            "spec": self.spec,
            "tok_s": round(self.done * self.out_len / self.elapsed, 1),
            "elapsed": round(self.elapsed, 3),
        }
        sp = self.eng.speculator
        if sp is None:
            return row
        pat = "".join(self.pattern)
        row["steps"], row["spec_steps"] = len(pat), pat.count("S")
        row["switches"] = sum((a == "S") != (b == "S") for a, b in zip(pat, pat[1:]))
        row["acceptance"] = round(sp.overall.rate, 3)
        for name in ("decode", "spec"):
            row[name + "_ms"] = {
                k: (round(v.seconds * 1e3, 3), v.count, round(v.drafted, 1)) for k, v in getattr(sp.times, name).items()
            }
        # The guard per bucket: tokens per second with speculation on and held off, and steps counted in each.
        row["guard"] = {
            k: {
                "on_tok_s": round(g.on.rate),
                "on_steps": g.on.count,
                "off_tok_s": round(g.off.rate),
                "off_steps": g.off.count,
            }
            for k, g in sp.guards.items()
        }
        row["periods_ms"] = {
            k: {"n": len(v), "mean": round(1e3 * sum(v) / len(v), 3), "total": round(sum(v), 3)}
            for k, v in sorted(self.periods.items())
        }
        row["pattern_head"] = pat[:400]
        return row


def run(
    model: str, device: str, conc: int, spec: bool, requests: int, out_len: int, async_scheduling: bool | None = None
) -> dict:
    """One engine alone: 8 warm-up requests, then `requests` in one closed loop."""
    llm = make_llm(model, device, conc, spec, async_scheduling)
    prompts = chat_prompts(llm, requests + 8)
    trace = Trace(llm, conc, out_len)
    trace.warm_up(prompts[requests:])
    trace.closed_loop(prompts[:requests])
    return trace.row()


def run_freed(*args) -> dict:
    """run, then the engine's memory given back (its reference cycles collected) before the next one starts."""
    row = run(*args)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def paired(none: Trace, ngram: Trace, prompts: list[list[int]], chunks: int) -> dict:
    """The same closed-loop workload through both engines, alive together, in `chunks` chunks of consecutive
    prompts, each chunk through both engines in ABBA order (none, ngram | ngram, none | none, ngram ...) so that
    a drift over time (clocks, temperature, a busy host) weighs on both alike. Each chunk gives a paired ratio
    (none's seconds / ngram's on the same prompts: ngram's tok/s over none's); the verdict is the ratio of the
    summed seconds, with the chunks' spread and the 95% interval of their mean beside it."""
    size = len(prompts) // chunks
    if size < 1:
        raise ValueError(f"{len(prompts)} prompts cannot make {chunks} chunks")
    rows = []
    for i in range(chunks):
        chunk = prompts[i * size : (i + 1) * size]
        order = (none, ngram) if i % 2 == 0 else (ngram, none)
        seconds = {id(t): t.closed_loop(chunk) for t in order}
        none_s, ngram_s = seconds[id(none)], seconds[id(ngram)]
        rows.append(
            {
                "chunk": i,
                "order": "none,ngram" if i % 2 == 0 else "ngram,none",
                "requests": len(chunk),
                "none_s": none_s,
                "ngram_s": ngram_s,
                "ratio": none_s / ngram_s,
            }
        )
    ratios = [r["ratio"] for r in rows]
    mean = statistics.fmean(ratios)
    sd = statistics.stdev(ratios) if chunks > 1 else 0.0
    half = (_T975[chunks - 2] if chunks - 1 <= len(_T975) else 2.0) * sd / chunks**0.5 if chunks > 1 else 0.0
    ngram_row = ngram.row()
    ngram_row["ratio_vs_none"] = round(none.elapsed / ngram.elapsed, 3)
    return {
        "concurrency": none.conc,
        "chunks": rows,
        "ratio_of_sums": sum(r["none_s"] for r in rows) / sum(r["ngram_s"] for r in rows),
        "ratio_mean": mean,
        "ratio_sd": sd,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_ci95": [mean - half, mean + half],
        "none": none.row(),
        "ngram": ngram_row,
    }


def run_paired(
    model: str,
    device: str,
    conc: int,
    requests: int,
    out_len: int,
    chunks: int,
    async_scheduling: bool | None,
    aa: bool = False,
) -> dict:
    """paired() on the two engines built here (both 8 warm-up requests first); freed before it returns. `aa`: the
    second engine without speculation too (an A/A run: what the harness makes of two equal engines)."""
    none = Trace(make_llm(model, device, conc, False, async_scheduling), conc, out_len)
    kw = {}
    if device == "cuda":
        # The budget of gpu_memory_utilization counts every tensor of this process, the first engine's too: the
        # second gets the first's pool instead (0.4 of the card again), so both have the same cache.
        kw["num_gpu_blocks_override"] = none.eng.block_manager.num_blocks
    ngram = Trace(make_llm(model, device, conc, not aa, async_scheduling, **kw), conc, out_len)
    prompts = chat_prompts(none.llm, requests + 8)
    for t in (none, ngram):
        t.warm_up(prompts[requests:])
    result = paired(none, ngram, prompts[:requests], chunks)
    del none, ngram
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests-per-concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=24)
    # On the CPU async scheduling is off by default; on, it pipelines as on a GPU (the same cores do both).
    ap.add_argument("--async-scheduling", action="store_true", default=None)
    ap.add_argument("--paired", action="store_true", help="both engines alive, the workload in ABBA chunks")
    ap.add_argument("--chunks", type=int, default=8, help="with --paired: chunks of the workload")
    ap.add_argument("--aa", action="store_true", help="with --paired: the second engine without speculation too")
    a = ap.parse_args()
    for conc in [int(c) for c in a.concurrency.split(",")]:
        n = max(a.min_requests, a.requests_per_concurrency * conc)
        for r in range(a.rounds):
            if a.paired:
                result = run_paired(a.model, a.device, conc, n, a.output_len, a.chunks, a.async_scheduling, a.aa)
                print("RESULT", json.dumps({"round": r, "aa": a.aa, **result}), flush=True)
                lo, hi = result["ratio_ci95"]
                second = result["ngram"]
                print(
                    f"PAIRED concurrency {conc} round {r}: {'none (A/A)' if a.aa else 'ngram'}/none tok/s "
                    f"{result['ratio_of_sums']:.4f} (chunks: mean {result['ratio_mean']:.4f}, sd "
                    f"{result['ratio_sd']:.4f}, {result['ratio_min']:.4f}-{result['ratio_max']:.4f}, 95% [{lo:.4f}, "
                    f"{hi:.4f}]); speculative steps {second.get('spec_steps', 0)} of {second.get('steps', '-')}",
                    flush=True,
                )
                continue
            none = run_freed(a.model, a.device, conc, False, n, a.output_len, a.async_scheduling)
            ngram = run_freed(a.model, a.device, conc, True, n, a.output_len, a.async_scheduling)
            ngram["ratio_vs_none"] = round(ngram["tok_s"] / none["tok_s"], 3)
            print("RESULT", json.dumps({"round": r, "none": none, "ngram": ngram}), flush=True)


if __name__ == "__main__":
    main()
