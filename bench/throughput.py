r"""Offline throughput: pagoda vs Hugging Face transformers `generate` (and vLLM, where it imports), one process.

Sweep (the default): batch size x input length x output length, one CSV row per engine and point, PNG plots.

    python bench/throughput.py --model bench/configs/llama3-8b --load-format dummy \
        [--batch-sizes 1,8,32,64,128,256] [--input-lens 128,512,2048] [--output-lens 128,256] \
        [--engines pagoda,transformers,vllm] [--csv FILE] [--plot-dir DIR] [--repeat 3]
    python bench/throughput.py --plot-from a.csv,b.csv --plot-dir DIR       # plots only, from earlier CSVs

Single point (what the JSONL results in bench/results/ came from): chosen by any of --num-prompts,
--input-len, --output-len, --len-range, --profile, --out; appends one JSON line per engine and repeat to --out.

    python bench/throughput.py --num-prompts 16 --input-len 64 --output-len 128 [--model DIR] [--dtype float32]
    python bench/throughput.py --model bench/configs/qwen3-0.6b --load-format dummy --dtype bfloat16 \
        --device cuda --num-prompts 256 --len-range 100,1024 --engines pagoda        # W2

Prompts are random token ids from a fixed seed; every engine ignores EOS so all do the same work. Each engine
is loaded once and reused for every point; before each point it generates 4 tokens for the whole batch (so
shape-specific set-up is not timed), and every timed run starts with an empty prefix cache. With dummy
weights, transformers gets exactly pagoda's random values; vLLM draws its own. vLLM runs last: it does not
give the GPU back cleanly inside a process.
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import datetime
import gc
import importlib.metadata
import itertools
import json
import platform
import pstats
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.cli import require_plotting
from bench.naming import results_path

DEFAULT_BATCH_SIZES = "1,8,32,64,128,256"
DEFAULT_INPUT_LENS = "128,512,2048"
DEFAULT_OUTPUT_LENS = "128,256"
WARM_UP_TOKENS = 4
CSV_COLUMNS = [
    "engine",
    "engine_version",
    "batch_size",
    "input_len",
    "output_len",
    "repeats",
    "elapsed_s",
    "output_tokens",
    "output_tok_s",
    "total_tok_s",
    "model",
    "dtype",
    "device",
    "device_name",
    "commit",
    "date",
    "command",
]
SINGLE_POINT_FLAGS = ("num_prompts", "input_len", "output_len", "len_range", "profile", "out")
SWEEP_FLAGS = ("batch_sizes", "input_lens", "output_lens", "csv", "plot_dir", "plot_from")


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 20000), (num, length), generator=gen).tolist()


def ranged_workload(num: int, low: int, high: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Input and output lengths uniform in [low, high], ids uniform in [0, min(vocab, 10000)): the draws of
    the vLLM peer's W2 (numpy's legacy generator: input lengths, then output lengths, then the ids)."""
    rng = np.random.RandomState(seed)
    inputs = rng.randint(low, high + 1, size=num)
    outputs = rng.randint(low, high + 1, size=num)
    prompts = [rng.randint(0, min(vocab, 10000), size=int(n)).tolist() for n in inputs]
    return prompts, [int(n) for n in outputs]


# ---------------------------------------------------------------------------------------------- engines


@dataclass
class Setup:
    """What every engine is given: the same model, precision, device and seed."""

    model_dir: str
    dtype: str
    device: str
    load_format: str
    seed: int
    max_model_len: int  # the longest input + output the run asks for
    gpu_memory_utilization: float


@dataclass
class Timing:
    elapsed_s: float
    output_tokens: int


class EngineUnavailable(Exception):
    """The engine cannot run here (e.g. its package does not import); the run goes on without it."""


class PagodaEngine:
    name = "pagoda"

    def __init__(self, setup: Setup):
        self.setup = setup
        self.llm = None
        self.version = _package_version("pagoda")

    def load(self) -> None:
        from engine import LLM

        s = self.setup
        self.llm = LLM(
            s.model_dir,
            dtype=s.dtype,
            device=s.device,
            load_format=s.load_format,
            seed=s.seed,
            max_model_len=s.max_model_len,
            gpu_memory_utilization=s.gpu_memory_utilization,
        )

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> Timing:
        from engine import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        self.llm.engine.block_manager.reset_prefix_cache()  # no reuse of the warm-up's or last repeat's prompts
        outs, elapsed = _timed(self.setup.device, lambda: self.llm.generate(prompts, params, use_tqdm=False))
        return Timing(elapsed, sum(len(o.outputs[0].token_ids) for o in outs))

    def close(self) -> None:
        self.llm = None


