"""Quantized linears on the GPU at Llama-3-8B shapes: time per layer and achieved weight bandwidth for bf16,
W4A16 g128 and W8A16 (the Triton kernel), FP8 and INT8 W8A8 (ScaledLinear), at decode- and prompt-sized
batches, each checked against its reference first. One decoder layer's four matmuls are summed, so
"layer_us" is the linear time of one layer of a decode step.

    python -m bench.quant_gpu [--batch 1 16 64 256] [--sweep [gemv] [mid] [w8a8]] [--no-layers] [--budget S]
        [--w8a8-kinds fp8 int8]   (CUDA; results: bench-results naming)
    TRITON_INTERPRET=1 python -m bench.quant_gpu --sweep mid --dry-run   (CPU: tiny shapes, no timing worth reading)
    TRITON_INTERPRET=1 python -m bench.quant_gpu --sweep w8a8 --dry-run
    TRITON_INTERPRET=1 python -m bench.quant_gpu --sweep gemv --dry-run

--sweep times candidate tiles, each checked against its reference first, and prints the fastest as entries
for engine/kernels/quant_tiles.py: `gemv` the W4A16 g128 / W8A16 decode GEMV per layer shape at batch 1 (and
GEMV vs tl.dot at 2 and 4 rows), `mid` the decode tl.dot kernel at 16 and 64 rows (MID_TABLE; cut at --budget
seconds), `w8a8` the W8A8 8-bit GEMM (split K, unfused and fused) at 1, 16 and 64 rows, fp8 then int8
(W8A8_TABLE and the row thresholds; cut at --budget seconds). Each sweep times a candidate as a decode step runs
it: replayed from a CUDA graph whose launches take copies of the weight in turn (COLD_BYTES of them), so each
reads its weight from HBM with no launch or L2 flush between them.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from bench.naming import device_tag, results_path, short_commit
from engine.kernels.quant_tiles import W8A8Tiles
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


def gemv_candidates(bits: int, n: int, k: int, num_sms: int = 132) -> list:
    """The GEMV tiles the sweep tries: 32..256 outputs by 8..64 words a step, 4 or 8 warps, 2 to 16 words per
    thread a step (fewer leave the loads too small; 16 words, 32 more prefetched two steps ahead, take ~160
    registers at one row on sm_90 without spilling); K split 1..16 ways keeping two steps per split and at most
    8 programs per SM; each prefetching two steps ahead into registers, through a 3-stage cp.async pipeline,
    then one step ahead (the sweep times the table's tiles each way and unpipelined beside them). Likeliest
    first, so a sweep cut by its budget has seen them: about three programs per SM, 8 words per thread; after
    the first 12, those of them that prefetch into registers once more with 4 steps prefetched into L2, then
    wide slices on one or two warps (below)."""
    from engine.kernels.quant_tiles import GemvTiles

    kw = k * bits // 32
    grid = [
        GemvTiles(bn, bkw, split, nw)
        for bn in (32, 64, 128, 256)
        for bkw in (8, 16, 32, 64)
        for split in (1, 2, 4, 8, 16)
        for nw in (4, 8)
        if kw // split >= 2 * bkw and 2 <= bn * bkw // (32 * nw) <= 16 and -(-n // bn) * split <= 8 * num_sms
    ]

    def unlikeliness(t: GemvTiles) -> tuple[float, float]:
        programs = -(-n // t.block_n) * t.split
        return abs(math.log2(programs / (3 * num_sms))), abs(math.log2(t.block_n * t.block_kw / (32 * t.num_warps) / 8))

    ways = ((2, 1), (0, 3), (1, 1))  # (prefetch, num_stages)
    usual = [replace(t, prefetch=p, num_stages=s) for t in sorted(grid, key=unlikeliness) for p, s in ways]
    # Wide slices on one or two warps: Triton lays a tile's threads along N first, so BLOCK_N past 128 outputs
    # a warp gives each thread 8-16 outputs of a word row and each x it loads and scales serves them all: on
    # sm_90 3.2-3.3 instructions per weight at 4 bits and 2.9-3.3 at 8 (the usual tiles: 3.8 and 5.3), at
    # 72-168 registers. Few warps a program, so K splits 4-64 ways to keep 3-16 warps per SM streaming; after
    # the likeliest usual tiles, so a sweep cut by its budget still times some.
    wide = [
        GemvTiles(bn, bkw, split, nw, prefetch=p)
        for nw in (1, 2)
        for bn in (256, 512, 1024)
        for bkw in (1, 2, 4)
        for split in (4, 8, 16, 32, 64)
        for p in (1, 0)
        if bn >= 256 * nw
        and 16 <= bn * bkw // (32 * nw) <= 32
        and kw // split >= 2 * bkw
        and 3 * num_sms <= -(-n // bn) * split * nw <= 16 * num_sms
    ]
    wide.sort(key=lambda t: abs(math.log2(-(-n // t.block_n) * t.split * t.num_warps / (6 * num_sms))))
    # The likeliest register-prefetching tiles again, each also prefetching 4 steps ahead into L2.
    l2 = [replace(t, l2_ahead=4) for t in usual[:12] if t.num_stages == 1]
    return [*usual[:12], *l2, *wide, *usual[12:]]


def sweep_gemv(out: Path, budget_s: float = 360.0, dry_run: bool = False) -> None:
    """W4A16 g128 and W8A16 per-channel decode: per Llama-3-8B layer shape, the GEMV's default tiles and each
    candidate at batch 1 (each checked against the dequantized reference first) beside bf16 F.linear and the
    tl.dot kernel; then, with the best batch-1 tiles fitted to the rows, the GEMV against tl.dot at 2 and 4
    rows (whether GEMV_MAX_M should be lower). Candidates past the shape's share of `budget_s` (the budget
    over the (bits, shape) left) are skipped. Prints GEMV_TABLE entries for engine/kernels/quant_tiles.py.
    A dry run (CPU, TRITON_INTERPRET=1) takes tiny shapes and the first candidates: it checks the sweep runs."""
    from engine.kernels.quant_gemm import _num_sms, gemv_rows, gemv_tiles, mid_tiles, weight_only_matmul
    from engine.quant import pack_int32

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    shapes = [(256, 96), (512, 64)] if dry_run else SHAPES
    sms = _num_sms(torch.device(device))
    entries = []
    deadline, left = time.monotonic() + budget_s, 2 * len(shapes)
    for bits, group in ((4, 128), (8, -1)):
        totals = {"bf16": 0.0, "dot": 0.0, "default": 0.0, "best": 0.0}
        for k, n in shapes:
            stop = time.monotonic() + max(0.0, deadline - time.monotonic()) / left
            left -= 1
            w = torch.randn(n, k, device=device) * 0.02
            iw = quantize_rtn(w, bits, group)
            args = (pack_int32(iw.q, bits, 0), iw.scales.to(dtype), iw.zeros.to(dtype), bits, iw.group_size)
            nbytes = sum(t.numel() * t.element_size() for t in args[:3])
            counters = torch.zeros(-(-n // 16), dtype=torch.int32, device=device)
            wd = iw.dequantize().t().to(dtype)
            wb = w.to(dtype)
            copies, dense = _copies(*args[:3]), _copies(wb)  # once a shape: every timing cycles through them
            x = torch.randn(1, k, device=device, dtype=dtype)
            ref = F.linear(x, wd).float()
            default = gemv_tiles(bits, n, k, sms)
            # The table's tiles unpipelined, prefetching 1 and 2 steps ahead, and through 3 stages: what each gains.
            ways = {"p0": (0, 1), "p1": (1, 1), "p2": (2, 1), "s3": (0, 3)}
            ahead = {name: replace(default, prefetch=p, num_stages=s) for name, (p, s) in ways.items()}
            # ... and, as they are, prefetching into L2 2, 4 and 8 steps ahead (GemvTiles.l2_ahead).
            ahead |= {f"l2x{d}": replace(default, num_stages=1, l2_ahead=d) for d in (2, 4, 8)}
            candidates = gemv_candidates(bits, n, k, sms)
            timed = {}
            for config in dict.fromkeys([default, *ahead.values(), *(candidates[:2] if dry_run else candidates)]):
                if config != default and config not in ahead.values() and time.monotonic() > stop:
                    break
                got = weight_only_matmul(x, *args, config=config, counters=counters).float()
                err = ((got - ref).norm() / ref.norm()).item()
                assert err < 1e-2 and not counters.any(), f"{config} at K={k} N={n}: relative error {err}"
                timed[config] = _time_weight_only(x, copies, args, config, counters)
            best = min(timed, key=timed.get)
            dot_tiles = replace(mid_tiles(bits, 1, n, k, iw.group_size, sms), fragment=0)  # on the packed layout
            dot = _time_weight_only(x, copies, args, dot_tiles, counters)
            bf16 = _time_graph(_cycling(partial(F.linear, x), dense))
            for key, us in (("bf16", bf16), ("dot", dot), ("default", timed[default]), ("best", timed[best])):
                totals[key] += us
            row = {
                "sweep": f"gemv-w{bits}", "k": k, "n": n, "bf16_us": round(bf16, 2), "dot_us": round(dot, 2),
                "default": str(default), "default_us": round(timed[default], 2),
                "ways_us": {name: round(timed[c], 2) for name, c in ahead.items()}, "tried": len(timed),
                "best": str(best),
                "best_us": round(timed[best], 2), "best_weight_gbps": round(nbytes / timed[best] / 1e3, 1),
                "top5": [(round(timed[c], 2), str(c)) for c in sorted(timed, key=timed.get)[:5]],
            }  # fmt: skip
            t = f"bn{best.block_n} kw{best.block_kw} s{best.split} w{best.num_warps}"
            t += f" p{best.prefetch} st{best.num_stages}"
            depths = " / ".join(f"{timed[c]:.1f}" for c in ahead.values())
            _emit(out, row, f"gemv w{bits} K={k:5} N={n:5} m=1  best {t:25} {timed[best]:7.1f} us "
                            f"{nbytes / timed[best] / 1e3:6.0f} GB/s ({len(timed)} tried) | default "
                            f"{timed[default]:7.1f}, {'/'.join(ahead)} {depths} | tl.dot {dot:7.1f} | "
                            f"bf16 {bf16:7.1f}")  # fmt: skip
            entries.append(f"    ({bits}, {k}, {n}): {best!r},")
            for m in (2, 4):
                xm = torch.randn(m, k, device=device, dtype=dtype)
                ref = F.linear(xm, wd).float()
                rows = gemv_rows(best, m)
                got = weight_only_matmul(xm, *args, config=rows, counters=counters).float()
                assert ((got - ref).norm() / ref.norm()).item() < 1e-2
                g_us = _time_weight_only(xm, copies, args, rows, counters)
                dot_tiles = replace(mid_tiles(bits, m, n, k, iw.group_size, sms), fragment=0)
                d_us = _time_weight_only(xm, copies, args, dot_tiles, counters)
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


def mid_candidates(
    m: int, n: int, k: int, group: int, num_sms: int = 132, fragment: bool = False, packed: bool = False
) -> list:
    """The decode tl.dot kernel's tiles the sweep tries at m rows: BLOCK_M the rows' power of two, 32..256 outputs
    by 64 or 128 inputs a step (dividing K and the group), 4 or 8 warps, 3 or 4 stages, either operand order, either
    unpack, and (`fragment`: a 4-bit weight, K in blocks of 128) the weight second in the fragment layout
    (MidTiles.fragment), and with `packed` (a 4-bit weight) first the masked kinds' packed twins (MidTiles.packed:
    ~1.2 fewer instructions per weight on sm_90), keeping at most 64 accumulators a thread (BLOCK_M * BLOCK_N / (32
    * warps)). Breadth first, so a sweep cut by its budget has seen the likeliest kinds: each kernel with K split
    for about two programs per SM, then four, then unsplit (a split keeps two steps per program); kernels in one
    order for every shape (later shapes reuse the compiled kernels), widest first, then by operand kind as
    bench/quant_sass.py ranks them on sm_90 (W4 g128 at 16 rows, MID_TABLE's tiles, instructions per weight and
    thread with Triton 3.6: the weight first in the fragment layout 4.4 to 4.8, masked 4.5 to 5.5, shifted 5.8 to
    6.5; the weight second in the fragment layout 5.7 to 5.8 (5.0 to 5.1 with Triton 3.9), masked 6.1 to 6.6,
    shifted 7.4 to 7.9)."""
    from engine.kernels.quant_tiles import MidTiles

    bm = max(16, 1 << (m - 1).bit_length())
    kinds = [(True, True, 0), (True, False, 0), (False, True, 0), (False, False, 0)]
    if fragment:  # wgmma's first operand; mma.sync's second with kWidth 4 (Triton 3.6) or 2 (Triton 3.9)
        kinds[0:0] = [(True, True, 2)]
        kinds[2:2] = [(False, True, 4), (False, True, 2)]
    if packed:
        kinds = [(*kind, True) for kind in kinds if kind[1]] + [(*kind, False) for kind in kinds]
    kernels = [
        (bn, bk, nw, ns, *kind)
        for bn in (256, 128, 64, 32)
        for kind in kinds
        for nw in (4, 8)
        for bk in (128, 64)
        for ns in (3, 4)
        if group % bk == 0 and k % bk == 0 and bm * bn // (32 * nw) <= 64 and not (kind[0] and kind[2] and bk < 64)
    ]
    return _split_breadth_first(kernels, n, k, num_sms, lambda split, bn, bk, *rest: MidTiles(bm, bn, bk, split, *rest))


def _split_breadth_first(kernels: list[tuple], n: int, k: int, num_sms: int, make) -> list:
    """Tiles make(split, *kernel) for each kernel (BLOCK_N, BLOCK_K first) with K split for about two programs
    per SM, then four, then unsplit (a split keeps two steps per program), in that order, without repeats."""
    found: dict = {}  # ordered, without repeats
    for per_sm in (2, 4, 0):
        for kernel in kernels:
            bn, bk = kernel[:2]
            split = max(1, round(per_sm * num_sms / -(-n // bn)))
            if k // (bk * split) >= 2:
                found[make(split, *kernel)] = None
    return list(found)


def sweep_mid(out: Path, budget_s: float = 360.0, dry_run: bool = False) -> list[str]:
    """W4A16 g128 and W8A16 per-channel at 16 and 64 rows, the decode tl.dot kernel per Llama-3-8B layer shape
    (tiny shapes in a dry run): the default tiles and their twins with the masked unpack (either operand
    order: an A/B of the unpack at the table's own tiles), then candidates until the shape's share of `budget_s`
    (the budget over the (bits, shape, rows) left, so a cut sweep still covers every shape), each checked
    against the dequantized reference (and its counters left zeroed) first; beside bf16 F.linear, the prompt
    kernel at those rows and the GEMV at one row (the target: the weight read as fast as at batch 1). Then per
    bits and rows the layer's total (the four matmuls). Prints MID_TABLE entries (the fastest plain-layout
    tiles: WeightOnlyLinear keeps that layout) and returns them."""
    from engine.kernels.quant_gemm import _num_sms, fragment_pack, gemv_tiles, mid_tiles, tiles, weight_only_matmul
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
        totals = dict.fromkeys(
            (
                "bf16",
                "prompt",
                "gemv1",
                "default",
                "masked",
                "trans_masked",
                "masked_packed",
                "trans_masked_packed",
                "fragment2",
                "fragment4",
                "T fragment2",
                "best",
            ),
            0.0,
        )
        for k, n in shapes:
            stop = time.monotonic() + max(0.0, deadline - time.monotonic()) / left
            left -= 1
            g = torch.Generator(device=device).manual_seed(k + n + bits)
            w = torch.randn(n, k, device=device, generator=g) * 0.02
            iw = quantize_rtn(w, bits, group)
            args = (pack_int32(iw.q, bits, 0), iw.scales.to(dtype), iw.zeros.to(dtype), bits, iw.group_size)
            fragment = bits == 4 and k % 128 == 0  # the fragment layout's tiles read the weight repacked
            layouts = ((2, False), (4, False), (2, True)) if fragment else ()
            frag_args = {key: (fragment_pack(args[0], *key), *args[1:]) for key in layouts}
            # Once a shape, each weight layout's copies: every timing cycles through them.
            cold, cold_frag = _copies(*args[:3]), {key: _copies(*a[:3]) for key, a in frag_args.items()}
            nbytes = sum(t.numel() * t.element_size() for t in args[:3])
            counters = torch.zeros(-(-n // 16), dtype=torch.int32, device=device)
            x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
            ref = F.linear(x, iw.dequantize().t().to(dtype)).float()
            default = mid_tiles(bits, m, n, k, iw.group_size, sms)
            plain = replace(default, fragment=0)  # the twins below vary the table's tiles on the packed layout
            twins = {"masked": replace(plain, masked=True), "trans_masked": replace(plain, trans=True, masked=True)}
            if bits == 4:
                twins |= {f"{key}_packed": replace(twin, packed=True) for key, twin in list(twins.items())}
            for kw, trans in frag_args:
                twins[f"{'T ' if trans else ''}fragment{kw}"] = replace(plain, trans=trans, masked=True, fragment=kw)
            first = list(dict.fromkeys([default, *twins.values()]))
            timed, failed = {}, []
            more = mid_candidates(m, n, k, iw.group_size, sms, fragment, packed=bits == 4)
            candidates = [*first, *(c for c in more if c not in first)]
            for config in candidates[:2] if dry_run else candidates:
                if config not in first and time.monotonic() > stop:
                    break
                try:  # a kernel this Triton fails to compile (a crash seen on sm_90 in some versions) is skipped
                    weight = frag_args.get((config.fragment, config.trans), args)
                    got = weight_only_matmul(x, *weight, config=config, counters=counters).float()
                except Exception as e:  # noqa: BLE001 - Triton's compile errors have no common type
                    failed.append((repr(config), str(e).strip().splitlines()[-1][:200] if str(e).strip() else repr(e)))
                    print(f"mid w{bits} K={k:5} N={n:5} m={m:2}  failed to compile or run: {config!r}: {failed[-1][1]}")
                    continue
                err = ((got - ref).norm() / ref.norm()).item()
                assert err < 1e-2 and not counters.any(), f"{config} at K={k} N={n} m={m}: relative error {err}"
                copies = cold_frag.get((config.fragment, config.trans), cold)
                timed[config] = _time_weight_only(x, copies, weight, config, counters)
            if not timed:
                _emit(out, {"sweep": f"mid-w{bits}", "k": k, "n": n, "m": m, "failed": failed},
                      f"mid w{bits} K={k:5} N={n:5} m={m:2}  every candidate tried failed")  # fmt: skip
                continue
            best = min(timed, key=timed.get)
            # The fastest on the packed layout too: what the tiles would give without a fragment copy of the weight.
            plain = min((c for c in timed if not c.fragment), key=timed.get, default=None)
            wb = w.to(dtype)
            gemv1 = gemv_tiles(bits, n, k, sms)
            us = {
                "bf16": _time_graph(_cycling(partial(F.linear, x), _copies(wb))),
                "prompt": _time_weight_only(x, cold, args, tiles(m, n, k, iw.group_size)),
                "gemv1": _time_weight_only(x[:1], cold, args, gemv1, counters),
                "default": timed.get(default, float("nan")),
                **{key: timed.get(twin, float("nan")) for key, twin in twins.items()},
                "best": timed[best],
            }
            for key, v in us.items():
                totals[key] += v
            row = {
                "sweep": f"mid-w{bits}", "k": k, "n": n, "m": m, "default": repr(default), "best": repr(best),
                "best_plain": repr(plain), "best_plain_us": round(timed[plain], 2) if plain else None,
                "tried": len(timed), "failed": failed, "best_weight_gbps": round(nbytes / timed[best] / 1e3, 1),
                "top5": [(round(timed[c], 2), repr(c)) for c in sorted(timed, key=timed.get)[:5]],
            } | {f"{key}_us": round(v, 2) for key, v in us.items()}  # fmt: skip
            t = (
                f"bn{best.block_n} bk{best.block_k} s{best.split} w{best.num_warps} st{best.num_stages}"
                + (" T" if best.trans else "")
                + (" M" if best.masked else "")
                + (" P" if best.packed else "")
                + (f" F{best.fragment}" if best.fragment else "")
            )
            _emit(out, row, f"mid w{bits} K={k:5} N={n:5} m={m:2}  best {t:26} {timed[best]:7.1f} us "
                            f"{nbytes / timed[best] / 1e3:6.0f} GB/s ({len(timed)} tried) | default "
                            f"{us['default']:7.1f} (masked {us['masked']:7.1f}, T masked {us['trans_masked']:7.1f}, "
                            f"packed {us.get('masked_packed', float('nan')):7.1f}, "
                            f"T packed {us.get('trans_masked_packed', float('nan')):7.1f}, "
                            f"fragment {us.get('fragment2', float('nan')):7.1f} / "
                            f"{us.get('fragment4', float('nan')):7.1f}, "
                            f"T fragment {us.get('T fragment2', float('nan')):7.1f}) "
                            f"| prompt kernel {us['prompt']:7.1f} | GEMV m=1 {us['gemv1']:7.1f} "
                            f"| bf16 {us['bf16']:7.1f}")  # fmt: skip
            entries.append(f"    ({bits}, {k}, {n}, {best.block_m}): {best!r},")
        summary = {"sweep": f"mid-w{bits} layer total (4 matmuls), batch {m}"} | {
            f"{key}_us": round(v, 2) for key, v in totals.items()
        }
        _emit(out, summary, f"mid w{bits} layer at m={m}: bf16 {totals['bf16']:.1f} us, prompt kernel "
                            f"{totals['prompt']:.1f}, default {totals['default']:.1f} (masked {totals['masked']:.1f}, "
                            f"T masked {totals['trans_masked']:.1f}, packed {totals['masked_packed']:.1f}, "
                            f"T packed {totals['trans_masked_packed']:.1f}, fragment {totals['fragment2']:.1f} / "
                            f"{totals['fragment4']:.1f}, T fragment {totals['T fragment2']:.1f}), "
                            f"best {totals['best']:.1f}, "
                            f"GEMV at m=1 {totals['gemv1']:.1f} (best / GEMV m=1 = "
                            f"{totals['best'] / totals['gemv1']:.2f}x; shapes that failed count 0)")  # fmt: skip
    print("MID_TABLE entries (engine/kernels/quant_tiles.py):\n" + "\n".join(entries), flush=True)
    return entries


# The tiles every shape took before the split-K rule (int8 up to 16 rows on main): timed at 1 and 16 rows beside
# it ("main's" in the sweep's lines), so a table or rule that would be slower shows.
MAIN_W8A8_TILES = W8A8Tiles(16, 32, 128, 1, num_warps=4, num_stages=4)


def w8a8_candidates(bm: int, n: int, k: int, num_sms: int = 132) -> list:
    """The 8-bit GEMM's tiles the sweep tries for BLOCK_M bm: 32..256 outputs by 128 or 256 inputs a step, 4 or
    8 warps, 3 to 5 stages, unfused and fused, keeping at most 128 accumulators a thread and the stages' tiles
    within 200 KiB of shared memory (an H100 SM has 227; bf16 activations when fused). Breadth first, so a
    sweep cut by its budget has seen the likeliest kinds: each kernel with K split for about two programs per
    SM, then four, then unsplit (a split keeps two steps per program); 4 warps and 4 stages first, unfused and
    fused side by side, in one order for every shape (later shapes reuse the compiled kernels)."""
    kernels = [
        (bn, bk, nw, ns, fused)
        for nw, ns in ((4, 4), (4, 3), (8, 4), (4, 5), (8, 3))
        for bn in (64, 128, 32, 256)
        for bk in (128, 256)
        for fused in (False, True)
        if k % bk == 0 and bm * bn // (32 * nw) <= 128 and ns * ((1 + fused) * bm + bn) * bk <= 200 * 1024
    ]
    return _split_breadth_first(
        kernels, n, k, num_sms, lambda split, bn, bk, *rest: W8A8Tiles(bm, bn, bk, split, *rest)
    )


def w8a8_wide_candidates(bm: int, n: int, k: int, num_sms: int = 132) -> list:
    """Unfused tiles for a decode batch of bm rows (one program covers them all) that keep more weight in
    flight per SM than the H200 table's 64-row qkv / o_proj tiles. Those (BLOCK_N 32; sm_90 SASS of Triton
    3.6: wgmma with both operands in shared memory, cp.async 16-byte loads, the wgmma waited on every step for
    the float32 promotion) spend two thirds of each stage on the 64 x 128 activation tile, leaving at most
    8 KiB of weight a program in flight (3 stages: the loop waits for all but the next step's two cp.async
    groups) at 1.5 to 2 programs per SM, and read the activations from L2 twice the weight's bytes. So:
    BLOCK_N 128 or 256 with K split 2 to 8 ways for half a program to four per SM (activations read a quarter
    to an eighth as often; float32 partials written and read instead), and BLOCK_N 32 / 64 with 6 or 8 stages
    (the same reads, up to 7 steps of weight in flight); each within 200 KiB of shared memory. Ordered for a
    sweep its budget cuts: wide and deep alternating, each kind nearest 1.5 programs per SM first (all in
    flight at once: weight bytes in flight, not SM count, bound a latency-bound stream)."""
    wide, deep = [], []
    for bn in (128, 256):
        for split in (2, 4, 8):
            programs = -(-n // bn) * split
            if k // (128 * split) < 2 or not num_sms // 2 <= programs <= 4 * num_sms:
                continue
            for nw, ns in ((4, 4), (8, 4), (8, 3)):
                # 64 accumulators a thread at most: the fp8 promotion keeps a second set (BLOCK_N 256 on 4
                # warps compiles to 255 registers and spills in the main loop).
                if bm * bn // (32 * nw) <= 64 and ns * (bm + bn) * 128 <= 200 * 1024:
                    wide.append(W8A8Tiles(bm, bn, 128, split, nw, ns))
    for bn in (32, 64):
        for split in (1, 2):
            for ns in (8, 6):
                if k // (128 * split) >= 2 and ns * (bm + bn) * 128 <= 200 * 1024:
                    deep.append(W8A8Tiles(bm, bn, 128, split, 4, ns))

    def per_sm(t: W8A8Tiles) -> float:
        return abs(-(-n // t.block_n) * t.split / num_sms - 1.5)

    wide.sort(key=per_sm)  # stable: 4 warps before 8, more stages first, as listed
    deep.sort(key=per_sm)
    return [t for pair in itertools.zip_longest(wide, deep) for t in pair if t is not None]


def compile_w8a8(tiles, int8: bool, fused: bool, arch: int = 90):
    """The 8-bit GEMM as ScaledLinear launches it on bf16 activations (K a multiple of BLOCK_K, pointers and
    K-sized integers divisible by 16, as Triton specializes a launch at the 8B's shapes), compiled for `arch`
    without a GPU (bench/quant_sass.loop_stats reads its main loop)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels.w8a8 import _scaled_gemm_kernel

    q = "*i8" if int8 else "*fp8e4nv"
    part = "*i32" if int8 and not fused else "*fp32"
    signature = {"a_ptr": "*bf16" if fused else q, "b_ptr": q, "as_ptr": "*fp32", "bs_ptr": "*fp32",
                 "out_ptr": "*bf16", "part_ptr": part, "count_ptr": "*i32"}  # fmt: skip
    signature |= dict.fromkeys(("M", "N", "K", "sam", "span", "SPLIT"), "i32")
    constexprs = {"QMAX": 127.0 if int8 else 448.0, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n,
                  "BLOCK_K": tiles.block_k, "INT8": int8, "FUSED": fused, "EVEN_K": True, "PDL": 0}  # fmt: skip
    signature |= dict.fromkeys(constexprs, "constexpr")
    names = list(signature)
    divisible = [names.index(n) for n in signature if n.endswith("_ptr") or n in ("N", "K", "sam", "span")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    src = ASTSource(_scaled_gemm_kernel, signature, constexprs, attrs)
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_gemv(bits: int, tiles, k: int, n: int, group: int, m: int = 1, arch: int = 90):
    """The decode GEMV as WeightOnlyLinear launches it on bf16 activations (no act order; ints of 1 and pointers
    and multiples of 16 specialized as Triton specializes a launch at the 8B's shapes), compiled for `arch`
    without a GPU (bench/quant_sass.loop_stats reads its main loop)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.kernels.quant_gemm import _gemv_kernel, _split, gemv_scales

    kw = k * bits // 32
    span, split = _split(kw, tiles.block_kw, tiles.split)
    signature = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16", "perm_ptr": "*bf16",
                 "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}  # fmt: skip
    ints = {"M": m, "N": n, "KW": kw, "sxm": k, "sxk": 1, "span": span, "SPLIT": split}
    constexprs = {name: 1 for name, v in ints.items() if v == 1} | {
        "BITS": bits, "GROUP": group, "BLOCK_M": triton.next_power_of_2(m), "BLOCK_N": tiles.block_n,
        "BLOCK_KW": tiles.block_kw, "SCALES": gemv_scales(bits, k, group, span, tiles.block_kw),
        "PREFETCH": tiles.prefetch, "STAGES": tiles.num_stages,
        "EVEN": n % tiles.block_n == 0 and kw % tiles.block_kw == 0, "HAS_PERM": False, "PDL": 0,
        "L2_AHEAD": tiles.l2_ahead,
    }  # fmt: skip
    signature |= {name: "constexpr" if name in constexprs else "i32" for name in ints}
    signature |= dict.fromkeys(constexprs, "constexpr")
    names = list(signature)
    divisible = [names.index(x) for x in names if x.endswith("_ptr") or (x in ints and ints[x] % 16 == 0)]
    src = ASTSource(_gemv_kernel, signature, constexprs, {(i,): [["tt.divisibility", 16]] for i in divisible})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": tiles.num_warps})


def _time_graph(call) -> float:
    """Microseconds a call takes replayed from a CUDA graph (as a decode step runs it: no launch overhead
    beyond the graph's); off CUDA (a dry run) one call's wall time."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        call()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(call, rep=20) * 1000


# Bytes of weight copies a CUDA-graph timing cycles through: five times an H100's / H200's 50 MB L2. Replayed
# back to back on one weight, the 8B's qkv (25 MB) and o_proj (17 MB) fp8 weights stay in L2 and a tile is
# timed at L2 latency; in a decode step every layer's weight comes from HBM (the step reads gigabytes).
COLD_BYTES = 256 << 20


def _copies(*weight: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The weight's tensors (a packed weight, its scales and zeros: all of them) and copies of them, COLD_BYTES
    in all (one on the CPU: a dry run times nothing)."""
    size = sum(t.numel() * t.element_size() for t in weight)
    count = 1 if weight[0].device.type == "cpu" else max(1, -(-COLD_BYTES // size))
    return [weight, *(tuple(t.clone() for t in weight) for _ in range(count - 1))]


def _cycling(call, copies: list[tuple[torch.Tensor, ...]]):
    """call(*copy) for the next of the copies each time: a CUDA graph captured from it replays the launches on
    the copies in turn, so each reads its weight from HBM as a decode step does, with no launch or L2 flush
    between them (do_bench's way, which ranked 15-40 us one-row kernels by those and did not carry over to the
    model's graphs)."""
    turn = itertools.count()
    return lambda: call(*copies[next(turn) % len(copies)])


def _time_weight_only(x: torch.Tensor, copies: list, args: tuple, config, counters=None) -> float:
    """weight_only_matmul(x, *args) with these tiles, from a CUDA graph over the copies of its packed weight,
    scales and zeros (_copies(*args[:3]))."""
    from engine.kernels.quant_gemm import weight_only_matmul

    run = partial(weight_only_matmul, x, config=config, counters=counters)
    return _time_graph(_cycling(lambda *w: run(*w, *args[3:]), copies))


def _exact_rows(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """E4M3 values with +-448 every 16 inputs: every block of 16 or more has amax 448 (scale 1, nothing to round),
    so the Triton interpreter's fp8 rounding (half-up, no carry into the exponent) cannot differ (dry runs)."""
    x = (torch.randn(m, k, generator=g, device=g.device) * 60).to(FP8).float()
    x[:, ::16] = 448.0
    return x


def _w8a8_run(config, x: torch.Tensor, wq, ws, counters, dtype) -> torch.Tensor:
    """One W8A8 product as ScaledLinear runs it with these tiles: fused, or quantize_rows and the GEMM."""
    from engine.kernels.w8a8 import fused_scaled_matmul, quantize_rows, scaled_matmul

    if config.fused:
        return fused_scaled_matmul(x, wq, ws, dtype, config, counters)
    xq, xs = quantize_rows(x, wq.dtype)
    return scaled_matmul(xq, xs, wq, ws, dtype, config, counters)


def _w8a8_torch(x: torch.Tensor, wq, ws, dtype) -> torch.Tensor:
    """The path above the Triton thresholds: quantize_rows, then torch._scaled_mm (fp8) or torch._int_mm (int8;
    padded to 32 rows, as it takes more than 16 only) and the scaling; in a dry run (CPU) the torch reference."""
    from engine.kernels.w8a8 import quantize_rows

    xq, xs = quantize_rows(x, wq.dtype)
    if x.device.type == "cpu":
        return ((xq.float() @ wq.float().t()) * xs * ws).to(dtype)
    if wq.dtype == FP8:
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=dtype)
    pad = F.pad(xq, (0, 0, 0, max(0, 32 - x.shape[0])))
    return (torch._int_mm(pad, wq.t())[: x.shape[0]].float() * xs * ws).to(dtype)


def _w8a8_error(config, x: torch.Tensor, wq, ws, got: torch.Tensor) -> float:
    """Relative error against the tiles' reference: block_scaled_matmul at its BLOCK_K (fused), else the
    per-row product."""
    from engine.layers.linear import block_scaled_matmul

    if config.fused:
        ref = block_scaled_matmul(x.float(), wq, ws, config.block_k, torch.float32)
    else:
        xq, xs = quantize_per_row(x.float(), wq.dtype)
        ref = (xq.float() @ wq.float().t()) * xs * ws
    return ((got.float() - ref).norm() / ref.norm()).item()


def _summed(timed: dict, config) -> float:
    return sum(timed[config].values())


def sweep_w8a8(
    out: Path, budget_s: float = 360.0, kinds: tuple[str, ...] = ("fp8", "int8"), dry_run: bool = False
) -> list[str]:
    """The W8A8 8-bit GEMM at 64, then 1 and 16 rows per Llama-3-8B decode shape (tiny shapes in a dry run), fp8
    first: the rule's tiles (unfused and fused), the shipped table's, main's unsplit tiles (16 rows), the wide
    and deep tiles (w8a8_wide_candidates; 64 rows), then candidates (w8a8_candidates) until the shape's share
    of `budget_s` (fp8 shares weigh twice int8's, 64 rows twice 16), each checked against its reference
    (unfused: the per-row product; fused: block_scaled_matmul at its BLOCK_K; within 1%) with its counters
    left zeroed, then timed from a CUDA graph: unfused as quantize_rows + the GEMM, fused alone, beside
    quantize_rows + torch._scaled_mm (int8: + torch._int_mm, padded to 32 rows, and the scaling). The 16-row
    tiles serve 1 to 16 rows, so each is timed at 1 and 16 and ranked by the sum. Per kind and rows the
    layer's totals (the four matmuls), the rows at which the Triton GEMM wins (FP8_TRITON_MAX_M /
    INT8_TRITON_MAX_M), and W8A8_TABLE entries, which it prints and returns."""
    from engine.kernels.quant_gemm import _num_sms
    from engine.kernels.w8a8 import w8a8_rule, w8a8_tiles

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [(256, 96), (512, 64)] if dry_run else SHAPES
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    sms = _num_sms(torch.device(device))
    deadline = time.monotonic() + budget_s
    combos = [(kind, bm, k, n) for kind in kinds for bm in (64, 16) for k, n in shapes]
    # fp8 before int8 and 64 rows (the W1 decode batch, issue 22's fp8 goal) before 16, in order and in budget.
    weights = [(2 if kind == "fp8" else 1) * (2 if bm == 64 else 1) for kind, bm, *_ in combos]
    entries, totals = [], {}
    for i, (kind, bm, k, n) in enumerate(combos):
        stop = time.monotonic() + max(0.0, deadline - time.monotonic()) * weights[i] / sum(weights[i:])
        qdtype = FP8 if kind == "fp8" else torch.int8
        g = torch.Generator(device=device).manual_seed(k + n + bm)
        wq, ws = quantize_per_row(torch.randn(n, k, generator=g, device=device) * 0.02, qdtype)
        ws = ws.reshape(1, -1).contiguous()
        counters = torch.zeros(-(-n // 16), dtype=torch.int32, device=device)
        rows = (1, 16) if bm == 16 else (64,)
        xs = {m: _exact_rows(m, k, g) if dry_run else torch.randn(m, k, generator=g, device=device) for m in rows}
        xs = {m: x.to(dtype) for m, x in xs.items()}

        run = partial(_w8a8_run, ws=ws, counters=counters, dtype=dtype)
        copies = _copies(wq)
        rule = w8a8_rule(bm, bm, n, k, sms)
        # The shipped table's tiles third (timed as "table"); at 64 rows the wide / deep candidates before the grid.
        table = w8a8_tiles(kind, bm, n, k, sms)
        candidates = [rule, replace(rule, fused=True), table, *([MAIN_W8A8_TILES] if bm == 16 else [])]
        candidates += w8a8_wide_candidates(bm, n, k, sms) if bm == 64 else []
        candidates += w8a8_candidates(bm, n, k, sms)
        candidates = list(dict.fromkeys(candidates))
        timed, failed = {}, []
        for config in candidates[:3] if dry_run else candidates:
            if len(timed) >= 3 and time.monotonic() > stop:
                break
            try:  # a kernel this Triton fails to compile is skipped
                for m in rows:
                    err = _w8a8_error(config, xs[m], wq, ws, run(config, xs[m], wq))
                    assert err < 1e-2 and not counters.any(), f"{kind} {config} K={k} N={n} m={m}: relative error {err}"
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 - Triton's compile errors have no common type
                failed.append((repr(config), str(e).strip().splitlines()[-1][:200] if str(e).strip() else repr(e)))
                print(f"{kind} K={k:5} N={n:5} bm={bm}  failed to compile or run: {config!r}: {failed[-1][1]}")
                continue
            timed[config] = {m: _time_graph(_cycling(partial(run, config, xs[m]), copies)) for m in rows}
        if not timed:
            _emit(out, {"sweep": f"w8a8-{kind}", "k": k, "n": n, "block_m": bm, "failed": failed},
                  f"{kind} K={k:5} N={n:5} bm={bm}  every candidate tried failed")  # fmt: skip
            continue
        nbytes = n * k  # the 8-bit weight
        total = partial(_summed, timed)
        best = min(timed, key=total)
        by_kind = {f: min((c for c in timed if c.fused == f), key=total, default=None) for f in (False, True)}
        for m in rows:
            us = {
                "torch": _time_graph(_cycling(partial(_w8a8_torch, xs[m], ws=ws, dtype=dtype), copies)),
                "rule": timed.get(rule, {}).get(m, float("nan")),
                "table": timed.get(table, {}).get(m, float("nan")),
                "main": timed.get(MAIN_W8A8_TILES, {}).get(m, float("nan")),
                "unfused": timed[by_kind[False]][m] if by_kind[False] else float("nan"),
                "fused": timed[by_kind[True]][m] if by_kind[True] else float("nan"),
                "best": timed[best][m],
            }
            for key, v in us.items():
                totals.setdefault((kind, m), {}).setdefault(key, 0.0)
                totals[(kind, m)][key] += v
            row = {
                "sweep": f"w8a8-{kind}", "k": k, "n": n, "m": m, "best": repr(best), "tried": len(timed),
                "best_unfused": repr(by_kind[False]), "best_fused": repr(by_kind[True]), "failed": failed,
                "best_weight_gbps": round(nbytes / us["best"] / 1e3, 1),
                "top5": [(round(sum(timed[c].values()), 2), repr(c)) for c in sorted(timed, key=total)[:5]],
            } | {f"{key}_us": round(v, 2) for key, v in us.items()}  # fmt: skip
            t = f"bn{best.block_n} bk{best.block_k} s{best.split} w{best.num_warps} st{best.num_stages}" + (
                " fused" if best.fused else ""
            )
            torch_name = "_scaled_mm" if kind == "fp8" else "_int_mm"
            _emit(out, row, f"{kind} K={k:5} N={n:5} m={m:2}  best {t:30} {us['best']:7.1f} us "
                            f"{nbytes / us['best'] / 1e3:6.0f} GB/s ({len(timed)} tried) | unfused "
                            f"{us['unfused']:7.1f} | fused {us['fused']:7.1f} | rule {us['rule']:7.1f} | table "
                            f"{us['table']:7.1f} | main's "
                            f"{us['main']:7.1f} | "
                            f"quantize_rows+{torch_name} {us['torch']:7.1f}")  # fmt: skip
        entries.append(f"    ({kind!r}, {k}, {n}, {bm}): {best!r},")
    for (kind, m), tot in totals.items():
        summary = {"sweep": f"w8a8-{kind} layer total (4 matmuls), batch {m}"} | {
            f"{key}_us": round(v, 2) for key, v in tot.items()
        }
        _emit(out, summary, f"{kind} layer at m={m:2}: quantize_rows+torch {tot['torch']:.1f} us, rule "
                            f"{tot['rule']:.1f}, table {tot['table']:.1f}, main's tiles {tot['main']:.1f}, "
                            f"best unfused {tot['unfused']:.1f}, best fused {tot['fused']:.1f}, "
                            f"best {tot['best']:.1f} (torch / best = {tot['torch'] / tot['best']:.2f}x; shapes "
                            f"that failed count 0)")  # fmt: skip
    for kind in kinds:
        wins = [m for m in (1, 16, 64) if (kind, m) in totals and totals[kind, m]["best"] < totals[kind, m]["torch"]]
        print(
            f"{kind}: the Triton GEMM's layer total beats torch at m in {wins} "
            f"({kind.upper()}_TRITON_MAX_M: the largest of them below the first that loses)",
            flush=True,
        )
    print("W8A8_TABLE entries (engine/kernels/quant_tiles.py):\n" + "\n".join(entries), flush=True)
    return entries


def profile_w8a8(m: int, kind: str = "fp8") -> None:
    """The 8-bit GEMM alone (rows quantized beforehand) at m rows for the four 8B shapes with the tiles
    w8a8_tiles picks, twice in that order: under Nsight Compute (gpu_check.sh `fp8-ncu`) the second pass,
    `--launch-skip 4 --launch-count 4`, is the compiled kernels' steady state. Then each timed from a CUDA graph
    on weight copies that do not fit in L2 (_cycling)."""
    from engine.kernels.quant_gemm import _num_sms
    from engine.kernels.w8a8 import quantize_rows, scaled_matmul, w8a8_tiles

    qdtype = FP8 if kind == "fp8" else torch.int8
    runs = []
    for k, n in SHAPES:
        wq, ws = quantize_per_row(torch.randn(n, k, device="cuda") * 0.02, qdtype)
        xq, xs = quantize_rows(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), qdtype)
        tiles = w8a8_tiles(kind, m, n, k, _num_sms(wq.device))
        counters = torch.zeros(-(-n // 16), dtype=torch.int32, device="cuda")
        ws = ws.reshape(1, -1).contiguous()
        call = partial(scaled_matmul, xq, xs, b_scale=ws, out_dtype=torch.bfloat16, config=tiles, counters=counters)
        runs.append((k, n, tiles, partial(call, b=wq), _cycling(lambda wq, call=call: call(b=wq), _copies(wq))))
    for _ in range(2):
        for _, _, _, run, _ in runs:
            run()
    torch.cuda.synchronize()
    for k, n, tiles, _, cold in runs:
        us = _time_graph(cold)
        print(f"{kind} K={k:5} N={n:5} m={m}: {tiles!r} {us:7.1f} us {n * k / us / 1e3:6.0f} GB/s", flush=True)


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
    parser.add_argument("--budget", type=float, default=360.0, help="seconds each sweep named may take")
    parser.add_argument(
        "--w8a8-kinds", nargs="+", choices=["fp8", "int8"], default=["fp8", "int8"], help="what `w8a8` sweeps, in order"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="the `mid` (default) or `w8a8` sweep at tiny shapes, a few candidates each, on the CPU under "
        "TRITON_INTERPRET=1 (checks the sweep runs; its times mean nothing)",
    )
    parser.add_argument("--no-layers", action="store_true", help="skip the per-layer table (sweep only)")
    parser.add_argument(
        "--w8a8-profile",
        type=int,
        metavar="ROWS",
        help="only the fp8 GEMM at ROWS rows, the four shapes twice with the shipped tiles (for ncu), then timed",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.dry_run:
        out = Path(args.out or results_path("quant-gpu-dry-run", "cpu"))
        out.parent.mkdir(parents=True, exist_ok=True)
        for name in args.sweep or ["mid"]:
            if name == "w8a8":
                sweep_w8a8(out, args.budget, tuple(args.w8a8_kinds), dry_run=True)
            elif name == "gemv":
                sweep_gemv(out, args.budget, dry_run=True)
            else:
                sweep_mid(out, args.budget, dry_run=True)
        return
    if args.w8a8_profile:
        profile_w8a8(args.w8a8_profile)
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
            {
                "gemv": partial(sweep_gemv, budget_s=args.budget),
                "mid": partial(sweep_mid, budget_s=args.budget),
                "w8a8": partial(sweep_w8a8, budget_s=args.budget, kinds=tuple(args.w8a8_kinds)),
            }[name](out)
    print(f"device tag {device_tag('cuda')}: {out}")


if __name__ == "__main__":
    main()
