"""Perplexity of the default model (or another) on held-out bundled text with an fp8 KV cache against the
model-dtype (auto) cache, on the CPU.

Each window (--window tokens) is fed in chunks of --chunk tokens, each chunk attending to the earlier
ones through the KV cache as decoding reads it (over an fp8 cache a whole prompt attends to its own k/v
rounded to the cache's values, so the chunking changes only how the work is split); every variant is
scored the same way, so the difference is the cache's storage only. The text is
bench/data/jargon-file-4.4.7.txt, as in bench/quant_ppl.py.

    python -m bench.fp8kv_ppl [--tokens 4096] [--window 512] [--chunk 64] [--variants auto fp8 ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

from bench.naming import results_path, short_commit
from bench.quant_ppl import text_windows, window_nll
from engine.default_model import default_model_dir
from engine.llm import LLM
from engine.sampling_params import SamplingParams

# Variant -> (--kv-cache-dtype, --calculate-kv-scales).
VARIANTS = {
    "auto": ("auto", False),
    "fp8": ("fp8", False),
    "fp8-calculated-scales": ("fp8", True),
    "fp8_e5m2": ("fp8_e5m2", False),
}


def perplexity(llm: LLM, windows: list[list[int]], chunk: int) -> float:
    nll = count = 0
    for ids in windows:
        a, b = window_nll(llm, ids, chunk)
        nll, count = nll + a, count + b
    return math.exp(nll / count)


def make_llm(model_dir: str, kv_cache_dtype: str, calculate_kv_scales: bool, window: int) -> LLM:
    llm = LLM(
        model=model_dir,
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
        calculate_kv_scales=calculate_kv_scales,
        max_model_len=window + 16,
        cpu_kv_cache_bytes=64 << 20,
    )
    if calculate_kv_scales:
        # The scales come from the first prompt step, as in serving: one short prompt before the scoring.
        llm.generate(["The Jargon File is a glossary of hacker slang."], SamplingParams(max_tokens=1), use_tqdm=False)
    return llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of text scored")
    parser.add_argument("--window", type=int, default=512, help="tokens per window")
    parser.add_argument("--chunk", type=int, default=64, help="tokens per forward within a window")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=None, help="JSONL path (default: bench-results naming)")
    args = parser.parse_args()
    model_dir = args.model or str(default_model_dir())
    windows = text_windows(model_dir, args.tokens, args.window)
    out = Path(args.out or results_path("fp8kv-ppl", "cpu"))
    out.parent.mkdir(parents=True, exist_ok=True)
    base = None
    for variant in args.variants:
        start = time.perf_counter()
        llm = make_llm(model_dir, *VARIANTS[variant], args.window)
        ppl = perplexity(llm, windows, args.chunk)
        if variant == "auto":
            base = ppl
        row = {
            "variant": variant,
            "kv_cache_dtype": VARIANTS[variant][0],
            "calculate_kv_scales": VARIANTS[variant][1],
            "cache_dtype": str(llm.engine.runner.kv_cache.dtype).removeprefix("torch."),
            "kv_cache_size_tokens": llm.engine.block_manager.num_blocks * llm.engine.config.block_size,
            "perplexity": round(ppl, 4),
            "vs_auto_pct": None if base is None else round(100 * (ppl / base - 1), 3),
            "tokens": sum(len(w) - 1 for w in windows),
            "window": args.window,
            "chunk": args.chunk,
            "dtype": llm.engine.config.dtype,
            "seconds": round(time.perf_counter() - start, 1),
            "model": Path(model_dir).name,
            "device": "cpu",
            "commit": short_commit(),
            "date": datetime.date.today().isoformat(),
            "command": "python -m bench.fp8kv_ppl " + " ".join(sys.argv[1:]),
        }
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
