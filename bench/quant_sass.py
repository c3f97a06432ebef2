"""The decode tl.dot kernel (engine/kernels/quant_gemm.py _mid_kernel) compiled for an sm_90 GPU without one:
Triton's whole pipeline and the ptxas its wheel ships, then the SASS of the main loop counted. At decode sizes
the kernel is bound by the instructions it issues per weight (unpacking, conversion, the operand's trip through
shared memory), so the count per weight and thread ranks tiles before a GPU does.

    python -m bench.quant_sass [--bits 4 8] [--rows 16 64] [--arch 90]
    python -m bench.quant_sass --gemv [--bits 4 8] [--wide 4]   (the decode GEMV: GEMV_TABLE and wide tiles)

Each line: a MID_TABLE entry's tiles with either operand order and either unpack (trans, masked), and for 4 bits
the fragment layouts (fragment: the unpacked tile in the operand's registers, either order) and the packed
unpack of each masked kind (packed: two fields an instruction), at its shape,
the main loop's instructions per weight per thread, shared memory, spills, the loop's shared-memory traffic
(STS / LDS / LDSM, barriers, LDGSTS: cp.async copies of the pipeliner) and top opcodes.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import tempfile
from dataclasses import replace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels.quant_tiles import MidTiles

_POINTERS = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "perm_ptr", "out_ptr", "part_ptr", "count_ptr")


def compile_mid(
    bits: int, tiles: MidTiles, k: int = 4096, n: int = 4096, group: int = 128, m: int = 16, arch: int = 90
):
    """The kernel as a bf16 weight-only linear launches it on m rows of a [k, n] weight in groups of `group` (no
    act order; ints of 1 and multiples of 16 specialized as Triton specializes the launch), compiled for
    `arch`."""
    from engine.kernels.quant_gemm import _mid_kernel, _split

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compiling for a GPU needs the kernels Triton JITs: unset TRITON_INTERPRET")
    span, split = _split(k, tiles.block_k, tiles.split)
    ptr = {"qw_ptr": "*i32", "part_ptr": "*fp32", "count_ptr": "*i32"}
    signature = {name: ptr.get(name, "*bf16") for name in _POINTERS}
    ints = {
        "M": m,
        "N": n,
        "K": k,
        "sxm": k,
        "sxk": 1,
        "span": span,
        "SPLIT": split,
        "GROUP": group,
        "sqn": k * bits // 32,
    }
    constexprs = {name: 1 for name, v in ints.items() if v == 1} | {
        "BITS": bits, "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
        "SCALE_AT_END": group % span == 0, "TRANS": tiles.trans, "HAS_PERM": False, "PRECISION": "tf32",
        "MASKED": tiles.masked, "FRAGMENT": tiles.fragment, "PACKED": tiles.packed, "PDL": 0,
    }  # fmt: skip
    signature |= {name: "constexpr" if name in constexprs else "i32" for name in ints}
    signature |= {name: "constexpr" for name in constexprs if name not in signature}
    names = list(signature)
    # Pointers 16-byte aligned, as torch allocates them.
    divisible = [names.index(x) for x in names if x.endswith("_ptr") or (x in ints and ints[x] % 16 == 0)]
    src = ASTSource(_mid_kernel, signature, constexprs, {(i,): [["tt.divisibility", 16]] for i in divisible})
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _cubin_tool(kernel, tool: str, *flags: str) -> str:
    """The standard output of one of the CUDA tools Triton's wheel ships (nvdisasm, cuobjdump) on the kernel's
    cubin."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([path, *flags, f.name], capture_output=True, text=True, check=True).stdout


def loop_stats(kernel) -> tuple[int, collections.Counter]:
    """The largest loop of the kernel's SASS (label to backward branch): its instruction count and opcodes."""
    lines = _cubin_tool(kernel, "nvdisasm", "-c").splitlines()
    instruction = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
    labels, best = {}, (0, 0, 0)
    for i, line in enumerate(lines):
        if found := re.match(r"\s*\.L_x_(\d+):", line):
            labels[found[1]] = i
        if (found := re.search(r"BRA `\(\.L_x_(\d+)\)", line)) and labels.get(found[1], i) < i:
            start = labels[found[1]]
            best = max(best, (sum(1 for x in lines[start : i + 1] if instruction.match(x)), start, i))
    _, start, end = best
    ops = collections.Counter(m[1] for x in lines[start : end + 1] if (m := instruction.match(x)))
    return best[0], ops


