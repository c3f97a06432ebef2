"""Whether the paged decode and prefill kernels (engine/kernels/decode.py, attention.py) compile with a
16-bit (bf16) KV cache to the same code as at an earlier commit: TTIR, TTGIR, LLVM IR and PTX for sm_90 at
Llama-3-8B's attention shape (32 / 8 heads, head dim 128), with the launch arguments their wrappers pass
(fp8-only constexprs left out, as the wrappers leave them for a 16-bit cache). Compiles on the CPU, each
side in its own process from its own copy of engine/; debug info stripped as in bench/store_ir.py.

    python -m bench.attention_ir REV     # e.g. the commit before a change to the kernels
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("ttir", "ttgir", "llir", "ptx")
# kernel -> (module, function, constexprs, launch options): what paged_decode / paged_prefill pass.
SHAPE = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_D=128, PRECISION="tf32")
KERNELS = {
    "decode": ("engine.kernels.decode", "_decode_kernel", dict(SHAPE, BLOCK_G=16, BLOCK_N=64, NUM_SPLITS=1)),
    "decode-split4": ("engine.kernels.decode", "_decode_kernel", dict(SHAPE, BLOCK_G=16, BLOCK_N=64, NUM_SPLITS=4)),
    "prefill": ("engine.kernels.attention", "_prefill_kernel", dict(SHAPE, BLOCK_M=64, BLOCK_N=64, FOLD_SCALE=True)),
}


def compile_here() -> dict[str, dict[str, str]]:
    """The kernels' IR for a bf16 model over a bf16 cache, from the engine/ on sys.path."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    result = {}
    for name, (module, fn_name, constexprs) in KERNELS.items():
        fn = getattr(importlib.import_module(module), fn_name)
        signature = inspect.signature(fn.fn).parameters
        params = list(signature)
        sig, attrs = {}, {}
        for i, p in enumerate(params):
            if p.isupper() or p in ("k_scale_ptr", "v_scale_ptr"):
                sig[p] = "constexpr"
            elif p.endswith("_ptr"):
                sig[p] = {"bt_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32"}.get(
                    p, "*fp32" if p.startswith("part_") else "*bf16"
                )
            else:
                sig[p] = "fp32" if p == "qk_scale" else "i32"
            if sig[p].startswith("*") or p.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]  # what triton specializes at launch
        # The constexprs a wrapper leaves out (QUERIES, the fp8 ones) take their defaults, as at a launch.
        defaults = {name: p.default for name, p in signature.items() if p.default is not p.empty}
        values = dict(defaults, **constexprs, k_scale_ptr=None, v_scale_ptr=None)
        cx = {(params.index(k),): v for k, v in values.items() if k in params}
        src = ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
        result[name] = {stage: kernel.asm[stage] for stage in STAGES}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the earlier commit")
    args = parser.parse_args()
    from bench.store_ir import _code, report

    with tempfile.TemporaryDirectory() as tmp:
        sides = {}
        for side in ("old", "new"):
            # The same path for both copies, one after the other, so that nothing but the code differs.
            tree = Path(tmp) / "tree"
            subprocess.run(["rm", "-rf", str(tree)], check=True)
            tree.mkdir()
            rev = args.rev if side == "old" else None
            if rev:
                archive = subprocess.run(["git", "archive", rev, "engine"], capture_output=True, check=True, cwd=ROOT)
                subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
            else:
                subprocess.run(["cp", "-r", str(ROOT / "engine"), str(tree)], check=True)
            code = f"import json, sys; sys.path[:0] = [{str(tree)!r}, {str(ROOT)!r}]\n"
            code += "from bench.attention_ir import compile_here; print(json.dumps(compile_here()))"
            env = dict(os.environ, TRITON_CACHE_DIR=str(Path(tmp) / f"cache-{side}"))
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
            sides[side] = json.loads(out.stdout.strip().splitlines()[-1])
    same = True
    for name in KERNELS:
        for stage in STAGES:
            a, b = (_code(stage, sides[side][name][stage]) for side in ("old", "new"))
            same &= report(f"{name} bf16 cache {stage}", a, b)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
