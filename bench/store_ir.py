"""Whether the fused q/k/v store kernel (engine/kernels/qkv_store.py) compiles to the same code as at an
earlier commit: TTIR, TTGIR, LLVM IR and PTX for sm_90, with a 16-bit (bf16) cache and an fp8 (e4m3) one,
switches that the earlier source lacks left at their defaults. Compiles on the CPU (no GPU needed);
debug line info is stripped before the comparison, since moving code changes it.

    python -m bench.store_ir REV     # e.g. the commit before a change to the kernel
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = "engine/kernels/qkv_store.py"
POINTERS = {"pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
# Llama-3-8B's shape: 32 q heads, 8 KV heads, head dim 128; norm and rotary on.
CONSTEXPRS = dict(NORM=True, ROTARY=True, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def compile_store(module, cache: str) -> dict[str, str]:
    """The kernel's IR and PTX for a bf16 model over a `cache` ("*bf16" or "*fp8e4nv") KV cache."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = module._qkv_store_kernel
    params = list(inspect.signature(fn.fn).parameters)
    fp8 = cache != "*bf16"
    sig = {}
    for p in params:
        if p.isupper():
            sig[p] = "constexpr"
        elif p.endswith("_ptr"):
            scales = "*fp32" if p in ("ks_ptr", "vs_ptr") else "*bf16"
            sig[p] = POINTERS.get(p, cache if p in ("kc_ptr", "vc_ptr") else scales)
        else:
            sig[p] = "fp32" if p == "eps" else "i32"
    constexprs = dict(CONSTEXPRS, FP8_MAX=448.0 if fp8 else 0.0, PDL=0)
    if not fp8:  # prepare_and_store passes None (a constexpr) for the scales of a 16-bit cache
        sig["ks_ptr"] = sig["vs_ptr"] = "constexpr"
        constexprs.update(ks_ptr=None, vs_ptr=None)
    cx = {(params.index(k),): v for k, v in constexprs.items() if k in params}  # an older tree may lack PDL
    src = ASTSource(fn=fn, signature=sig, constexprs=cx)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, enable_fp_fusion=False))
    return {stage: kernel.asm[stage] for stage in ("ttir", "ttgir", "llir", "ptx")}


def _code(stage: str, text: str) -> str:
    """The text without its debug info: locations and the value names taken from them (MLIR), !dbg metadata
    (LLVM), the .loc lines and .debug sections (PTX)."""
    if stage == "ptx":
        text = text.split(".section\t.debug")[0]
        return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith((".loc", ".file")))
    if stage == "llir":
        text = "\n".join(line for line in text.splitlines() if not line.startswith("!"))
        return re.sub(r", !dbg ![0-9]+", "", text)
    text = re.sub(r"loc\([^\n]*?\)|#loc[0-9]*( = [^\n]*)?", "", text)
    # MLIR names values after the source's variables (named locations): number them by first use instead.
    names: dict[str, str] = {}
    text = re.sub(r"%[\w.]+", lambda m: names.setdefault(m.group(), f"%v{len(names)}"), text)
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())


def report(label: str, old: str, new: str) -> bool:
    """Print whether two stripped IR texts are the same; return it."""
    print(f"{label}: {'identical' if old == new else 'DIFFERENT'} ({len(old.splitlines())} lines)")
    return old == new


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the earlier commit")
    args = parser.parse_args()
    old = subprocess.run(["git", "show", f"{args.rev}:{SOURCE}"], capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        # The same file name for both, so that nothing but the code differs.
        (Path(tmp) / "old").mkdir()
        (Path(tmp) / "old" / "qkv_store.py").write_text(old)
        (Path(tmp) / "new").mkdir()
        (Path(tmp) / "new" / "qkv_store.py").write_text(Path(SOURCE).read_text())
        same = True
        for cache in ("*bf16", "*fp8e4nv"):
            modules = [_load(Path(tmp) / side / "qkv_store.py", f"store_{side}") for side in ("old", "new")]
            asm = [compile_store(module, cache) for module in modules]
            for stage in asm[0]:
                a, b = (re.sub(r"store_(old|new)|/tmp\S*qkv_store\.py", "", _code(stage, x[stage])) for x in asm)
                same &= report(f"{cache[1:]} cache {stage}", a, b)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
