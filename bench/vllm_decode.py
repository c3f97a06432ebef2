"""Decode tok/s of Llama-3-8B (dummy weights) in bf16 and W4A16 (GPTQ 4-bit, group 128, symmetric, no act-order):
pagoda beside vLLM 0.26 on the same checkpoint layout, measured the same way (issue 22).

    python bench/vllm_decode.py all [--engines pagoda vllm] [--out FILE] [--timeout 300]  # one process each
    python bench/vllm_decode.py one --engine vllm --kind w4a16-g128 --model DIR [--out FILE]
    python bench/vllm_decode.py summary [--out FILE]                     # the table of --out's rows

Both engines load the same directory: bench/configs/llama3-8b, and for W4A16 a copy whose config.json carries
the GPTQ quantization_config of bench/quant_checkpoints.py's gptq-w4g128 recipe (bench/gpu_check.py
_quant_model_dir, the one its quant-decode mode loads). vLLM 0.26 maps quant_method "gptq" onto its AutoGPTQ
method and picks the first mixed-precision kernel that can take the layer: on an H100 (sm90) that is Machete
(CUTLASS), not Marlin. Kinds: bf16, w4a16-g128 (each engine's own choice of kernel; vLLM logs its
"Using ...LinearKernel for AutoGPTQLinearMethod") and, for vLLM only, w4a16-g128-marlin (Machete, AllSpark and
CutlassW4A8 turned off with VLLM_DISABLED_KERNELS, so Marlin takes it).

The measure, alike for both (vLLM's engine steps run in another process, so a step cannot be timed from
here): a batch of 1 or 16 prompts of 128 random ids, greedy, ignore_eos, generated to SHORT and to LONG
tokens, the two runs interleaved REPEATS times after a warm-up; a decode step's time is the median over the
repeats of (time LONG - time SHORT) / (LONG - SHORT): prompt processing, the first token and the fixed costs
of a generate() call cancel out, and the steps in between run at contexts 128 + SHORT to 128 + LONG. tok/s =
batch / step time. For pagoda, the row also has the median step time as gpu_check.py quant-decode measures it
(engine.step() timed one by one), as a check of the difference method.

Rows (JSON lines, printed with RESULT and appended to --out, default $OUT/vllm_decode.jsonl): engine, kind,
batch, step_ms, tok_s, step_ms per repeat, the engine's version, vs_bf16 (the same engine's bf16 step time over
this kind's, when its bf16 row is in --out from this commit), and for pagoda step_ms_steps. A process that
fails or runs past --timeout leaves a row with its error and the end of its output.

On the GPU machine, vLLM 0.26 staged by ../shared/peers/vllm_h100.sh (stage 1, stage 2 && install: its site in
$VB_SITE, default /root/vb_site): `all` runs vLLM's processes with that site first on their path and pagoda's
with the repository only, as bench/gpu_check.sh does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_check import QUANT_KINDS, _commit, _fixed_prompts, _llm, _quant_model_dir, emit  # noqa: E402

BATCHES = (1, 16)
PROMPT_LEN = 128
SHORT, LONG = 16, 80
REPEATS = 5
# kind -> pagoda's (--quantization, recipe) as in gpu_check.py's QUANT_KINDS; vLLM takes the same directory.
KINDS = {"bf16": QUANT_KINDS["bf16"], "w4a16-g128": QUANT_KINDS["w4a16-g128"]}
# The lines of a run's output kept beside its rows: how the engine loaded and quantized the checkpoint.
LOADING_LINE = re.compile(r"LinearKernel|quantiz|gptq|marlin|machete|weights took|model loading took|memory", re.I)
# vLLM only: its Marlin kernel, the others that rank above it on an H100 turned off.
MARLIN_ONLY = "CutlassW4A8LinearKernel,MacheteLinearKernel,AllSparkLinearKernel"
RUNS = [("pagoda", "bf16"), ("pagoda", "w4a16-g128"), ("vllm", "bf16"), ("vllm", "w4a16-g128")]
RUNS.append(("vllm", "w4a16-g128-marlin"))


def difference_step_times(generate, prompts: list, short: int, long: int, repeats: int) -> list[float]:
    """Seconds per decode step, one per repeat: (time of generate(prompts, long) - time of generate(prompts,
    short)) / (long - short). generate(prompts, n) runs the batch to n tokens each and returns how many tokens
    it produced in all."""
    generate(prompts, short)  # warm-up: compiles, graphs and caches as later runs find them
    steps = []
    for _ in range(repeats):
        times = {}
        for n in (short, long):
            t0 = time.perf_counter()
            produced = generate(prompts, n)
            times[n] = time.perf_counter() - t0
            if produced != len(prompts) * n:  # a run that stopped early would time fewer steps than it claims
                raise RuntimeError(f"{produced} tokens produced, not {len(prompts)} x {n}")
        steps.append((times[long] - times[short]) / (long - short))
    return steps


def run_pagoda(model: str, kind: str, args: argparse.Namespace) -> None:
    from bench.gpu_check import _step_times
    from engine import SamplingParams

    quantization, _ = KINDS[kind]
    llm = _llm(model, "triton", False, quantization=quantization)

    def generate(prompts: list[list[int]], n: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return sum(len(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False))

    for batch in BATCHES:
        prompts = _fixed_prompts(batch, PROMPT_LEN, seed=batch)
        steps = difference_step_times(generate, prompts, args.short, args.long, args.repeats)
        by_step = _step_times(llm, prompts, max_tokens=48, timed_steps=32)  # gpu_check.py quant-decode's measure
        emit_row(args, "pagoda", kind, batch, steps, {"step_ms_steps": statistics.median(by_step) * 1e3})


def run_vllm(model: str, kind: str, args: argparse.Namespace) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    # No tokenizer in the config directory: prompts are token ids and outputs stay ids.
    llm = LLM(
        model=model,
        load_format="dummy",
        dtype="bfloat16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=1024,
        gpu_memory_utilization=0.9,
    )

    def generate(prompts: list[dict], n: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        return sum(len(r.outputs[0].token_ids) for r in llm.generate(prompts, params, use_tqdm=False))

    for batch in BATCHES:
        prompts = [{"prompt_token_ids": p} for p in _fixed_prompts(batch, PROMPT_LEN, seed=batch)]
        steps = difference_step_times(generate, prompts, args.short, args.long, args.repeats)
        extra = {"vllm_version": vllm.__version__, "vllm_quantization": _vllm_quantization(llm)}
        if kind.endswith("-marlin"):
            extra["vllm_disabled_kernels"] = os.environ.get("VLLM_DISABLED_KERNELS")
        emit_row(args, "vllm", kind, batch, steps, extra)


def _vllm_quantization(llm) -> str | None:
    """The quantization method vLLM's model config settled on (e.g. "gptq_marlin"; None for bf16), or why not
    known: the attribute path differs between vLLM releases."""
    for path in (("llm_engine", "model_config"), ("llm_engine", "vllm_config", "model_config")):
        obj = llm
        try:
            for name in path:
                obj = getattr(obj, name)
            return obj.quantization
        except AttributeError:
            continue
    return "unknown (no model_config found)"


def emit_row(args: argparse.Namespace, engine: str, kind: str, batch: int, steps: list[float], extra: dict) -> None:
    step_s = statistics.median(steps)
    base = _bf16_step(args.out, engine, batch) if kind != "bf16" else None
    row = {
        "mode": "vllm-decode",
        "engine": engine,
        "kind": kind,
        "checkpoint_config": KINDS[kind.removesuffix("-marlin")][1],
        "batch": batch,
        "context": PROMPT_LEN,
        "measure": f"(t[{args.long}] - t[{args.short}]) / {args.long - args.short}, median of {args.repeats}",
        "step_ms": step_s * 1e3,
        "tok_s": batch / step_s,
        "step_ms_repeats": [round(s * 1e3, 4) for s in steps],
        "vs_bf16": base / step_s if base else None,
        **extra,
    }
    emit(args, row)


def _bf16_step(out: str, engine: str, batch: int) -> float | None:
    """The engine's bf16 step time at this batch from --out, from a row of this commit."""
    if not os.path.exists(out):
        return None
    found = None
    for line in Path(out).read_text().splitlines():
        row = json.loads(line)
        if row.get("mode") == "vllm-decode" and row.get("engine") == engine and row.get("kind") == "bf16":
            if row.get("batch") == batch and row.get("commit") == _commit() and "step_ms" in row:
                found = row["step_ms"] / 1e3
    return found


