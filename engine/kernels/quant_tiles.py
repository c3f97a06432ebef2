"""The tiles of the quantized-linear kernels (engine/kernels/quant_gemm.py, engine/kernels/w8a8.py): one table.

`python -m bench.quant_gpu --sweep` (gpu_check.sh `quant-kernels`; `QUANT_SWEEP=mid ... quant-sweep` for the
decode tl.dot kernel alone) times candidates per Llama-3-8B layer shape, each checked against its reference
first, and prints the fastest as entries for the tables below; shapes not listed use the rules in the kernel
modules (quant_gemm.gemv_tiles, quant_gemm.mid_tiles, w8a8.w8a8_tiles).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tiles:
    """One tl.dot launch's shape: BLOCK_M x BLOCK_N outputs per program, BLOCK_K inputs per loop step, K split
    over `split` programs; num_warps and num_stages as Triton takes them (stages: loads in flight per program)."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3

    def check(self, k: int, group: int) -> None:
        if group % self.block_k or k % (self.block_k * self.split):
            raise ValueError(f"{self} does not tile K={k} in groups of {group}")


@dataclass(frozen=True)
class MidTiles(Tiles):
    """The decode tl.dot kernel (quant_gemm._mid_kernel): one program covers all rows (M <= block_m), BLOCK_N
    outputs, BLOCK_K inputs a step, K split over at most `split` programs. `trans`: compute out^T = W^T x^T,
    the dequantized weight as tl.dot's first operand (on sm_90 wgmma reads it from registers). `masked`: unpack
    a field with one AND and one FMA from half words ORed into 2**23 once (the GEMV's way), not with a shift,
    an extract, an OR and a subtraction. `fragment` (2 or 4; 0: off): the 4-bit weight repacked
    (quant_gemm.fragment_pack with this kwidth) so that the words a thread loads unpack, masked, into the
    registers of tl.dot's second operand for mma.sync as Triton lays it out (kWidth 2 with Triton 3.9, 4
    with 3.6; BLOCK_K 32 to 128), or with `trans` of its first operand for wgmma (2; BLOCK_K 64 or 128, N a
    multiple of 16): no trip of the unpacked tile through shared memory; K in blocks of 128. The caller
    passes the weight in that layout (fragment_pack with this kwidth and trans; WeightOnlyLinear keeps a copy
    in each layout MID_TABLE names for its shape). `packed`: unpack two 4-bit
    fields an instruction in the activations' 16-bit type (quant_gemm._paired_fields: inline PTX), about 1.2
    fewer instructions per weight than masked on sm_90; where it cannot apply (8 bits, float32 activations,
    the interpreter) the kernel unpacks masked, the same weights. On plain-layout tiles it ran the 8B's decode
    slower on the H200 (16 rows 5.07 -> 8.0 ms a step; bench/results/2026-12-03-h200-e7833bb-mid-packed.md: with
    the weight second its tile's trip through shared memory turns from LDSM into scalar LDS); MID_TABLE uses it
    on two trans fragment tiles, where the sweep timed it fastest."""

    trans: bool = False
    masked: bool = False
    fragment: int = 0
    packed: bool = False

    def check(self, k: int, group: int) -> None:
        # Any split: the kernel's spans are whole steps, the last one shorter.
        if group % self.block_k or k % self.block_k or self.block_m < 16:
            raise ValueError(f"{self} does not tile K={k} in groups of {group}")
        # The layouts (quant_gemm.fragment_pack): plain for mma.sync, kWidth 2 or 4; trans for wgmma, kWidth 2.
        blocks, kwidths = ((64, 128), (2,)) if self.trans else ((32, 64, 128), (2, 4))
        if self.fragment and (k % 128 or self.block_k not in blocks or self.fragment not in kwidths):
            raise ValueError(f"{self}: not a fragment layout's tiles (K in blocks of 128; BLOCK_K, kWidth)")


