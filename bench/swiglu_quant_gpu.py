"""The quantizing SwiGLU's two forms on the GPU: whole rows in registers against two-pass column steps, by
batch size (Llama-3-8B's intermediate size 14336, fp8), with the bytes each call must move and the rate that
gives. engine/kernels/activation.py WHOLE_ROW_MAX_ROWS is where the whole rows stop paying.

    python3 bench/swiglu_quant_gpu.py [--inter 14336] [--rows 1 16 64 ...] [--out FILE.jsonl]

Each call reads [rows, 2 * inter] bfloat16 and writes [rows, inter] fp8 plus a float32 scale a row; timed with
triton.testing.do_bench (L2 flushed between calls), median of its repeats, after ~1 s of matmuls bring the clocks
up. Both forms are checked equal first.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from bench.naming import short_commit
from engine.kernels.activation import WHOLE_ROW_MAX_ROWS, silu_and_mul

FP8 = torch.float8_e4m3fn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    # The clocks up first (an idle H200 reads 345 MHz): the first shapes timed otherwise run slower than later ones.
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        w @ w
    torch.cuda.synchronize()
    commit = short_commit()
    print(f"rows  whole us  steps us  default  (GB/s whole / steps)   WHOLE_ROW_MAX_ROWS {WHOLE_ROW_MAX_ROWS}")
    for rows in a.rows:
        x = torch.randn(rows, 2 * a.inter, device="cuda", dtype=torch.bfloat16) * 4
        (qw, sw), (qs, ss) = silu_and_mul(x, quant=FP8, whole_row=True), silu_and_mul(x, quant=FP8, whole_row=False)
        assert torch.equal(qw.view(torch.int8), qs.view(torch.int8)) and torch.equal(sw, ss), rows
        moved = rows * (2 * a.inter * 2 + a.inter + 4)
        us = {
            form: 1e3 * do_bench(lambda x=x, w=whole: silu_and_mul(x, quant=FP8, whole_row=w), return_mode="median")
            for form, whole in (("whole", True), ("steps", False))
        }
        default = "whole" if rows <= WHOLE_ROW_MAX_ROWS else "steps"
        print(
            f"{rows:5d} {us['whole']:9.1f} {us['steps']:9.1f}  {default:7s}"
            f"  ({moved / us['whole'] / 1e3:6.0f} / {moved / us['steps'] / 1e3:6.0f})"
        )
        row = {"mode": "swiglu-quant", "inter": a.inter, "rows": rows, "bytes": moved, "whole_us": us["whole"]}
        row.update(steps_us=us["steps"], default=default, device_name=torch.cuda.get_device_name(), commit=commit)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