def per_weight(
    bits: int, tiles: MidTiles, k: int = 4096, n: int = 4096, group: int = 128, arch: int = 90
) -> tuple[float, object, collections.Counter]:
    """Main-loop instructions per weight per thread (a step covers BLOCK_N x BLOCK_K weights), the compiled
    kernel and the loop's opcodes."""
    kernel = compile_mid(bits, tiles, k, n, group, tiles.block_m, arch)
    count, ops = loop_stats(kernel)
    return count / (tiles.block_n * tiles.block_k / (32 * tiles.num_warps)), kernel, ops


def registers(kernel) -> int:
    """Registers a thread of the compiled kernel takes."""
    return int(re.search(r"REG:(\d+)", _cubin_tool(kernel, "cuobjdump", "-res-usage"))[1])


def gemv_report(bits_list: list[int], arch: int, wide: int) -> None:
    """Per GEMV_TABLE entry (and the first `wide` one- and two-warp candidates of the sweep at its shape): the
    main loop's instructions per weight and thread at one and two rows, registers and spills."""
    from bench.quant_gpu import compile_gemv, gemv_candidates
    from engine.kernels.quant_tiles import GEMV_TABLE

    for (bits, k, n), listed in GEMV_TABLE.items():
        if bits not in bits_list:
            continue
        group = 128 if bits == 4 else k  # as the sweep quantizes: W4 g128, W8 per channel
        extra = [t for t in gemv_candidates(bits, n, k) if t.num_warps < 4][:wide]
        for name, tiles in [("table", listed), *(("wide", t) for t in extra)]:
            per_thread = tiles.block_n * tiles.block_kw * 32 // bits // (32 * tiles.num_warps)
            line = []
            for m in (1, 2):
                kernel = compile_gemv(bits, tiles, k, n, group, m, arch)
                count, ops = loop_stats(kernel)
                line.append(f"m={m} {count / per_thread:5.2f}/weight {registers(kernel):3} regs "
                            f"{ops['STL'] + ops['LDL']} spills")  # fmt: skip
            print(f"w{bits} K={k:5} N={n:5} {name:5} {tiles}: " + " | ".join(line), flush=True)


def main() -> None:
    from engine.kernels.quant_tiles import MID_TABLE

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--gemv", action="store_true", help="the decode GEMV's table instead (and --wide candidates)")
    parser.add_argument("--wide", type=int, default=4, help="with --gemv: the sweep's one-/two-warp tiles per shape")
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}")
    if args.gemv:
        gemv_report(args.bits, args.arch, args.wide)
        return
    for (bits, k, n, m), listed in MID_TABLE.items():
        if bits not in args.bits or m not in args.rows:
            continue
        group = 128 if bits == 4 else k  # as the sweep quantizes: W4 g128, W8 per channel
        kinds = [(trans, masked, 0, False) for trans, masked in itertools.product((False, True), repeat=2)]
        if bits == 4:  # the fragment layouts; the packed unpack, of either layout
            kinds += [(False, True, 2, False), (False, True, 4, False), (True, True, 2, False)]
            kinds += [(trans, True, fragment, True) for trans, masked, fragment, _ in kinds if masked]
        for trans, masked, fragment, packed in kinds:
            tiles = replace(listed, trans=trans, masked=masked, fragment=fragment, packed=packed)
            try:
                cost, kernel, ops = per_weight(bits, tiles, k, n, group, args.arch)
            except Exception as e:  # noqa: BLE001 - Triton's compile errors have no common type
                print(f"w{bits} K={k} N={n} {tiles}: failed: {str(e).strip().splitlines()[-1][:120]}")
                continue
            smem = {op: c for op, c in ops.items() if op.startswith(("STS", "LDS", "LDSM", "BAR", "LDGSTS"))}
            print(
                f"w{bits} K={k} N={n} {tiles}: {cost:5.2f} per weight per thread, smem {kernel.metadata.shared} B, "
                f"spills {ops['STL'] + ops['LDL']}; {smem}; top: "
                + ", ".join(f"{op} {c}" for op, c in ops.most_common(8))
            )


if __name__ == "__main__":
    main()