@dataclass(frozen=True)
class W8A8Tiles(Tiles):
    """The 8-bit GEMM (w8a8._scaled_gemm_kernel): BLOCK_M x BLOCK_N outputs per program, BLOCK_K inputs a step,
    K split over at most `split` programs (then one program covers every row: M <= block_m). `fused`: the
    kernel takes the unquantized activations and quantizes them itself per row and BLOCK_K step (no
    quantize_rows launch; a checkpoint's static input scale keeps the unfused path whatever this says)."""

    fused: bool = False


@dataclass(frozen=True)
class GemvTiles:
    """One decode GEMV launch (no tl.dot): BLOCK_N outputs per program, `block_kw` packed int32 rows of the
    weight per loop step (block_kw * 32 / bits inputs), the K rows split over `split` programs. `prefetch`: how
    many steps ahead (0 to 2) a step loads words and scales into registers, so loads stay in flight while a
    warp computes (with neither this nor stages a warp waits a full memory latency every step); `num_stages`
    above 1: Triton's pipeliner copies them num_stages - 1 steps ahead into shared memory instead (cp.async,
    a barrier a step). `l2_ahead` (0: off): each step also prefetches the words, scales and zeros of the step
    that many ahead into L2 (prefetch.global.L2, no registers held), and a program prefetches its first
    l2_ahead steps before it waits for the kernel before it (quant_gemm._gemv_kernel)."""

    block_n: int
    block_kw: int
    split: int
    num_warps: int = 4
    prefetch: int = 2
    num_stages: int = 1
    l2_ahead: int = 0


@dataclass(frozen=True)
class RowTiles:
    """The activation quantizer: one program per row, `block` inputs per loop step."""

    block: int
    num_warps: int = 4


# W4A16 / W8A16: batches of at most GEMV_MAX_M rows take the GEMV (the kernel keeps one accumulator per row,
# 4 rows at most). Its arithmetic per weight is the unpacking and conversion (shared by the rows) plus one FMA
# per row; an H100 streams ~25 int4 weights per SM cycle from HBM and issues 128 FP32/INT operations per SM
# cycle, so a few rows turn it compute-bound, where tl.dot's tensor cores (16 rows whatever M is) win. The
# H100 sweep of the GEMV that prefetches its loads (bench/results/2026-11-26-h100-4b86bf1-quant-gemv.jsonl, the
# 8B's four decode matmuls): at 2 rows the W4 GEMV still wins on all four (N 28672: 56.9 us against tl.dot's
# 67.8; K 14336: 32.0 against 40.1), while tl.dot wins all four for W8 (the tiles tuned for one row hold twice
# the prefetched words at two). So: bits -> the most rows the GEMV takes.
GEMV_MAX_M: dict[int, int] = {4: 2, 8: 1}

# (bits, K, N) -> the GEMV's tiles at one row (gemv_rows fits them to m). W4: the H200 sweep that times every launch
# from a CUDA graph over 256 MiB of weight copies, `QUANT_SWEEP=gemv QUANT_BUDGET=200 bash bench/gpu_check.sh
# sweep-ab` (bench/results/2026-12-03-h200-5b25bb0-gemv-sweep.jsonl): the four 8B matmuls of a layer at one row
# 59.4 us against 61.6 for the H100's tiles and bf16's 121.7 (2.05x); the whole 8B decode, the H100's tiles against
# these, alternated in the same call: one row 2.836 / 2.839 -> 2.769 / 2.773 ms a step, two rows 3.799 / 3.803 ->
# 3.712 / 3.708. W8: the H100 sweep's grid, `QUANT_BUDGET=180 bash bench/gpu_check.sh quant-gemv`
# (bench/results/2026-11-26-h100-4b86bf1-quant-gemv.jsonl; a layer's four matmuls 128.2 us, bf16 205.0).
GEMV_TABLE: dict[tuple[int, int, int], GemvTiles] = {
    (4, 4096, 6144): GemvTiles(block_n=32, block_kw=64, split=2, num_warps=8, prefetch=1),
    (4, 4096, 4096): GemvTiles(block_n=32, block_kw=64, split=4, num_warps=4, prefetch=1),
    (4, 4096, 28672): GemvTiles(block_n=64, block_kw=32, split=1, num_warps=4, prefetch=1),
    (4, 14336, 4096): GemvTiles(block_n=32, block_kw=64, split=4, num_warps=8, prefetch=1),
    (8, 4096, 6144): GemvTiles(block_n=64, block_kw=32, split=4, num_warps=8, prefetch=2),
    (8, 4096, 4096): GemvTiles(block_n=32, block_kw=64, split=4, num_warps=4, prefetch=2),
    (8, 4096, 28672): GemvTiles(block_n=64, block_kw=32, split=1, num_warps=8, prefetch=0, num_stages=3),
    (8, 14336, 4096): GemvTiles(block_n=64, block_kw=32, split=8, num_warps=8, prefetch=2),
}

