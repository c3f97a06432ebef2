"""Quantized linears on the GPU at Llama-3-8B shapes: time per layer and achieved weight bandwidth for bf16,
W4A16 g128 and W8A16 (the Triton kernel), FP8 and INT8 W8A8 (ScaledLinear), at decode- and prompt-sized
batches, each checked against its reference first. One decoder layer's four matmuls are summed, so
"layer_us" is the linear time of one layer of a decode step.

    python -m bench.quant_gpu [--batch 1 16 64 256] [--sweep]   (CUDA only; results: bench-results naming)

--sweep also times the W4A16 g128 kernel at batch 1 over a grid of tiles (engine/kernels/quant_gemm.py
Tiles) per layer shape, each checked first, beside bf16 F.linear: which tiles the decode heuristic should pick.
"""

from __future__ import annotations

import argparse
import datetime
import json
from functools import partial
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


def sweep_decode_tiles(out: Path) -> None:
    """Batch-1 W4A16 g128 kernel time per Llama-3-8B layer shape for each candidate tile, vs bf16 F.linear."""
    import itertools

    from engine.kernels.quant_gemm import Tiles, tiles, weight_only_matmul
    from engine.quant import pack_int32

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    totals: dict[str, float] = {}
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        iw = quantize_rtn(w, 4, 128)
        args = (pack_int32(iw.q, 4, 0), iw.scales.bfloat16(), iw.zeros.bfloat16(), 4, 128)
        nbytes = sum(t.numel() * t.element_size() for t in args[:3])
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        wb = w.bfloat16()
        ref = F.linear(x, iw.dequantize().t().to(torch.bfloat16)).float()
        timed = {"bf16": do_bench(lambda x=x, wb=wb: F.linear(x, wb), warmup=20, rep=100) * 1000}
        default = tiles(1, n, k, 128, sms)
        grid = itertools.product((64, 128, 256), (64, 128), (1, 2, 4, 8), ((4, 3), (4, 5), (8, 4)))
        candidates = {"default": default} | {
            f"bn{bn}-bk{bk}-s{split}-w{nw}-st{ns}": Tiles(16, bn, bk, split, nw, ns)
            for bn, bk, split, (nw, ns) in grid
            if k % (bk * split) == 0
        }
        for name, config in candidates.items():
            got = weight_only_matmul(x, *args, config=config).float()
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"{name} at K={k} N={n}: relative error {err}"
            call = partial(weight_only_matmul, x, *args, config=config)
            timed[name] = do_bench(call, warmup=20, rep=100) * 1000
        best = min((v, name) for name, v in timed.items() if name != "bf16")
        for key, name in (("bf16", "bf16"), ("default", "default"), ("best", best[1])):
            totals[key] = totals.get(key, 0.0) + timed[name]
        row = {
            "sweep": "w4a16-g128-batch1", "k": k, "n": n, "bf16_us": round(timed["bf16"], 2),
            "default": str(default), "default_us": round(timed["default"], 2), "best": best[1],
            "best_us": round(best[0], 2), "best_weight_gbps": round(nbytes / best[0] / 1e3, 1),
            "default_weight_gbps": round(nbytes / timed["default"] / 1e3, 1),
            "bf16_weight_gbps": round(n * k * 2 / timed["bf16"] / 1e3, 1),
            "top5": sorted((round(v, 2), name) for name, v in timed.items() if name != "bf16")[:5],
            "device": torch.cuda.get_device_name(), "commit": short_commit(),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
    summary = {"sweep": "layer total (4 matmuls), batch 1", **{f"{k}_us": round(v, 2) for k, v in totals.items()}}
    summary["bf16_over_default"] = round(totals["bf16"] / totals["default"], 2)
    summary["bf16_over_best"] = round(totals["bf16"] / totals["best"], 2)
    print(json.dumps(summary), flush=True)
    with out.open("a") as f:
        f.write(json.dumps(summary) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--sweep", action="store_true", help="also time the W4A16 kernel's batch-1 tiles")
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
    if args.sweep:
        sweep_decode_tiles(out)
    print(f"device tag {device_tag('cuda')}: {out}")


if __name__ == "__main__":
    main()
