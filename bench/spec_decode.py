r"""N-gram (or draft-model) speculative decoding against none, one process, batch 1, on a prompt-lookup-friendly
workload.

    python -m bench.spec_decode [--passages 4] [--max-tokens 128] [--k 5] [--lookup-min 2] [--lookup-max 5] \
        [--task repeat|free] [--draft PATH [--full-k]] [--device cpu] [--enforce-eager] [--out FILE]

--draft PATH speculates with that draft model instead of n-gram lookup (the default model's own directory is a
valid acceptance check: drafting for itself, every greedy draft token must be accepted); --full-k turns the
cost model off (every decoding step drafts k tokens), to time the verify rounds themselves. --enforce-eager runs
both engines (and the draft model) without CUDA graphs.

Each prompt (bench/spec_workload.py) asks the default model (SmolLM2-135M-Instruct, through its chat template) to
repeat a passage of the Jargon File (bench/data/jargon-file-4.4.7.txt) with one word changed, so most of the output
is text the prompt already holds (--task free: to tell a story the passage brings to mind instead, which asks for no
repetition, though a small model repeats itself anyway). Both engines (without and with --speculative-config) are
loaded once; each passage is
generated greedily by one then the other, alternating which goes first, after a warm-up request on each. One
JSON line per engine and passage, then a summary line: output tok/s of both and the speedup, the measured
per-token acceptance a (accepted draft tokens / (accepted + rejections)), the mean draft length k, the cost
ratio c = (mean verify step time / mean plain decode step time - 1) / k, and the speedup the model predicts,
(1 - a^(k+1)) / ((1 - a)(1 + c k)), beside the measured one. The greedy outputs are checked equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

# As in tests/conftest.py: idle OpenMP workers spin briefly, not for 300,000 rounds, before they sleep; on a
# shared 2-core machine long spinning took the cores other workers of the same op needed (decode steps 5x
# slower). libgomp reads it when torch loads it, so it is set before the import.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import torch  # noqa: E402

from bench.naming import results_path, short_commit  # noqa: E402
from bench.spec_workload import passages, prompt_of  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def timed_run(llm: LLM, prompt: list[int], max_tokens: int) -> dict:
    """Generate greedily, stepping the engine: wall time, output tokens, and each decode step's time and
    drafts (steps that ran no prompt tokens)."""
    engine: LLMEngine = llm.engine
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    steps, drafts = [], []
    accepted_log: list[tuple[int, int]] = []
    original = engine._count_speculation

    def count(plan, stats):  # (draft length, accepted) of every verified draft
        accepted_log.extend((k, m) for _, k, m in plan.accepted)
        original(plan, stats)

    engine._count_speculation = count
    start = time.perf_counter()
    out = None
    try:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            stats = engine.last_step
            if stats.num_prefill_tokens == 0 and stats.num_batched_tokens:
                steps.append(dt)
                drafts.append(stats.num_draft_tokens)
            out = next((o for o in outs if o.finished), out)
    finally:
        del engine._count_speculation
    elapsed = time.perf_counter() - start
    tokens = list(out.outputs[0].token_ids)
    return {"seconds": elapsed, "tokens": tokens, "steps": steps, "drafts": drafts, "accepted": accepted_log}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--task", choices=("repeat", "free"), default="repeat", help="see prompt_of")
    parser.add_argument("--draft", default=None, help="a draft model's directory: draft-model speculation")
    parser.add_argument("--full-k", action="store_true", help="always draft k tokens (no cost model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the draft's decode too)")
    parser.add_argument("--out", default=None, help="JSONL file (default: bench.naming's results path)")
    args = parser.parse_args(argv)
    if args.draft is None:
        name, spec = (
            "ngram",
            {
                "method": "ngram",
                "num_speculative_tokens": args.k,
                "prompt_lookup_min": args.lookup_min,
                "prompt_lookup_max": args.lookup_max,
            },
        )
    else:
        name, spec = "draft", {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    common = dict(
        device=args.device, max_model_len=2048, cpu_kv_cache_bytes=256 << 20, enforce_eager=args.enforce_eager
    )
    # Both engines live in this process, and a GPU engine's budget is a share of the whole card less what the
    # process already holds (engine/runner/kv_cache.py: blocks_that_fit_on_gpu), so on CUDA the first one
    # takes under half the card and the second the rest of 0.9 (both at the default 0.9 left the second none).
    shares = ({"gpu_memory_utilization": 0.45}, {"gpu_memory_utilization": 0.9}) if args.device != "cpu" else ({}, {})
    engines = {"plain": LLM(**common, **shares[0]), name: LLM(**common, **shares[1], speculative_config=spec)}
    if args.full_k:
        engines[name].engine.speculator.speculate_always()
    tokenizer = engines["plain"].tokenizer
    prompts = [
        tokenizer.apply_chat_template(prompt_of(p, args.task), add_generation_prompt=True)
        for p in passages(args.passages)
    ]
    for llm in engines.values():  # warm-up: first-call costs are not timed
        llm.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)

    out_path = Path(args.out or results_path(f"spec-{name}" + ("-free" if args.task == "free" else ""), args.device))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.date.today().isoformat(),
        "commit": short_commit(),
        "device": args.device if args.device != "cpu" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": os.getloadavg()[0],
        "command": "python -m bench.spec_decode " + shlex.join(sys.argv[1:] if argv is None else argv),
        "speculative_config": spec,
        "task": args.task,
        "full_k": args.full_k,
        "enforce_eager": args.enforce_eager,
        "cost_model_c": engines[name].engine.speculator.cost_ratio,
    }
    runs: dict[str, list[dict]] = {"plain": [], name: []}
    lines = []
    for i, prompt in enumerate(prompts):
        order = ("plain", name) if i % 2 == 0 else (name, "plain")
        for engine in order:
            r = timed_run(engines[engine], prompt, args.max_tokens)
            runs[engine].append(r)
            lines.append(
                {
                    **meta,
                    "engine": engine,
                    "passage": i,
                    "prompt_tokens": len(prompt),
                    "output_tokens": len(r["tokens"]),
                    "seconds": round(r["seconds"], 4),
                    "output_tok_s": round(len(r["tokens"]) / r["seconds"], 3),
                    "decode_steps": len(r["steps"]),
                }
            )
            print(json.dumps(lines[-1]), flush=True)
        assert runs["plain"][-1]["tokens"] == runs[name][-1]["tokens"], f"passage {i}: outputs differ"

    def tok_s(engine: str) -> float:
        return sum(len(r["tokens"]) for r in runs[engine]) / sum(r["seconds"] for r in runs[engine])

    verified = [(k, m) for r in runs[name] for k, m in r["accepted"]]
    accepted = sum(m for _, m in verified)
    rejections = sum(m < k for k, m in verified)
    a = accepted / max(1, accepted + rejections)
    k_mean = statistics.mean(k for k, _ in verified) if verified else 0.0
    decode = statistics.mean(t for r in runs["plain"] for t in r["steps"])
    verify = [t for r in runs[name] for t, d in zip(r["steps"], r["drafts"]) if d]
    c = (statistics.mean(verify) / decode - 1.0) / k_mean if verify else float("nan")
    # E(a, k) = (1 - a^(k+1)) / (1 - a), which is k + 1 at a = 1 (a draft model drafting for itself).
    emitted = (1 - a ** (k_mean + 1)) / (1 - a) if a < 1 else k_mean + 1
    expected = emitted / (1 + c * k_mean) if verify else float("nan")
    steps_with_drafts = len(verify) / max(1, sum(len(r["steps"]) for r in runs[name]))
    summary = {
        **meta,
        "summary": True,
        "plain_output_tok_s": round(tok_s("plain"), 3),
        f"{name}_output_tok_s": round(tok_s(name), 3),
        "speedup": round(tok_s(name) / tok_s("plain"), 3),
        "acceptance_a": round(a, 4),
        "acceptance_rate_vllm": round(accepted / max(1, sum(k for k, _ in verified)), 4),
        "mean_draft_len_k": round(k_mean, 3),
        "decode_step_s": round(decode, 5),
        "verify_step_s": round(statistics.mean(verify), 5) if verify else None,
        "cost_ratio_c": round(c, 4),
        "expected_speedup": round(expected, 3),
        "decode_steps_with_drafts": round(steps_with_drafts, 3),
        "outputs_equal": True,
    }
    lines.append(summary)
    print(json.dumps(summary), flush=True)
    with out_path.open("a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