class TransformersEngine:
    """`model.generate` on one static batch: equal prompt lengths, so no padding."""

    name = "transformers"

    def __init__(self, setup: Setup):
        self.setup = setup
        self.model = None
        self.version = _package_version("transformers")

    def load(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        from engine.config import DTYPES

        s = self.setup
        dtype = getattr(torch, DTYPES[s.dtype])
        if s.load_format == "dummy":
            with torch.device(s.device):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(s.model_dir), dtype=dtype)
            copy_pagoda_dummy_weights(model, s.model_dir, dtype, s.device, s.seed)
        else:
            model = AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=dtype).to(s.device)
        model.generation_config.eos_token_id = None  # ignore EOS, like the other engines
        self.model = model.eval()

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> Timing:
        if len(set(output_lens)) != 1 or len({len(p) for p in prompts}) != 1:
            raise ValueError("transformers runs one static batch: every prompt and output of one length")
        ids = torch.tensor(prompts, device=self.setup.device)
        n = output_lens[0]

        def run() -> torch.Tensor:
            with torch.no_grad():
                return self.model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )

        out, elapsed = _timed(self.setup.device, run)
        return Timing(elapsed, (out.shape[1] - ids.shape[1]) * out.shape[0])

    def close(self) -> None:
        self.model = None


class VllmEngine:
    name = "vllm"

    def __init__(self, setup: Setup):
        self.setup = setup
        self.llm = None
        self.version = _package_version("vllm")

    def load(self) -> None:
        try:
            from vllm import LLM
        except (ImportError, OSError, RuntimeError) as exc:  # not installed, or built for another torch/CUDA
            raise EngineUnavailable(f"cannot import vllm ({type(exc).__name__}: {exc})") from None
        s = self.setup
        # Token-id prompts need no tokenizer; the bench config directories have none.
        self.llm = LLM(
            model=s.model_dir,
            dtype=s.dtype,
            load_format="dummy" if s.load_format == "dummy" else "auto",
            seed=s.seed,
            max_model_len=s.max_model_len,
            skip_tokenizer_init=True,
            gpu_memory_utilization=s.gpu_memory_utilization,
        )

    def generate(self, prompts: list[list[int]], output_lens: list[int]) -> Timing:
        from vllm import SamplingParams

        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False) for n in output_lens]
        requests = [{"prompt_token_ids": p} for p in prompts]
        self.llm.reset_prefix_cache()
        outs, elapsed = _timed(self.setup.device, lambda: self.llm.generate(requests, params, use_tqdm=False))
        return Timing(elapsed, sum(len(o.outputs[0].token_ids) for o in outs))

    def close(self) -> None:
        self.llm = None


ENGINES = {e.name: e for e in (PagodaEngine, TransformersEngine, VllmEngine)}


def copy_pagoda_dummy_weights(
    hf_model: torch.nn.Module, model_dir: str, dtype: torch.dtype, device: str, seed: int
) -> None:
    """Overwrite a transformers model with the random values pagoda's dummy loader draws for `seed`.

    pagoda's loader is run for real (on the same device, since CPU and CUDA generators differ), so the two
    stay equal whatever the loader's init does; both models are in memory for a moment.
    """
    from engine.loader import load_model

    pagoda, _ = load_model(model_dir, dtype, torch.device(device), "dummy", seed)
    ours = dict(pagoda.named_parameters())
    theirs = {name.removeprefix("model."): p for name, p in hf_model.named_parameters()}
    with torch.no_grad():
        for name, param in theirs.items():
            param.copy_(_pagoda_rows(name, ours, theirs, pagoda.packed))


def _pagoda_rows(name: str, ours: dict, theirs: dict, packed: dict) -> torch.Tensor:
    """The part of pagoda's parameter that holds the transformers tensor `name`."""
    for part, (fused, index) in packed.items():
        if f".{part}." in name:
            # A fused parameter stacks its parts in index order (q, k, v; gate, up), each as long as its own tensor.
            earlier = [p for p, (f, i) in packed.items() if f == fused and i < index]
            start = sum(theirs[name.replace(part, p)].shape[0] for p in earlier)
            return ours[name.replace(part, fused)].narrow(0, start, theirs[name].shape[0])
    return ours[name]


