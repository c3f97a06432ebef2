"""Quantized linears on the GPU at Llama-3-8B shapes: time per layer and achieved weight bandwidth for bf16,
W4A16 g128 and W8A16 (the Triton kernel), FP8 and INT8 W8A8 (ScaledLinear), at decode- and prompt-sized
batches, each checked against its reference first. One decoder layer's four matmuls are summed, so
"layer_us" is the linear time of one layer of a decode step.

    python -m bench.quant_gpu [--batch 1 16 64 256]   (CUDA only; results: bench-results naming)
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from bench.naming import device_tag, results_path, short_commit
from engine.layers.linear import FP8, ScaledLinear, WeightOnlyLinear, quantize_per_row
from engine.quant import quantize_rtn

# Llama-3-8B: (K inputs, N outputs) of the fused qkv, o, fused gate/up and down projections.
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def _layers(kind: str, weights: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
    """The kind's layers, and the weights their outputs are checked against: for weight-only kinds the
    dequantized weights (the kernel must compute exactly what the integers stand for; 4-bit rounding alone
    moves a random layer's output by ~12%), else the full-precision ones."""
    if kind == "bf16":
        return [lambda x, w=w: F.linear(x, w) for w in weights], weights
    if kind in ("w4a16-g128", "w8a16"):
        bits, group = (4, 128) if kind == "w4a16-g128" else (8, -1)
        ints = [quantize_rtn(w, bits, group) for w in weights]
        refs = [iw.dequantize().t().to(torch.bfloat16) for iw in ints]
        return [WeightOnlyLinear(iw, None, torch.bfloat16) for iw in ints], refs
    qdtype = FP8 if kind == "fp8" else torch.int8
    return [ScaledLinear(*_per_row(w, qdtype), None, torch.bfloat16) for w in weights], weights


def _per_row(w: torch.Tensor, qdtype: torch.dtype):
    q, scale = quantize_per_row(w, qdtype)
    return q, scale.flatten()


def _weight_bytes(layer) -> int:
    if callable(layer) and not isinstance(layer, torch.nn.Module):
        return 0
    return sum(t.numel() * t.element_size() for t in layer.state_dict().values() if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for k, n in SHAPES]
    bf16_bytes = sum(w.numel() * 2 for w in weights)
    out = Path(args.out or results_path("quant-gpu", "cuda"))
    out.parent.mkdir(parents=True, exist_ok=True)
    for kind in ("bf16", "w4a16-g128", "w8a16", "fp8", "int8-w8a8"):
        layers, refs = _layers(kind, weights)
        nbytes = sum(_weight_bytes(layer) for layer in layers) or bf16_bytes
        for m in args.batch:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k, _ in SHAPES]
            with torch.no_grad():
                for layer, x, w in zip(layers, xs, refs):
                    ref = F.linear(x, w).float()
                    err = ((layer(x).float() - ref).norm() / ref.norm()).item()
                    assert err < 0.1, f"{kind} at batch {m}: relative error {err}"

                def step(layers=layers, xs=xs):
                    for layer, x in zip(layers, xs):
                        layer(x)

                us = do_bench(step, warmup=50, rep=300) * 1000
            row = {
                "kind": kind,
                "batch": m,
                "layer_us": round(us, 2),
                "weight_mib": round(nbytes / 2**20, 1),
                "weight_gbps": round(nbytes / us / 1e3, 1),
                "vs_bf16_bytes": round(bf16_bytes / nbytes, 2),
                "device": torch.cuda.get_device_name(),
                "commit": short_commit(),
                "date": datetime.date.today().isoformat(),
            }
            print(json.dumps(row), flush=True)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print(f"device tag {device_tag('cuda')}: {out}")


if __name__ == "__main__":
    main()
