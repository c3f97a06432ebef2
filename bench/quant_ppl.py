"""Perplexity of the default model (or another) on held-out bundled text, full precision vs each quantization.

Each variant is served by pagoda's engine as `pagoda serve` would serve it: full precision in float32 and
bfloat16, `--quantization fp8` / `int8` made at load, and checkpoints in the GPTQ, AWQ and compressed-tensors
formats written by bench/quant_checkpoints.py (round-to-nearest, cached under $PAGODA_CACHE/quant-checkpoints).
The text (bench/data/jargon-file-4.4.7.txt) is cut into windows of --window tokens, each scored on its own
(teacher forcing through the model's forward, the KV cache written through its attention backend).

    python -m bench.quant_ppl [--tokens 8192] [--window 512] [--variants fp32 bf16 int8 ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench import quant_checkpoints
from bench.naming import results_path, short_commit
from engine.default_model import cache_dir, default_model_dir
from engine.llm import LLM
from engine.runner.step_inputs import attention_metadata

TEXT = Path(__file__).parent / "data" / "jargon-file-4.4.7.txt"
# Variant -> (dtype, --quantization, checkpoint recipe or None for the model itself).
VARIANTS = {
    "fp32": ("float32", None, None),
    "bf16": ("bfloat16", None, None),
    "int8": ("float32", "int8", None),
    "fp8": ("float32", "fp8", None),
    **{name: ("float32", None, name) for name in quant_checkpoints.RECIPES},
}


def prompt_logits(llm: LLM, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one sequence through the engine's model (the engine must be idle),
    fed `chunk` tokens a forward (default: all at once), so that every chunk after the first reads the
    earlier ones from the KV cache."""
    runner = llm.engine.runner
    block = runner.block_size
    # The engine is idle, so any blocks are free to write, but blocks its earlier requests left in the prefix
    # cache would then be found again by a later prompt with the tokens they no longer hold: forget them.
    llm.engine.block_manager.reset_prefix_cache()
    table = list(range(math.ceil(len(ids) / block)))
    step = chunk or len(ids)
    logits = []
    with torch.no_grad():
        for start in range(0, len(ids), step):
            part = ids[start : start + step]
            positions = np.arange(start, start + len(part))
            meta = attention_metadata(runner.backend, block, runner.device, [len(part)], positions, [table])
            hidden = runner.model(
                torch.tensor(part, device=runner.device), torch.from_numpy(positions).to(runner.device), meta
            )
            logits.append(runner.model.compute_logits(hidden).float())
    return torch.cat(logits)


def window_nll(llm: LLM, ids: list[int], chunk: int | None = None) -> tuple[float, int]:
    """Summed negative log-likelihood of ids[1:] given their prefixes, and how many tokens that is."""
    logprobs = torch.log_softmax(prompt_logits(llm, ids, chunk)[:-1], dim=-1)
    target = torch.tensor(ids[1:], device=logprobs.device)
    return -logprobs.gather(1, target[:, None]).sum().item(), len(ids) - 1


def perplexity(model_dir: str, dtype: str, quantization: str | None, windows: list[list[int]], window: int) -> float:
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        device="cpu",
        quantization=quantization,
        max_model_len=window + 16,
        cpu_kv_cache_bytes=64 << 20,
    )
    nll = count = 0
    for ids in windows:
        a, b = window_nll(llm, ids)
        nll, count = nll + a, count + b
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of text scored")
    parser.add_argument("--window", type=int, default=512, help="tokens per window")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument(
        "--checkpoint",
        nargs="*",
        default=[],
        metavar="NAME=DIR",
        help="more variants: quantized checkpoints a tool wrote (bench/llmcompressor_checkpoints.py)",
    )
    parser.add_argument("--out", default=None, help="JSONL path (default: bench-results naming)")
    args = parser.parse_args()
    model_dir = args.model or str(default_model_dir())
    windows = text_windows(model_dir, args.tokens, args.window)
    out = Path(args.out or results_path("quant-ppl", "cpu"))
    out.parent.mkdir(parents=True, exist_ok=True)
    base = None
    extra = dict(c.split("=", 1) for c in args.checkpoint)
    for variant in args.variants + list(extra):
        dtype, quantization, recipe = VARIANTS.get(variant, ("float32", None, None))
        served = extra.get(variant, model_dir)
        if recipe is not None:
            served = cache_dir() / "quant-checkpoints" / Path(model_dir).name / recipe
            if not (served / "model.safetensors").is_file():
                quant_checkpoints.write(model_dir, served, quant_checkpoints.RECIPES[recipe])
        start = time.perf_counter()
        ppl = perplexity(str(served), dtype, quantization, windows, args.window)
        if variant == "fp32":
            base = ppl
        checkpoint = "llm-compressor" if variant in extra else "pagoda's packer (RTN)" if recipe else "none"
        record(out, variant, ppl, base, windows, start, model_dir, checkpoint=checkpoint, device="cpu")


def text_windows(model_dir: str, tokens: int, window: int) -> list[list[int]]:
    """The first `tokens` tokens of the bundled text, cut into windows of `window` tokens."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT.read_text())["input_ids"][:tokens]
    return [ids[i : i + window] for i in range(0, len(ids) - 1, window)]


def record(
    out: Path, variant: str, ppl: float, base: float | None, windows: list[list[int]], start: float, model_dir: str,
    **extra,
) -> None:  # fmt: skip
    """Print one result row and append it to `out`."""
    row = {
        "variant": variant,
        "perplexity": round(ppl, 4),
        "vs_fp32_pct": None if base is None else round(100 * (ppl / base - 1), 2),
        "tokens": sum(len(w) - 1 for w in windows),
        "window": len(windows[0]),
        "seconds": round(time.perf_counter() - start, 1),
        "model": Path(model_dir).name,
        **extra,
        "commit": short_commit(),
        "date": datetime.date.today().isoformat(),
        "command": f"python -m bench.{Path(sys.argv[0]).stem} " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(row), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