# W4A16 / W8A16 decode batches above GEMV_MAX_M[bits] and up to MID_MAX_M rows take the decode tl.dot kernel, larger
# ones the prompt kernel. At these sizes the product is bound by reading the weight (K * N * bits / 8 bytes),
# as at one row, so one program covers every row and each weight tile is dequantized once.
MID_MAX_M = 64

# (bits, K, N, BLOCK_M) -> the decode tl.dot kernel's tiles (BLOCK_M 16 / 32 / 64: the next power of two >= the rows,
# at least 16). W4: the H200 sweep that times every launch from a CUDA graph over 256 MiB of weight copies, per shape
# the fastest of any layout, `QUANT_SWEEP=mid QUANT_BUDGET=140 bash bench/gpu_check.sh sweep-ab`
# (bench/results/2026-12-03-h200-fa99455-mid-sweep.jsonl): a layer's four matmuls at 16 rows 127.8 us for the previous
# (plain-layout) tiles against 94.2 (bf16 120.3), at 64 rows 162.6 against 155.9 (bf16 127.1). The 16-row tiles and
# two of the 64-row ones read the trans fragment layout (quant_gemm.fragment_pack), of which WeightOnlyLinear keeps a
# copy beside the packed weight (quant_gemm.fragment_layouts). The whole 8B decode, the previous table against this
# one with the copies, alternated in one H200 call (bench/results/2026-12-03-h200-fa99455-fragment-copies-ab-*.jsonl):
# 16 rows 5.086 / 5.063 -> 4.035 / 4.030 ms a step, 64 rows 6.527 / 6.518 -> 6.370 / 6.350, one row (the GEMV)
# level. W8: the H100 sweep of plain-layout tiles (bench/results/2026-11-26-h100-efbce94-quant-sweep-mid.jsonl; a
# layer's four matmuls at 16 rows 152.3 -> 148.9 us, at 64 rows 192.6 -> 172.3). Shapes not listed (and 17-32 rows)
# take quant_gemm.mid_tiles' rule (256 outputs on 4 warps up to 32 rows, 128 on 8 at 64, the weight as first
# operand, masked, K split until about two programs per SM).
MID_TABLE: dict[tuple[int, int, int, int], MidTiles] = {
    (4, 4096, 6144, 16): MidTiles(
        block_m=16, block_n=128, block_k=128, split=6, num_warps=8, num_stages=3, trans=True, masked=True, fragment=2
    ),
    (4, 4096, 4096, 16): MidTiles(
        block_m=16,
        block_n=256,
        block_k=64,
        split=16,
        num_warps=4,
        num_stages=3,
        trans=True,
        masked=True,
        fragment=2,
        packed=True,
    ),
    (4, 4096, 28672, 16): MidTiles(
        block_m=16,
        block_n=256,
        block_k=128,
        split=2,
        num_warps=4,
        num_stages=3,
        trans=True,
        masked=True,
        fragment=2,
        packed=True,
    ),
    (4, 14336, 4096, 16): MidTiles(
        block_m=16, block_n=64, block_k=128, split=8, num_warps=4, num_stages=3, trans=True, masked=True, fragment=2
    ),
    (4, 4096, 6144, 64): MidTiles(
        block_m=64, block_n=128, block_k=128, split=6, num_warps=4, num_stages=3, trans=True, masked=True, fragment=2
    ),
    (4, 4096, 4096, 64): MidTiles(
        block_m=64, block_n=64, block_k=128, split=4, num_warps=4, num_stages=4, trans=True, masked=True, fragment=2
    ),
    (4, 4096, 28672, 64): MidTiles(
        block_m=64, block_n=128, block_k=128, split=1, num_warps=4, num_stages=3, masked=True
    ),
    (4, 14336, 4096, 64): MidTiles(
        block_m=64, block_n=128, block_k=128, split=8, num_warps=4, num_stages=3, masked=True
    ),
    (8, 4096, 6144, 16): MidTiles(
        block_m=16, block_n=128, block_k=128, split=6, num_warps=4, num_stages=3, trans=True, masked=True
    ),
    (8, 4096, 4096, 16): MidTiles(
        block_m=16, block_n=64, block_k=128, split=4, num_warps=4, num_stages=4, trans=True, masked=True
    ),
    (8, 4096, 28672, 16): MidTiles(
        block_m=16, block_n=256, block_k=64, split=2, num_warps=4, num_stages=4, trans=True, masked=True
    ),
    (8, 14336, 4096, 16): MidTiles(block_m=16, block_n=64, block_k=128, split=4, num_warps=4, num_stages=4, trans=True),
    (8, 4096, 6144, 64): MidTiles(
        block_m=64, block_n=128, block_k=128, split=6, num_warps=4, num_stages=3, masked=True
    ),
    (8, 4096, 4096, 64): MidTiles(
        block_m=64, block_n=64, block_k=128, split=4, num_warps=4, num_stages=4, trans=True, masked=True
    ),
    (8, 4096, 28672, 64): MidTiles(
        block_m=64, block_n=128, block_k=128, split=1, num_warps=4, num_stages=3, masked=True
    ),
    (8, 14336, 4096, 64): MidTiles(
        block_m=64, block_n=64, block_k=128, split=4, num_warps=4, num_stages=4, trans=True, masked=True
    ),
}

