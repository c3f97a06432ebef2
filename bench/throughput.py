"""Offline throughput: pagoda vs Hugging Face transformers `generate` on the same batch, in one run.

    python bench/throughput.py --num-prompts 16 --input-len 64 --output-len 128 [--model DIR] [--dtype float32]
    python bench/throughput.py --model bench/configs/qwen3-0.6b --load-format dummy --dtype bfloat16 \
        --device cuda --num-prompts 256 --len-range 100,1024 --engines pagoda        # W2

Prompts are random token ids from a fixed seed; every engine ignores EOS so all do the same work.
Writes one JSON line per engine to --out (default bench/results/throughput-<device>.jsonl).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import datetime
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import torch


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 20000), (num, length), generator=gen).tolist()


def ranged_workload(num: int, low: int, high: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Input and output lengths uniform in [low, high] (numpy seed: inputs drawn first, then outputs)."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(low, high + 1, num)
    outputs = rng.integers(low, high + 1, num)
    prompts = [rng.integers(100, min(vocab, 20000), int(n)).tolist() for n in inputs]
    return prompts, [int(n) for n in outputs]


def run_pagoda(args, prompts, output_lens: list[int] | None = None) -> dict:
    from engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format=args.load_format)
    load_s = time.perf_counter() - t0
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (output_lens or [args.output_len] * len(prompts))]
    # The same warm-up as the transformers run: the whole batch, 4 tokens.
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.engine.block_manager.reset_prefix_cache()  # the timed run must not reuse the warm-up's prompts
    _sync(args.device)
    profiler = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync(args.device)
    elapsed = time.perf_counter() - t0
    if profiler:
        profiler.disable()
        with open(args.profile, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": "pagoda", "elapsed_s": elapsed, "output_tokens": tokens, "load_s": load_s}


def run_transformers(args, prompts, model_dir: str) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    from engine.config import DTYPES

    dtype = DTYPES[args.dtype]
    if args.load_format == "dummy":
        from transformers import AutoConfig

        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    model.generation_config.eos_token_id = None  # ignore EOS, like the other engines
    ids = torch.tensor(prompts, device=args.device)  # equal lengths: no padding needed

    def generate(n: int):
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)

    generate(4)
    _sync(args.device)
    t0 = time.perf_counter()
    out = generate(args.output_len)
    _sync(args.device)
    elapsed = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"engine": "transformers", "version": transformers.__version__, "elapsed_s": elapsed, "output_tokens": tokens}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded default model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--len-range", default=None, metavar="LOW,HIGH",
                        help="input and output lengths uniform in [LOW, HIGH] instead of fixed (W2)")
    parser.add_argument("--engines", default="pagoda,transformers")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="cProfile pagoda's timed run; write the top functions by own time to FILE")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from engine.loader import read_hf_config

    if args.model is None:
        from engine.default_model import default_model_dir

        args.model = str(default_model_dir())
    model_dir = args.model
    vocab = read_hf_config(model_dir)["vocab_size"]
    output_lens = None
    if args.len_range:
        low, high = (int(x) for x in args.len_range.split(","))
        prompts, output_lens = ranged_workload(args.num_prompts, low, high, vocab, args.seed)
    else:
        prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    out = Path(args.out or f"bench/results/throughput-{args.device}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(args.repeat):
        for engine in args.engines.split(","):
            if engine == "pagoda":
                row = run_pagoda(args, prompts, output_lens)
            elif output_lens is None:
                row = run_transformers(args, prompts, model_dir)
            else:
                raise SystemExit("--len-range needs a continuous-batching engine: use --engines pagoda")
            row.update(
                output_tok_s=row["output_tokens"] / row["elapsed_s"],
                model=Path(model_dir).name, dtype=args.dtype, device=args.device, device_name=device_name,
                torch_threads=torch.get_num_threads(), num_prompts=args.num_prompts, input_len=args.input_len, len_range=args.len_range,
                output_len=args.output_len, commit=commit, date=datetime.datetime.now().isoformat(timespec="seconds"),
                command="python " + " ".join(__import__("sys").argv),
            )
            print(json.dumps(row))
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