def summarize(rows: list[dict]) -> str:
    """A markdown table of --out's rows (the latest of each engine, kind and batch): tok/s per batch and kind for
    pagoda, vLLM with its own kernel choice and vLLM with Marlin, and pagoda over each."""
    tok_s: dict[tuple[str, str, int], float] = {}
    errors = {}
    weights = {}  # (engine, kind) -> the weight memory its log reported (a check that vLLM quantized)
    for r in rows:
        if r.get("mode") == "vllm-decode-log":
            for line in r.get("lines", []):
                if found := re.search(r"(?:Model loading took|weights) ([\d.]+) GiB", line):
                    weights[(r["engine"], r["kind"])] = found[1]
        if r.get("mode") != "vllm-decode":
            continue
        if "error" in r:
            errors[(r["engine"], r["kind"])] = r["error"]
        else:
            tok_s[(r["engine"], r["kind"], r["batch"])] = r["tok_s"]
            errors.pop((r["engine"], r["kind"]), None)

    def cell(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    lines = [
        "| batch | kind | pagoda tok/s | vLLM tok/s | vLLM Marlin tok/s | pagoda / vLLM | pagoda / vLLM Marlin |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in BATCHES:
        for kind in KINDS:
            p, v = tok_s.get(("pagoda", kind, batch)), tok_s.get(("vllm", kind, batch))
            m = tok_s.get(("vllm", f"{kind}-marlin", batch))
            lines.append(
                f"| {batch} | {kind} | {cell(p, '.1f')} | {cell(v, '.1f')} | {cell(m, '.1f')} | "
                f"{cell(p / v if p and v else None, '.3f')} | {cell(p / m if p and m else None, '.3f')} |"
            )
    if weights:
        lines += ["", "Weight memory from the logs: " + ", ".join(f"{e} {k} {g} GiB" for (e, k), g in weights.items())]
    if errors:
        lines += ["", "Runs that failed:", *(f"- {e} {k}: {err}" for (e, k), err in errors.items())]
    return "\n".join(lines)


def run_all(args: argparse.Namespace) -> int:
    """Each engine and kind in a process of its own (so each starts with the whole GPU), vLLM's with its staged
    site first on the path. A failure leaves a row saying so and the others still run."""
    models = model_dirs()
    try:
        return _run_each(args, models)
    finally:
        for kind, model in models.items():
            if KINDS[kind][1] is not None:  # the temporary copies _quant_model_dir made
                shutil.rmtree(model, ignore_errors=True)


# Every linear of a Llama decoder layer, as GPTQModel's `modules_in_block_to_quantize` names them.
LLAMA_LINEARS = [
    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
    ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"],
]  # fmt: skip


def model_dirs() -> dict[str, str]:
    """kind -> the model directory both engines load (bench/gpu_check.py _quant_model_dir: bench/configs/llama3-8b,
    or a temporary copy with the kind's quantization_config). A GPTQ config also names the quantized modules:
    without `modules_in_block_to_quantize`, vLLM 0.26's AutoGPTQ finds them from the dtypes in the checkpoint's
    safetensors, and dummy weights have none, so it would leave every linear in bf16 (its "Model loading took
    14.96 GiB" for a W4A16 8B, the bf16 size); pagoda reads the key's absence or presence alike."""
    dirs = {}
    for kind, (_, recipe) in KINDS.items():
        dirs[kind] = path = _quant_model_dir(recipe)
        config_path = Path(path) / "config.json"
        config = json.loads(config_path.read_text())
        if config.get("quantization_config", {}).get("quant_method") == "gptq":
            config["quantization_config"]["modules_in_block_to_quantize"] = LLAMA_LINEARS
            config_path.write_text(json.dumps(config))
    return dirs


def _run_each(args: argparse.Namespace, models: dict[str, str]) -> int:
    site = os.environ.get("VB_SITE", "/root/vb_site")
    ok = True
    for engine, kind in RUNS:
        if engine not in args.engines or (args.kinds and kind not in args.kinds):
            continue
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
        if engine == "vllm":
            env["PYTHONPATH"] = os.pathsep.join([site, str(ROOT), *inherited])
            # flashinfer is not carried: greedy never reaches its sampler (../shared/peers/vllm_h100.sh).
            env |= {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
            if kind.endswith("-marlin"):
                env["VLLM_DISABLED_KERNELS"] = MARLIN_ONLY
        else:
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *inherited])
        cmd = [sys.executable, __file__, "one", "--engine", engine, "--kind", kind, "--out", args.out]
        cmd += ["--model", models[kind.removesuffix("-marlin")], "--short", str(args.short), "--long", str(args.long)]
        cmd += ["--repeats", str(args.repeats)]
        print(f"=== {engine} {kind} {time.strftime('%T')}", flush=True)
        # A session of its own: past the timeout the whole group goes, vLLM's engine-core process with it (left
        # alive, it would keep its GPU memory from the next run).
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            output, _ = proc.communicate(timeout=args.timeout)
            error = None if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            error = f"past --timeout {args.timeout:g} s"
        try:  # whatever of the group outlived its leader
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for line in output.splitlines():
            if line.startswith("RESULT") or "LinearKernel" in line or "Error" in line:
                print(line[:600], flush=True)
        # What the engine says it did with the checkpoint (the quantization method and kernel it took, the memory
        # its weights hold): a W4A16 step no faster than bf16 is only a result if the weights really were 4-bit.
        said = [line[:400] for line in output.splitlines() if LOADING_LINE.search(line)]
        with open(args.out, "a") as f:
            f.write(json.dumps({"mode": "vllm-decode-log", "engine": engine, "kind": kind, "lines": said[:40]}) + "\n")
        if error:
            ok = False
            # Not through emit, which asks torch for the device's name: CUDA in this process would hold memory
            # on the GPU that the next engine's process measures as taken.
            row = {"mode": "vllm-decode", "engine": engine, "kind": kind, "error": error, "tail": output[-2000:]}
            row |= {"commit": _commit(), "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": shlex.join(cmd)}
            print("RESULT", json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["all", "one", "summary"])
    parser.add_argument("--engine", choices=["pagoda", "vllm"])
    parser.add_argument("--kind", choices=sorted({k for _, k in RUNS}))
    parser.add_argument("--model", help="one: the model directory (all makes them)")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "vllm_decode.jsonl"))
    parser.add_argument("--short", type=int, default=SHORT, help="tokens of the shorter run")
    parser.add_argument("--long", type=int, default=LONG, help="tokens of the longer run")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="pairs of runs timed")
    parser.add_argument("--timeout", type=float, default=300.0, help="all: seconds for one engine and kind")
    parser.add_argument(
        "--engines", nargs="+", choices=["pagoda", "vllm"], default=["pagoda", "vllm"], help="all: these engines only"
    )
    parser.add_argument("--kinds", nargs="+", choices=sorted({k for _, k in RUNS}), help="all: these kinds only")
    args = parser.parse_args(argv)
    if args.long <= args.short or args.repeats < 1:
        raise SystemExit("--long must exceed --short, and --repeats be at least 1")
    if args.what == "all":
        return run_all(args)
    if args.what == "summary":
        print(summarize([json.loads(line) for line in Path(args.out).read_text().splitlines() if line.strip()]))
        return 0
    if not (args.engine and args.kind and args.model):
        raise SystemExit("one needs --engine, --kind and --model")
    if args.engine == "pagoda" and args.kind.endswith("-marlin"):
        raise SystemExit("w4a16-g128-marlin is a vLLM kernel choice; pagoda's W4A16 is w4a16-g128")
    (run_pagoda if args.engine == "pagoda" else run_vllm)(args.model, args.kind, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