# (bits, K, N, BLOCK_M) -> the decode tl.dot kernel's tiles on the packed weight, for each MID_TABLE entry that reads a
# fragment layout: taken when the weight keeps no copy in it (EngineConfig.quant_fragment_copies off;
# quant_gemm.table_tiles). The same H200 sweep's fastest plain-layout tiles (its rows' best_plain); that table, swept in
# the model without copies against the H100's (bench/results/2026-12-03-h200-fa99455-mid-sweep-ab-*.jsonl): 16 rows
# 5.044 / 5.047 -> 5.051 / 5.054 ms a step, 64 rows 6.527 / 6.530 -> 6.464 / 6.483. The fragment tiles' plain twins
# instead (the copies off, these not yet): 16 rows 6.17 ms, 64 rows 6.50 (bench/results/
# 2026-12-03-h200-5b25bb0-fragment-copies-knob.jsonl; with the copies 4.03 and 6.34).
MID_PLAIN_TABLE: dict[tuple[int, int, int, int], MidTiles] = {
    (4, 4096, 6144, 16): MidTiles(16, 128, 128, 6, num_warps=8, num_stages=3, masked=True),
    (4, 4096, 4096, 16): MidTiles(16, 256, 128, 16, num_warps=4, num_stages=3, trans=True, masked=True),
    (4, 4096, 28672, 16): MidTiles(16, 256, 64, 5, num_warps=4, num_stages=3, masked=True),
    (4, 14336, 4096, 16): MidTiles(16, 64, 128, 8, num_warps=4, num_stages=3, masked=True),
    (4, 4096, 6144, 64): MidTiles(64, 128, 128, 6, num_warps=4, num_stages=3, trans=True, masked=True),
    (4, 4096, 4096, 64): MidTiles(64, 64, 128, 4, num_warps=4, num_stages=4, trans=True, masked=True, packed=True),
}

