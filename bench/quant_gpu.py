"""Quantized linears on the GPU at Llama-3-8B shapes: time per layer and achieved weight bandwidth for bf16,
W4A16 g128 and W8A16 (the Triton kernel), FP8 and INT8 W8A8 (ScaledLinear), at decode- and prompt-sized
batches, each checked against its reference first. One decoder layer's four matmuls are summed, so
"layer_us" is the linear time of one layer of a decode step.

    python -m bench.quant_gpu [--batch 1 16 64 256] [--sweep [gemv] [mid] [w8a8]] [--no-layers] [--budget S]
    (CUDA; results: bench-results naming)
    TRITON_INTERPRET=1 python -m bench.quant_gpu --sweep mid --dry-run   (CPU: tiny shapes, no timing worth reading)

--sweep times candidate tiles, each checked against its reference first, and prints the fastest as entries
for engine/kernels/quant_tiles.py: `gemv` the W4A16 g128 / W8A16 decode GEMV per layer shape at batch 1 (and
GEMV vs tl.dot at 2 and 4 rows), `mid` the decode tl.dot kernel at 16 and 64 rows (MID_TABLE; cut at --budget
seconds), `w8a8` the activation quantizer and the 8-bit GEMM (int8, fp8).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
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


def _emit(out: Path, row: dict, line: str) -> None:
    """One sweep result: a compact line on stdout (gpu_check.sh quant-kernels shows them), JSON in the file."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (Triton interpreter)"
    row |= {"device": device, "commit": short_commit()}
    print(line, flush=True)
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def _time(call, rep: int = 50) -> float:
    """Microseconds a call takes: do_bench on CUDA; off it (a dry run) one call's wall time."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6
    return do_bench(call, warmup=10, rep=rep) * 1000


def gemv_candidates(bits: int, n: int, k: int, num_sms: int = 132) -> list:
    """The GEMV tiles the sweep tries: 32..256 outputs by 8..32 words a step, 4 or 8 warps, 2 to 8 words per
    thread a step (fewer leave the loads too small; 16 spill registers on sm_90); K split 1..8 ways keeping
    two steps per split and at most 6 programs per SM."""
    from engine.kernels.quant_tiles import GemvTiles

    kw = k * bits // 32
    return [
        GemvTiles(bn, bkw, split, nw)
        for bn in (32, 64, 128, 256)
        for bkw in (8, 16, 32)
        for split in (1, 2, 4, 8)
        for nw in (4, 8)
        if kw // split >= 2 * bkw and 2 <= bn * bkw // (32 * nw) <= 8 and -(-n // bn) * split <= 6 * num_sms
    ]


def sweep_gemv(out: Path) -> None:
    """W4A16 g128 and W8A16 per-channel decode: per Llama-3-8B layer shape, the GEMV's default tiles and each
    candidate at batch 1 (each checked against the dequantized reference first) beside bf16 F.linear and the
    tl.dot kernel; then, with the best batch-1 tiles fitted to the rows, the GEMV against tl.dot at 2 and 4
    rows (whether GEMV_MAX_M should be lower). Prints GEMV_TABLE entries for engine/kernels/quant_tiles.py."""
    from engine.kernels.quant_gemm import gemv_rows, gemv_tiles, mid_tiles, weight_only_matmul
    from engine.quant import pack_int32

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    entries = []
    for bits, group in ((4, 128), (8, -1)):
        totals = {"bf16": 0.0, "dot": 0.0, "default": 0.0, "best": 0.0}
        for k, n in SHAPES:
            w = torch.randn(n, k, device="cuda") * 0.02
            iw = quantize_rtn(w, bits, group)
            args = (pack_int32(iw.q, bits, 0), iw.scales.bfloat16(), iw.zeros.bfloat16(), bits, iw.group_size)
            nbytes = sum(t.numel() * t.element_size() for t in args[:3])
            counters = torch.zeros(n // 16, dtype=torch.int32, device="cuda")
            wd = iw.dequantize().t().to(torch.bfloat16)
            wb = w.bfloat16()
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, wd).float()
            default = gemv_tiles(bits, n, k, sms)
            timed = {}
            for config in [default, *gemv_candidates(bits, n, k, sms)]:
                got = weight_only_matmul(x, *args, config=config, counters=counters).float()
                err = ((got - ref).norm() / ref.norm()).item()
                assert err < 1e-2 and not counters.any(), f"{config} at K={k} N={n}: relative error {err}"
                timed[config] = _time(partial(weight_only_matmul, x, *args, config=config, counters=counters))
            best = min(timed, key=timed.get)
            dot_tiles = mid_tiles(bits, 1, n, k, iw.group_size, sms)
            dot = _time(partial(weight_only_matmul, x, *args, config=dot_tiles, counters=counters))
            bf16 = _time(lambda x=x, wb=wb: F.linear(x, wb))
            for key, us in (("bf16", bf16), ("dot", dot), ("default", timed[default]), ("best", timed[best])):
                totals[key] += us
            row = {
                "sweep": f"gemv-w{bits}", "k": k, "n": n, "bf16_us": round(bf16, 2), "dot_us": round(dot, 2),
                "default": str(default), "default_us": round(timed[default], 2), "best": str(best),
                "best_us": round(timed[best], 2), "best_weight_gbps": round(nbytes / timed[best] / 1e3, 1),
                "top5": [(round(timed[c], 2), str(c)) for c in sorted(timed, key=timed.get)[:5]],
            }  # fmt: skip
            t = f"bn{best.block_n} kw{best.block_kw} s{best.split} w{best.num_warps}"
            _emit(out, row, f"gemv w{bits} K={k:5} N={n:5} m=1  best {t:22} {timed[best]:7.1f} us "
                            f"{nbytes / timed[best] / 1e3:6.0f} GB/s | default {timed[default]:7.1f} | "
                            f"tl.dot {dot:7.1f} | bf16 {bf16:7.1f}")  # fmt: skip
            entries.append(f"    ({bits}, {k}, {n}): {best!r},")
            for m in (2, 4):
                xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(xm, wd).float()
                rows = gemv_rows(best, m)
                got = weight_only_matmul(xm, *args, config=rows, counters=counters).float()
                assert ((got - ref).norm() / ref.norm()).item() < 1e-2
                g_us = _time(partial(weight_only_matmul, xm, *args, config=rows, counters=counters))
                dot_tiles = mid_tiles(bits, m, n, k, iw.group_size, sms)
                d_us = _time(partial(weight_only_matmul, xm, *args, config=dot_tiles, counters=counters))
                row = {"sweep": f"gemv-vs-dot-w{bits}", "k": k, "n": n, "m": m, "gemv_us": round(g_us, 2),
                       "dot_us": round(d_us, 2)}  # fmt: skip
                _emit(out, row, f"gemv w{bits} K={k:5} N={n:5} m={m}  gemv {g_us:7.1f} us | tl.dot {d_us:7.1f} us")
        summary = {"sweep": f"gemv-w{bits} layer total (4 matmuls), batch 1"} | {
            f"{key}_us": round(v, 2) for key, v in totals.items()
        }
        _emit(out, summary, f"gemv w{bits} layer at m=1: bf16 {totals['bf16']:.1f} us, tl.dot {totals['dot']:.1f}, "
                            f"default {totals['default']:.1f}, best {totals['best']:.1f} "
                            f"(bf16 / best = {totals['bf16'] / totals['best']:.2f}x)")  # fmt: skip
    print("GEMV_TABLE entries (engine/kernels/quant_tiles.py):\n" + "\n".join(entries), flush=True)


def mid_candidates(m: int, n: int, k: int, group: int, num_sms: int = 132) -> list:
    """The decode tl.dot kernel's tiles the sweep tries at m rows: BLOCK_M the rows' power of two, 32..256
    outputs by 64 or 128 inputs a step (dividing K and the group), 4 or 8 warps, 3 or 4 stages, either operand
    order, keeping at most 64 accumulators a thread (BLOCK_M * BLOCK_N / (32 * warps)). Breadth first, so a
    sweep cut by its budget has seen the likeliest kinds: each kernel with K split for about two programs per
    SM, then four, then unsplit (a split keeps two steps per program); kernels in one order for every shape
    (later shapes reuse the compiled kernels), widest first, the weight as first operand first, as
    bench/quant_sass.py ranks them on sm_90 (fewest instructions per weight: 6.0 at 256 outputs and 4 warps,
    8.1 to 9.3 at 128, 10 to 16 at 64, 16 rows, 4 bits)."""
    from engine.kernels.quant_tiles import MidTiles

    bm = max(16, 1 << (m - 1).bit_length())
    kernels = [
        (bn, bk, nw, ns, trans)
        for bn in (256, 128, 64, 32)
        for trans in (True, False)
        for nw in (4, 8)
        for bk in (128, 64)
        for ns in (3, 4)
        if group % bk == 0 and k % bk == 0 and bm * bn // (32 * nw) <= 64
    ]
    found: dict = {}  # ordered, without repeats
    for per_sm in (2, 4, 0):
        for bn, bk, nw, ns, trans in kernels:
            split = max(1, round(per_sm * num_sms / -(-n // bn)))
            if k // (bk * split) >= 2:
                found[MidTiles(bm, bn, bk, split, nw, ns, trans)] = None
    return list(found)


def sweep_mid(out: Path, budget_s: float = 360.0, dry_run: bool = False) -> list[str]:
    """W4A16 g128 and W8A16 per-channel at 16 and 64 rows, the decode tl.dot kernel per Llama-3-8B layer shape
    (tiny shapes in a dry run): the default tiles, then candidates until the shape's share of `budget_s`
    (the budget over the (bits, shape, rows) left, so a cut sweep still covers every shape), each checked
    against the dequantized reference (and its counters left zeroed) first; beside bf16 F.linear, the prompt
    kernel at those rows and the GEMV at one row (the target: the weight read as fast as at batch 1). Then per
    bits and rows the layer's total (the four matmuls). Prints MID_TABLE entries and returns them."""
    from engine.kernels.quant_gemm import _num_sms, gemv_tiles, mid_tiles, tiles, weight_only_matmul
    from engine.quant import pack_int32

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(256, 96), (512, 64)] if dry_run else SHAPES
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    sms = _num_sms(torch.device(device))
    deadline = time.monotonic() + budget_s
    combos = [(bits, group, m) for bits, group in ((4, 128), (8, -1)) for m in (16, 64)]
    left = len(combos) * len(shapes)
    entries = []
    for bits, group, m in combos:
        totals = {"bf16": 0.0, "prompt": 0.0, "gemv1": 0.0, "default": 0.0, "best": 0.0}
        for k, n in shapes:
            stop = time.monotonic() + max(0.0, deadline - time.monotonic()) / left
            left -= 1
            g = torch.Generator(device=device).manual_seed(k + n + bits)
            w = torch.randn(n, k, device=device, generator=g) * 0.02
            iw = quantize_rtn(w, bits, group)
            args = (pack_int32(iw.q, bits, 0), iw.scales.to(dtype), iw.zeros.to(dtype), bits, iw.group_size)
            nbytes = sum(t.numel() * t.element_size() for t in args[:3])
            counters = torch.zeros(-(-n // 16), dtype=torch.int32, device=device)
            x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
            ref = F.linear(x, iw.dequantize().t().to(dtype)).float()
            default = mid_tiles(bits, m, n, k, iw.group_size, sms)
            timed, failed = {}, []
            candidates = [default, *(c for c in mid_candidates(m, n, k, iw.group_size, sms) if c != default)]
            for config in candidates[:2] if dry_run else candidates:
                if config is not default and time.monotonic() > stop:
                    break
                try:  # a kernel this Triton fails to compile (a crash seen on sm_90 in some versions) is skipped
                    got = weight_only_matmul(x, *args, config=config, counters=counters).float()
                except Exception as e:  # noqa: BLE001 - Triton's compile errors have no common type
                    failed.append((repr(config), str(e).strip().splitlines()[-1][:200] if str(e).strip() else repr(e)))
                    print(f"mid w{bits} K={k:5} N={n:5} m={m:2}  failed to compile or run: {config!r}: {failed[-1][1]}")
                    continue
                err = ((got - ref).norm() / ref.norm()).item()
                assert err < 1e-2 and not counters.any(), f"{config} at K={k} N={n} m={m}: relative error {err}"
                timed[config] = _time(partial(weight_only_matmul, x, *args, config=config, counters=counters))
            if not timed:
                _emit(out, {"sweep": f"mid-w{bits}", "k": k, "n": n, "m": m, "failed": failed},
                      f"mid w{bits} K={k:5} N={n:5} m={m:2}  every candidate tried failed")  # fmt: skip
                continue
            best = min(timed, key=timed.get)
            wb = w.to(dtype)
            gemv1 = gemv_tiles(bits, n, k, sms)
            us = {
                "bf16": _time(lambda x=x, wb=wb: F.linear(x, wb)),
                "prompt": _time(partial(weight_only_matmul, x, *args, config=tiles(m, n, k, iw.group_size))),
                "gemv1": _time(partial(weight_only_matmul, x[:1], *args, config=gemv1, counters=counters)),
                "default": timed.get(default, float("nan")),
                "best": timed[best],
            }
            for key, v in us.items():
                totals[key] += v
            row = {
                "sweep": f"mid-w{bits}", "k": k, "n": n, "m": m, "default": repr(default), "best": repr(best),
                "tried": len(timed), "failed": failed, "best_weight_gbps": round(nbytes / timed[best] / 1e3, 1),
                "top5": [(round(timed[c], 2), repr(c)) for c in sorted(timed, key=timed.get)[:5]],
            } | {f"{key}_us": round(v, 2) for key, v in us.items()}  # fmt: skip
            t = f"bn{best.block_n} bk{best.block_k} s{best.split} w{best.num_warps} st{best.num_stages}" + (
                " T" if best.trans else ""
            )
            _emit(out, row, f"mid w{bits} K={k:5} N={n:5} m={m:2}  best {t:26} {timed[best]:7.1f} us "
                            f"{nbytes / timed[best] / 1e3:6.0f} GB/s ({len(timed)} tried) | default "
                            f"{us['default']:7.1f} | prompt kernel {us['prompt']:7.1f} | GEMV m=1 {us['gemv1']:7.1f} "
                            f"| bf16 {us['bf16']:7.1f}")  # fmt: skip
            entries.append(f"    ({bits}, {k}, {n}, {best.block_m}): {best!r},")
        summary = {"sweep": f"mid-w{bits} layer total (4 matmuls), batch {m}"} | {
            f"{key}_us": round(v, 2) for key, v in totals.items()
        }
        _emit(out, summary, f"mid w{bits} layer at m={m}: bf16 {totals['bf16']:.1f} us, prompt kernel "
                            f"{totals['prompt']:.1f}, default {totals['default']:.1f}, best {totals['best']:.1f}, "
                            f"GEMV at m=1 {totals['gemv1']:.1f} (best / GEMV m=1 = "
                            f"{totals['best'] / totals['gemv1']:.2f}x; shapes that failed count 0)")  # fmt: skip
    print("MID_TABLE entries (engine/kernels/quant_tiles.py):\n" + "\n".join(entries), flush=True)
    return entries


def sweep_w8a8(out: Path) -> None:
    """The activation quantizer (one launch) against the torch ops it replaces, per K and batch over block
    sizes; the Triton 8-bit GEMM's tiles at 1, 16 and 64 rows per layer shape, int8 against torch._int_mm
    (padded to 32 rows below 17; bit for bit) and fp8 against torch._scaled_mm (within 1%). Each result is
    checked first."""
    from engine.kernels.quant_tiles import RowTiles, Tiles
    from engine.kernels.w8a8 import quantize_rows, scaled_matmul, w8a8_tiles

    for k in (4096, 14336):
        for m in (1, 16, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref_q, ref_s = quantize_per_row(x, torch.int8)
            torch_us = _time(partial(quantize_per_row, x, FP8))
            timed = {}
            for config in [RowTiles(b, nw) for b in (512, 1024, 2048, 4096) for nw in (2, 4, 8)]:
                q, s = quantize_rows(x, torch.int8, config=config)
                assert torch.equal(q, ref_q) and torch.equal(s, ref_s), config
                timed[config] = _time(partial(quantize_rows, x, FP8, config=config))
            best = min(timed, key=timed.get)
            row = {"sweep": "act-quant", "k": k, "m": m, "torch_us": round(torch_us, 2), "best": str(best),
                   "best_us": round(timed[best], 2)}  # fmt: skip
            _emit(out, row, f"act-quant K={k:5} m={m:3}  best block {best.block} w{best.num_warps} "
                            f"{timed[best]:6.1f} us | torch ops {torch_us:6.1f} us")  # fmt: skip
    entries = []
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        for kind, qdtype in (("int8", torch.int8), ("fp8", FP8)):
            wq, ws = quantize_per_row(w, qdtype)
            ws = ws.reshape(1, -1).contiguous()
            for m in (1, 16, 64):
                xq, xs = quantize_per_row(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), qdtype)
                if kind == "int8":  # int32 sums are exact: the Triton GEMM must equal _int_mm's bit for bit
                    pad = torch.nn.functional.pad(xq, (0, 0, 0, max(0, 32 - m)))
                    torch_call = partial(torch._int_mm, pad, wq.t())  # without the scaling that follows it
                    exact = (torch_call()[:m].float() * xs * ws).to(torch.bfloat16)
                else:
                    torch_call = partial(torch._scaled_mm, xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
                    exact = torch_call().float()
                default = w8a8_tiles(kind, n, k)
                timed = {}
                grid = [(bn, bk, nw, ns) for bn in (32, 64, 128) for bk in (128, 256) for nw, ns in ((4, 3), (4, 5))]
                for config in [default, *(Tiles(16 if m < 64 else 64, *t[:2], 1, *t[2:]) for t in grid)]:
                    got = scaled_matmul(xq, xs, wq, ws, torch.bfloat16, config)
                    if kind == "int8":
                        assert torch.equal(got, exact), config
                    else:
                        assert ((got.float() - exact).norm() / exact.norm()).item() < 1e-2, config
                    timed[config] = _time(partial(scaled_matmul, xq, xs, wq, ws, torch.bfloat16, config))
                best = min(timed, key=timed.get)
                torch_us = _time(torch_call)
                row = {"sweep": f"{kind}-gemm", "k": k, "n": n, "m": m, "best": str(best),
                       "best_us": round(timed[best], 2), "default_us": round(timed[default], 2),
                       "torch_us": round(torch_us, 2)}  # fmt: skip
                t = f"bm{best.block_m} bn{best.block_n} bk{best.block_k} w{best.num_warps} st{best.num_stages}"
                torch_name = "_int_mm (no scales)" if kind == "int8" else "_scaled_mm"
                _emit(out, row, f"{kind} K={k:5} N={n:5} m={m:2}  best {t:24} {timed[best]:7.1f} us "
                                f"{n * k / timed[best] / 1e3:6.0f} GB/s | default {timed[default]:7.1f} | "
                                f"{torch_name} {torch_us:7.1f}")  # fmt: skip
                if m == 1:
                    entries.append(f"    ({kind!r}, {k}, {n}): {best!r},")
    print(
        "W8A8_TABLE entries (engine/kernels/quant_tiles.py; set INT8_TRITON_MAX_M / FP8_TRITON_MAX_M from "
        "the m=1/16/64 rows):\n" + "\n".join(entries),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument(
        "--sweep",
        nargs="*",
        choices=["gemv", "mid", "w8a8"],
        default=None,
        help="also time candidate tiles of the decode GEMV, the decode tl.dot kernel and / or the W8A8 kernels "
        "(gemv and w8a8 if none named: `mid` fills a device call of its own)",
    )
    parser.add_argument("--budget", type=float, default=360.0, help="seconds the `mid` sweep may take")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the `mid` sweep at tiny shapes, two candidates each, on the CPU under TRITON_INTERPRET=1 "
        "(checks the sweep runs; its times mean nothing)",
    )
    parser.add_argument("--no-layers", action="store_true", help="skip the per-layer table (sweep only)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.dry_run:
        out = Path(args.out or results_path("quant-gpu-dry-run", "cpu"))
        out.parent.mkdir(parents=True, exist_ok=True)
        sweep_mid(out, args.budget, dry_run=True)
        return
    torch.manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for k, n in SHAPES]
    bf16_bytes = sum(w.numel() * 2 for w in weights)
    out = Path(args.out or results_path("quant-gpu", "cuda"))
    out.parent.mkdir(parents=True, exist_ok=True)
    for kind in () if args.no_layers else ("bf16", "w4a16-g128", "w8a16", "fp8", "int8-w8a8"):
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
            print(f"layer {kind:10} batch {m:3}  {us:8.1f} us  {row['weight_gbps']:6.0f} GB/s of weight "
                  f"({row['weight_mib']} MiB)", flush=True)  # fmt: skip
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    if args.sweep is not None:
        for name in args.sweep or ["gemv", "w8a8"]:
            {"gemv": sweep_gemv, "mid": partial(sweep_mid, budget_s=args.budget), "w8a8": sweep_w8a8}[name](out)
    print(f"device tag {device_tag('cuda')}: {out}")


if __name__ == "__main__":
    main()