def _timed(device: str, fn):
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - t0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _release(engine) -> None:
    engine.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next engine sizes its KV cache from the free memory


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _load(engine, say) -> float | None:
    """Seconds to load, or None (with a message) when the engine cannot run here."""
    t0 = time.perf_counter()
    try:
        engine.load()
    except EngineUnavailable as exc:
        say(f"{engine.name}: skipped, {exc}")
        return None
    return time.perf_counter() - t0


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


# ---------------------------------------------------------------------------------------------- the sweep


def run_sweep(args: argparse.Namespace, setup: Setup, vocab: int, max_positions: int, context: dict) -> list[dict]:
    """Time every engine at every point; write CSV rows as they come (a cut-off run keeps its points)."""
    from tqdm import tqdm

    points = []
    for batch, input_len, output_len in itertools.product(args.batch_sizes, args.input_lens, args.output_lens):
        if input_len + output_len > max_positions:
            print(
                f"skipped batch {batch} x in {input_len} / out {output_len}: input + output exceeds the "
                f"model's {max_positions} positions"
            )
        else:
            points.append((batch, input_len, output_len))
    setup.max_model_len = max((i + o for _, i, o in points), default=1)
    csv_path = Path(args.csv)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for name in _run_order(args.engines):
            engine = ENGINES[name](setup)
            if not points or _load(engine, tqdm.write) is None:
                continue
            for batch, input_len, output_len in tqdm(points, desc=name, unit="point"):
                prompts = random_prompts(batch, input_len, vocab, args.seed)
                try:
                    engine.generate(prompts, [min(WARM_UP_TOKENS, output_len)] * batch)
                    timings = [engine.generate(prompts, [output_len] * batch) for _ in range(args.repeat)]
                except Exception as exc:
                    if not _is_oom(exc):
                        raise
                    # A static batch (transformers) can outgrow the GPU at the large points; the rest still run.
                    tqdm.write(f"{name}: skipped batch {batch} x in {input_len} / out {output_len}: out of memory")
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                elapsed = statistics.median(t.elapsed_s for t in timings)
                tokens = timings[-1].output_tokens
                row = {
                    "engine": name,
                    "engine_version": engine.version,
                    "batch_size": batch,
                    "input_len": input_len,
                    "output_len": output_len,
                    "repeats": args.repeat,
                    "elapsed_s": round(elapsed, 4),
                    "output_tokens": tokens,
                    "output_tok_s": round(tokens / elapsed, 2),
                    "total_tok_s": round((tokens + batch * input_len) / elapsed, 2),
                    **context,
                }
                writer.writerow(row)
                f.flush()
                rows.append(row)
            _release(engine)
    print(f"wrote {len(rows)} rows to {csv_path}")
    return rows


def _run_order(engines: list[str]) -> list[str]:
    return sorted(engines, key=lambda name: name == "vllm")  # stable: vLLM last, the rest as given


def read_csv_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows.extend(csv.DictReader(f))
    return rows