# W8A8: batches of at most INT8_TRITON_MAX_M / FP8_TRITON_MAX_M rows take the Triton 8-bit GEMM (scales
# applied in its epilogue); larger ones torch._int_mm (which takes more than 16 rows only) / torch._scaled_mm.
# FP8 up to 64 rows (the split-K kernel covers every row with one program): `bench.quant_gpu --sweep w8a8` on
# an H200 (bench/results/2026-11-26-h200-6ca884a-w8a8-sweep.jsonl), a Llama-3-8B layer's four fp8 GEMMs
# against quantize_rows + torch._scaled_mm: 77.4 / 81.4 / 96.1 us against 145.4 / 137.7 / 126.5 at 1 / 16 / 64
# rows (1.88 / 1.69 / 1.32x); the fused activation quantization wins where N is 4096 at 16 rows or fewer
# (o_proj, down_proj), never at 64 rows (each N slice quantizes the rows again).
INT8_TRITON_MAX_M = 16
FP8_TRITON_MAX_M = 64

# ("int8" or "fp8", K, N, BLOCK_M) -> the 8-bit GEMM's tiles (BLOCK_M 16 / 32 / 64: the next power of two >= the
# rows, at least 16). Shapes not listed take w8a8.w8a8_rule. From the H100 sweep that times every launch on a
# weight copy out of L2 (256 MiB of copies cycled; qkv's 25 MB and o_proj's 17 MB would otherwise stay in the
# 50 MB L2): `QUANT_BUDGET=220 bash bench/gpu_check.sh fp8-sweep-w1`
# (bench/results/2026-11-26-h100-4b86bf1-fp8-sweep-w1.jsonl). A layer's four GEMMs at 64 rows: 116.8 us against
# 128.2 for the tiles swept with weights in L2 and 134.0 for quantize_rows + torch._scaled_mm; at 16 rows 105.1
# against 107.9 / 134.5. The 64-row winners keep 6-8 stages in flight (or K 256 a step) at BLOCK_N 32 / 64.
W8A8_TABLE: dict[tuple[str, int, int, int], W8A8Tiles] = {
    ("fp8", 4096, 6144, 16): W8A8Tiles(
        block_m=16, block_n=64, block_k=128, split=4, num_warps=4, num_stages=4, fused=True
    ),
    ("fp8", 4096, 4096, 16): W8A8Tiles(
        block_m=16, block_n=128, block_k=128, split=8, num_warps=8, num_stages=3, fused=True
    ),
    ("fp8", 4096, 28672, 16): W8A8Tiles(
        block_m=16, block_n=128, block_k=256, split=1, num_warps=4, num_stages=3, fused=False
    ),
    ("fp8", 14336, 4096, 16): W8A8Tiles(
        block_m=16, block_n=128, block_k=128, split=8, num_warps=4, num_stages=3, fused=True
    ),
    ("fp8", 4096, 6144, 64): W8A8Tiles(
        block_m=64, block_n=64, block_k=128, split=1, num_warps=4, num_stages=8, fused=False
    ),
    ("fp8", 4096, 4096, 64): W8A8Tiles(
        block_m=64, block_n=32, block_k=128, split=1, num_warps=4, num_stages=8, fused=False
    ),
    ("fp8", 4096, 28672, 64): W8A8Tiles(
        block_m=64, block_n=64, block_k=256, split=1, num_warps=4, num_stages=3, fused=False
    ),
    ("fp8", 14336, 4096, 64): W8A8Tiles(
        block_m=64, block_n=32, block_k=256, split=2, num_warps=4, num_stages=4, fused=False
    ),
}

# The per-row activation quantizer.
ROW_TILES = RowTiles(block=2048, num_warps=4)
