"""Where quantization loss comes from: perplexity with fake-quantized weights and/or activations, in plain
transformers (no pagoda code in the forward), on the same text and windows as bench/quant_ppl.py.

Each variant rounds a set of linear layers' weights (round-to-nearest, as engine.quant.quantize_rtn and
engine.layers.linear.quantize_per_row round them) and/or their inputs (per token, at run time) and scores
the text. Comparing a variant here with the same scheme served by pagoda's engine (bench/quant_ppl.py) tells
a bug in pagoda apart from loss the scheme itself costs; the per-layer variants say which layers cost it.

    python -m bench.quant_sensitivity [--tokens 4096] [--window 512] [--variants fp32 w8a8-int8 ...]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from torch import nn

from bench.naming import results_path
from bench.quant_ppl import record, text_windows
from engine.default_model import default_model_dir
from engine.layers.linear import FP8, quantize_per_row
from engine.quant import quantize_rtn

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fake_rows(x: torch.Tensor, qdtype: torch.dtype) -> torch.Tensor:
    """x rounded per row (last dim) to int8 or fp8 E4M3 and scaled back, in float32."""
    shape = x.shape
    q, scale = quantize_per_row(x.reshape(-1, shape[-1]), qdtype)
    return (q.float() * scale).reshape(shape).to(x.dtype)


def _weight(kind: str, w: torch.Tensor) -> torch.Tensor:
    """One [N, K] weight rounded as `kind` says: int8 / fp8 per output channel, or wB gG [asym] int."""
    if kind == "int8":
        return _fake_rows(w, torch.int8)
    if kind == "fp8":
        return _fake_rows(w, FP8)
    bits, group, *rest = kind.split("-")  # e.g. "w4-g128-asym"
    iw = quantize_rtn(w, int(bits[1:]), int(group[1:]), symmetric=not rest)
    return iw.dequantize().t().to(w.dtype)


# name -> (weight rounding or None, activation dtype or None, which projections)
VARIANTS: dict[str, tuple[str | None, torch.dtype | None, tuple[str, ...]]] = {
    "fp32": (None, None, ()),
    "w8-int8": ("int8", None, ALL),
    "a8-int8": (None, torch.int8, ALL),
    "w8a8-int8": ("int8", torch.int8, ALL),
    "w8a8-int8-not-down": ("int8", torch.int8, tuple(p for p in ALL if p != "down_proj")),
    "a8-int8-down": (None, torch.int8, ("down_proj",)),
    "a8-int8-o": (None, torch.int8, ("o_proj",)),
    "a8-int8-qkv": (None, torch.int8, ("q_proj", "k_proj", "v_proj")),
    "a8-int8-gate-up": (None, torch.int8, ("gate_proj", "up_proj")),
    "w8-fp8": ("fp8", None, ALL),
    "a8-fp8": (None, FP8, ALL),
    "w8a8-fp8": ("fp8", FP8, ALL),
    "w4-g128": ("w4-g128", None, ALL),
    "w4-g128-asym": ("w4-g128-asym", None, ALL),
    "w4-g64": ("w4-g64", None, ALL),
    "w4-g32": ("w4-g32", None, ALL),
    "w4-g32-asym": ("w4-g32-asym", None, ALL),
    "w4-g128-not-down": ("w4-g128", None, tuple(p for p in ALL if p != "down_proj")),
    "w4-g128-down": ("w4-g128", None, ("down_proj",)),
    "a8-int8-smooth": (None, torch.int8, ALL),
    "w8a8-int8-smooth": ("int8", torch.int8, ALL),
    "w8a8-int8-smooth50": ("int8", torch.int8, ALL),
}
# variant -> SmoothQuant's alpha (migration strength)
SMOOTHING = {"a8-int8-smooth": 0.8, "w8a8-int8-smooth": 0.8, "w8a8-int8-smooth50": 0.5}
# The layers SmoothQuant rescales, by shared input: q/k/v into the input norm and gate/up into the post-attention
# norm (the mappings llm-compressor 0.14 infers for Llama), and down_proj into up_proj (which it leaves out);
# o_proj is left alone (under grouped KV heads v_proj cannot absorb it).
SMOOTHED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("down_proj",))


def smooth(model: nn.Module, model_dir: str, alpha: float) -> None:
    """SmoothQuant on calibration text: input channel j of each smoothed group is divided by
    s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha) and the weights' column j multiplied by it, which leaves the
    product unchanged and moves activation outliers into the weights before both are rounded. A checkpoint
    folds 1/s into the preceding norm or up_proj; here a hook divides the input, the same numbers."""
    from bench.quant_checkpoints import input_absmax

    xmax = input_absmax(model_dir)
    for layer in model.model.layers:
        modules = dict(layer.self_attn.named_children()) | dict(layer.mlp.named_children())
        for group in SMOOTHED:
            linears = [modules[name] for name in group]
            name = next(n for n, m in model.named_modules() if m is linears[0])
            wmax = torch.stack([m.weight.abs().amax(0) for m in linears]).amax(0)
            s = (xmax[name].pow(alpha) / wmax.pow(1 - alpha)).clamp(min=1e-5)
            for m in linears:
                with torch.no_grad():
                    m.weight.mul_(s)
                m.register_forward_pre_hook(lambda m, args, s=s: (args[0] / s,))


def perplexity(model: nn.Module, windows: list[list[int]]) -> float:
    nll = count = 0.0
    with torch.no_grad():
        for ids in windows:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1].float()
            nll += nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            count += len(ids) - 1
    return math.exp(nll / count)


def apply(model: nn.Module, variant: str, model_dir: str) -> list:
    """Round the variant's weights in place and hook its activation rounding; returns the hooks."""
    weight_kind, act_dtype, targets = VARIANTS[variant]
    if variant in SMOOTHING:
        smooth(model, model_dir, SMOOTHING[variant])
    hooks = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in targets:
            continue
        if weight_kind is not None:
            with torch.no_grad():
                module.weight.copy_(_weight(weight_kind, module.weight))
        if act_dtype is not None:
            hooks.append(module.register_forward_pre_hook(lambda m, args, d=act_dtype: (_fake_rows(args[0], d),)))
    return hooks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = args.model or str(default_model_dir())
    windows = text_windows(model_dir, args.tokens, args.window)
    out = Path(args.out or results_path("quant-sensitivity", "cpu"))
    out.parent.mkdir(parents=True, exist_ok=True)
    base = None
    for variant in args.variants:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        apply(model, variant, model_dir)
        ppl = perplexity(model, windows)
        base = ppl if variant == "fp32" else base
        record(out, variant, ppl, base, windows, start, model_dir, forward="transformers, fake-quantized")


if __name__ == "__main__":
    main()