def write_plots(rows: list[dict], plot_dir: str) -> list[Path]:
    """One figure per output length (a panel per input length: output tok/s vs batch size, a line per engine)
    and one ratio figure (pagoda / each other engine, a panel per output x input length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(plot_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # (engine, input_len, output_len) -> {batch_size: output tok/s}; CSV rows read back hold strings.
    series: dict[tuple[str, int, int], dict[int, float]] = {}
    for r in rows:
        key = (r["engine"], int(r["input_len"]), int(r["output_len"]))
        series.setdefault(key, {})[int(r["batch_size"])] = float(r["output_tok_s"])
    engines = list(dict.fromkeys(e for e, _, _ in series))
    input_lens = sorted({i for _, i, _ in series})
    output_lens = sorted({o for _, _, o in series})
    first = rows[0] if rows else {}
    title = f"{first.get('model')}, {first.get('dtype')}, {first.get('device_name')}"
    written = []

    for output_len in output_lens:
        fig, axes = plt.subplots(1, len(input_lens), figsize=(4.5 * len(input_lens), 4), squeeze=False)
        for ax, input_len in zip(axes[0], input_lens):
            for engine in engines:
                points = sorted(series.get((engine, input_len, output_len), {}).items())
                if points:
                    ax.plot(*zip(*points), marker="o", label=engine)
            _batch_axis(ax, f"input {input_len}, output {output_len}", "output tok/s")
        fig.suptitle(f"offline throughput: {title}")
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"throughput-out{output_len}.png"))

    peers = [e for e in engines if e != "pagoda"]
    if "pagoda" in engines and peers:
        fig, axes = plt.subplots(
            len(output_lens), len(input_lens), figsize=(4.5 * len(input_lens), 3.5 * len(output_lens)), squeeze=False
        )
        for (row, output_len), (col, input_len) in itertools.product(enumerate(output_lens), enumerate(input_lens)):
            ax = axes[row][col]
            ours = series.get(("pagoda", input_len, output_len), {})
            for peer in peers:
                theirs = series.get((peer, input_len, output_len), {})
                batches = sorted(ours.keys() & theirs.keys())
                if batches:
                    ax.plot(batches, [ours[b] / theirs[b] for b in batches], marker="o", label=f"pagoda / {peer}")
            ax.axhline(1.0, color="grey", linewidth=0.8)
            _batch_axis(ax, f"input {input_len}, output {output_len}", "throughput ratio")
        fig.suptitle(f"pagoda / peer output tok/s: {title}")
        fig.tight_layout()
        written.append(_save(fig, out_dir / "ratio.png"))
    for path in written:
        print(f"wrote {path}")
    return written


def _batch_axis(ax, title: str, ylabel: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=8)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------- one point


def run_single_point(args: argparse.Namespace, setup: Setup, vocab: int, context: dict) -> None:
    """The original mode: one workload, one JSON line per engine and repeat appended to --out."""
    num, input_len, output_len = args.num_prompts or 16, args.input_len or 64, args.output_len or 128
    if args.len_range:
        low, high = (int(x) for x in args.len_range.split(","))
        prompts, output_lens = ranged_workload(num, low, high, vocab, args.seed)
        input_len = None
    else:
        prompts, output_lens = random_prompts(num, input_len, vocab, args.seed), [output_len] * num
    setup.max_model_len = max(len(p) + n for p, n in zip(prompts, output_lens))
    out = Path(args.out or results_path("throughput", setup.device))
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in _run_order(args.engines):
        if name == "transformers" and args.len_range:
            print("transformers: skipped, --len-range needs a continuous-batching engine")
            continue
        engine = ENGINES[name](setup)
        load_s = _load(engine, print)
        if load_s is None:
            continue
        engine.generate(prompts, [min(WARM_UP_TOKENS, n) for n in output_lens])
        for _ in range(args.repeat):
            profiler = cProfile.Profile() if args.profile and name == "pagoda" else None
            if profiler:
                profiler.enable()
            timing = engine.generate(prompts, output_lens)
            if profiler:
                profiler.disable()
                with open(args.profile, "w") as f:
                    pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)
            # The keys and order of the JSON lines already in bench/results/ (plus "version" for every engine).
            row = {
                "engine": name,
                "version": engine.version,
                "elapsed_s": timing.elapsed_s,
                "output_tokens": timing.output_tokens,
                "load_s": load_s,
                "output_tok_s": timing.output_tokens / timing.elapsed_s,
                "model": context["model"],
                "dtype": setup.dtype,
                "device": setup.device,
                "device_name": context["device_name"],
                "torch_threads": torch.get_num_threads(),
                "num_prompts": num,
                "input_len": input_len,
                "len_range": args.len_range,
                "output_len": output_len,
                "commit": context["commit"],
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": context["command"],
            }
            print(json.dumps(row))
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        _release(engine)


# ---------------------------------------------------------------------------------------------- command line


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _engine_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in ENGINES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"engines are {', '.join(ENGINES)}; got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    # No defaults for the mode-specific flags: whether one was given picks the mode.
    parser = argparse.ArgumentParser(
        prog="pagoda bench throughput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common = parser.add_argument_group("both modes")
    common.add_argument("--model", default=None, help="HF directory (default: the embedded default model)")
    common.add_argument(
        "--dtype", default="auto", help="float32, bfloat16, float16; auto: bfloat16 on CUDA, else float32"
    )
    common.add_argument("--device", default="auto", help="cpu, cuda; auto: cuda if available")
    common.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="auto: the checkpoint's weights; dummy: random weights from config.json",
    )
    common.add_argument(
        "--engines",
        type=_engine_list,
        default=_engine_list("pagoda,transformers,vllm"),
        help="comma list of pagoda, transformers, vllm (default: all three; vllm is skipped "
        "with a message where it does not import)",
    )
    common.add_argument("--seed", type=int, default=0, help="seeds the prompt token ids and dummy weights")
    common.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="timed runs per point (sweep: the CSV gets their median; single point: a line each)",
    )
    common.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="for pagoda and vllm")

    sweep = parser.add_argument_group("sweep (the default mode)")
    sweep.add_argument("--batch-sizes", type=_int_list, default=None, help=f"default {DEFAULT_BATCH_SIZES}")
    sweep.add_argument("--input-lens", type=_int_list, default=None, help=f"default {DEFAULT_INPUT_LENS}")
    sweep.add_argument("--output-lens", type=_int_list, default=None, help=f"default {DEFAULT_OUTPUT_LENS}")
    sweep.add_argument(
        "--csv",
        default=None,
        help="default: $OUT or ./bench-results, <date>-<device>-<commit>-sweep-<model>.csv (overwritten)",
    )
    sweep.add_argument("--plot-dir", default=None, help="default: the CSV's path without .csv")
    sweep.add_argument(
        "--plot-from",
        default=None,
        metavar="CSV[,CSV...]",
        help="run nothing: draw the plots from earlier sweep CSVs (e.g. one per engine process)",
    )

    single = parser.add_argument_group("single point (any of these picks it)")
    single.add_argument("--num-prompts", type=int, default=None, help="default 16")
    single.add_argument("--input-len", type=int, default=None, help="default 64")
    single.add_argument("--output-len", type=int, default=None, help="default 128")
    single.add_argument(
        "--len-range",
        default=None,
        metavar="LOW,HIGH",
        help="input and output lengths uniform in [LOW, HIGH] instead of fixed (W2)",
    )
    single.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="cProfile pagoda's timed run; write the top functions by own time to FILE",
    )
    single.add_argument(
        "--out",
        default=None,
        help="JSONL to append to (default: $OUT or ./bench-results, <date>-<device>-<commit>-throughput.jsonl)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the parsed command line; 0 on success."""
    single = [f for f in SINGLE_POINT_FLAGS if getattr(args, f) is not None]
    swept = [f for f in SWEEP_FLAGS if getattr(args, f) is not None]
    if single and swept:
        raise SystemExit(
            f"--{single[0].replace('_', '-')} (single point) and --{swept[0].replace('_', '-')} "
            "(sweep) do not go together"
        )
    if args.plot_from or not single:  # both end in plots: say now, not after the sweep, if they cannot be drawn
        require_plotting()
    if args.plot_from:
        csvs = args.plot_from.split(",")
        write_plots(read_csv_rows(csvs), args.plot_dir or str(Path(csvs[0]).with_suffix("")))
        return 0

    from engine.loader import read_hf_config

    if args.model is None:
        from engine.default_model import default_model_dir

        args.model = str(default_model_dir())
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    hf_config = read_hf_config(args.model)
    setup = Setup(args.model, dtype, device, args.load_format, args.seed, 0, args.gpu_memory_utilization)
    model = Path(args.model).name
    context = {
        "model": model,
        "dtype": dtype,
        "device": device,
        "device_name": _device_name(device),
        "commit": _commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": _command_line(),
    }
    if single:
        run_single_point(args, setup, hf_config["vocab_size"], context)
        return 0
    args.batch_sizes = args.batch_sizes or _int_list(DEFAULT_BATCH_SIZES)
    args.input_lens = args.input_lens or _int_list(DEFAULT_INPUT_LENS)
    args.output_lens = args.output_lens or _int_list(DEFAULT_OUTPUT_LENS)
    args.csv = args.csv or results_path(f"sweep-{model}", device, "csv")
    max_positions = hf_config.get("max_position_embeddings", 4096)  # pagoda's own default when absent
    rows = run_sweep(args, setup, hf_config["vocab_size"], max_positions, context)
    if rows:
        write_plots(rows, args.plot_dir or str(Path(args.csv).with_suffix("")))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    try:  # platform.processor() is often empty on Linux
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _commit() -> str:
    git = ["git", "rev-parse", "--short", "HEAD"]
    return subprocess.run(git, capture_output=True, text=True, check=False, cwd=Path(__file__).parent).stdout.strip()


def _command_line() -> str:
    words = shlex.join(sys.argv)
    return f"python {words}" if sys.argv[0].endswith(".py") else words


if __name__ == "__main__":
    sys.exit(main())
