"""W4A16 / W8A16 matmul: activations times a weight kept as packed integers, dequantized in registers.

The weight is the layout engine/layers/linear.py WeightOnlyLinear keeps for every weight-only scheme
(GPTQ, AWQ, compressed-tensors, int8 at load): int32 words packing 32 / bits consecutive input rows,
[K * bits / 32, N], with per-group scales and zero points [ceil(K / group), N].

Three kernels, by rows (thresholds in engine/kernels/quant_tiles.py):
- at most GEMV_MAX_M[bits] rows (2 for 4-bit, 1 for 8-bit), a GEMV with no tl.dot: each program reads a
  BLOCK_N-wide slice of the packed words over a range of K, coalesced along N, unpacks and converts them in
  registers, and accumulates in float32 for every row at once.
- up to MID_MAX_M rows (decode batches), a tl.dot kernel whose one program covers every row (BLOCK_M = the
  next power of two >= M, at least 16), so each weight tile is loaded and dequantized once whatever M is. The
  field becomes q - z as an exact float in three integer / float operations (no int-to-float conversion; or
  MASKED, the GEMV's way, an AND and an FMA) and the scale multiplies the product per group step (or once,
  when a program's K range lies in one group), not each weight. TRANS computes out^T = W^T x^T, the
  dequantized weight as tl.dot's first operand. FRAGMENT reads a 4-bit weight repacked (fragment_pack) so that
  its unpacked tile is the tl.dot operand's register layout as loaded (no trip through shared memory).
- prompt-sized batches, a tl.dot kernel tiled over M and N (no split): BLOCK_K rows lie in one group (BLOCK_K
  divides the group size), so each tile loads one row of scales and zeros.

The GEMV and the decode tl.dot kernel split K where N alone gives too few programs to stream the weight at full
bandwidth: the last program of an output slice to finish adds the others' float32 partials (_split_k_reduce;
one launch: no memset, no atomics on the output, no cast), with a per-slice int32 counter it leaves zeroed.
engine/kernels/w8a8.py's 8-bit GEMM splits K with the same reduction and buffers.
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import cache

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.quant_tiles import (
    GEMV_MAX_M,
    GEMV_TABLE,
    MID_MAX_M,
    MID_PLAIN_TABLE,
    MID_TABLE,
    GemvTiles,
    MidTiles,
    Tiles,
)

# The GEMV keeps its sums times 2**-GEMV_SHIFT (its fields are read as subnormal floats, _gemv_kernel): 74 centres
# the exponents it covers exactly, an activation x with 2**-52 < |x| < 2**53 (bfloat16 activations of a working
# model lie far inside).
GEMV_SHIFT = tl.constexpr(74)


def _packed_asm(base: int, one: int, fma: str) -> str:
    """_paired_fields' PTX for two elements: their words ($4, $5) and -(B + z) of each as packed halves ($6);
    out $0..$3, element e's field at the low nibble of byte j of its word (j = 0..3) as q - z, packed halves.
    One PRMT puts byte j of each word in its half, one LOP3 keeps both low nibbles and ORs in `base` (B in both
    halves, 2**7 in bfloat16 or 2**10 in float16, whose mantissa's last bits are the nibble's: each half is
    B + q exactly), and one packed FMA (times 1, plus -(B + z)) leaves q - z exactly (a small integer): three
    instructions a pair of fields."""
    pairs = "".join(
        f"prmt.b32 t, $4, $5, {0x0400 + 0x0101 * j:#06x}; lop3.b32 t, t, 0x000F000F, {base:#x}, 0xEA; "
        f"{fma} ${j}, t, one, $6; "
        for j in range(4)
    )
    return f"{{ .reg .b32 t, one; mov.b32 one, {one:#x}; {pairs}}}"


_PACKED_BF16 = tl.constexpr(_packed_asm(0x43004300, 0x3F803F80, "fma.rn.bf16x2"))
_PACKED_F16 = tl.constexpr(_packed_asm(0x64006400, 0x3C003C00, "fma.rn.f16x2"))
_PAIRS = tl.constexpr("=r,=r,=r,=r,r,r,r")  # its registers: four outputs, two words, -(B + z) of both

# A prefetch into L2 of the line holding $1 where $2 is nonzero (prefetch.global.L2: no register held, no
# scoreboard entry; a later load of those bytes finds them in L2); $0 is a dummy (inline asm has an output).
_L2_PREFETCH = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")
_L2_ARGS = tl.constexpr("=r,l,r")


@triton.jit
def _weight_only_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, sxm, sxk,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Prompt-sized M: program (m, n) computes a BLOCK_M x BLOCK_N tile of the output over all of K."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the host makes K a multiple of BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * sxm + offs_k[None, :] * sxk, mask=mask_m[:, None], other=0.0)
        words = tl.load(qw_ptr + (offs_k // PER_WORD)[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        q = (words >> ((offs_k % PER_WORD) * BITS)[:, None]) & ((1 << BITS) - 1)
        g = k0 // GROUP
        scale = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        # Rounded to the activation dtype as the reference rounds its dequantized weight.
        w = ((q.to(tl.float32) - zero[None, :]) * scale[None, :]).to(a.dtype)
        acc += tl.dot(a, w, input_precision=PRECISION)
    out = out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _block_k(k: int, group: int, cap: int = 128) -> int:
    # Dividing both, a tile never straddles groups, even in a short last group (K = 576, groups of 128).
    for bk in (128, 64, 32, 16):
        if bk <= cap and group % bk == 0 and k % bk == 0:
            return bk
    raise ValueError(f"weight-only matmul needs K ({k}) and the group size ({group}) to be multiples of 16")


def tiles(m: int, n: int, k: int, group: int) -> Tiles:
    """The prompt kernel's tiles for an [m, k] x [k, n] product."""
    return Tiles(64 if m > 32 else 32 if m > 16 else 16, 64, _block_k(k, group, cap=64), 1)


def mid_tiles(bits: int, m: int, n: int, k: int, group: int, num_sms: int) -> MidTiles:
    """The decode tl.dot kernel's tiles for m rows: MID_TABLE's entry for (bits, K, N, BLOCK_M), else the rule
    for shapes not listed: BLOCK_M the next power of two >= m (at least 16); up to 32 rows 256 outputs by
    BLOCK_K up to 64 on 4 warps, at 64 rows 128 outputs by BLOCK_K up to 128 on 8 warps (BLOCK_K the largest
    that divides K and the group); 3 stages; the weight as tl.dot's first operand (trans), unpacked masked; K
    split (at most 16 ways: the last program reads every partial) until about two programs per SM stream the
    weight, each keeping at least four steps. Of the tiles compiled for sm_90, these issue the fewest
    instructions per weight in the main loop without spilling (bench/quant_sass.py, Triton 3.6, 4 and 8 bits:
    5.9 to 7.0 up to 32 rows with the shifted unpack, where the unpacked weight goes to shared memory in
    16-byte stores; 10.8 to 10.9 at 64; the masked unpack takes ~1 to 1.3 fewer at 16 rows)."""
    bm = max(16, triton.next_power_of_2(m))
    listed = MID_TABLE.get((bits, k, n, bm))  # swept at one group size: its K step must divide this one's
    return listed if listed is not None and group % listed.block_k == 0 else mid_rule(bm, n, k, group, num_sms)


def mid_rule(bm: int, n: int, k: int, group: int, num_sms: int) -> MidTiles:
    """mid_tiles' rule for a shape MID_TABLE does not list (BLOCK_M bm)."""
    bn, bk, warps = (256, _block_k(k, group, cap=64), 4) if bm <= 32 else (128, _block_k(k, group), 8)
    programs, split = triton.cdiv(n, bn), 1
    while programs * split < 2 * num_sms and k // (bk * split * 2) >= 4 and split < 16:
        split *= 2
    return MidTiles(bm, bn, bk, split, num_warps=warps, trans=True, masked=True)


@triton.jit
def _split_k_reduce(
    out_ptr, part_ptr, count_ptr, pid_n, M, N, offs_n, mask_n, SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    row_scale_ptr, col_scale_ptr, SCALED: tl.constexpr,
):  # fmt: skip
    """After each of an output slice's SPLIT programs stored its partial rows [BLOCK_M, slice] at
    part_ptr[pid_k]: the slice's last program to arrive adds the partials [SPLIT, BLOCK_M, N] in split order
    (the same sum whichever arrives last), writes the output and resets the slice's counter for the next
    launch. The barrier orders every thread's partial before the release of the counter's increment; the
    partials are read from L2 (.cg), where the other programs' stores landed. The sum keeps the partials'
    type (int32 partials of an int8 GEMM add exactly); SCALED multiplies it, as float32, by the row scales
    [M] and then the column scales [N] (engine/kernels/w8a8.py's epilogue) before the output's rounding."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
    if arrived == SPLIT - 1:
        rows_m = tl.arange(0, BLOCK_M)
        mask = (rows_m[:, None] < M) & mask_n[None, :]
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=part_ptr.dtype.element_ty)
        for sk in range(0, SPLIT):
            total += tl.load(part_ptr + (sk * BLOCK_M + rows_m[:, None]) * N + offs_n[None, :], mask=mask,
                             other=0, cache_modifier=".cg")  # fmt: skip
        out = total.to(tl.float32)
        if SCALED:
            row_scale = tl.load(row_scale_ptr + rows_m, mask=rows_m < M, other=0.0)
            col_scale = tl.load(col_scale_ptr + offs_n, mask=mask_n, other=0.0)
            out = out * row_scale[:, None] * col_scale[None, :]
        tl.store(out_ptr + rows_m[:, None] * N + offs_n[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit
def _as_float(q, z, dtype: tl.constexpr):
    """Fields q as q - z in `dtype` (z given as 2**23 + z), exactly (|q - z| < 256) and with no int-to-float
    conversion: each field ORed into the mantissa of 2**23, less 2**23 + z."""
    return ((q | 0x4B000000).to(tl.float32, bitcast=True) - z).to(dtype)


@triton.jit
def _paired_fields(words, z, dtype: tl.constexpr):
    """The 8 fields of 4-bit words as q - z in `dtype` (bfloat16 or float16; z float32, broadcastable to words),
    laid out as _joined_fields lays them ([..., p0, p1, half]: field 4 half + 2 p1 + p0), two fields at a time
    (_packed_asm's PTX: 1 5/8 instructions a weight with the shift, where the masked unpack and its conversion
    to 16 bits take 2 1/2). Its elements are the words joined with the words shifted right by 4 (p0: fields
    2j + p0 at the low nibble of byte j), so each element's outputs depend on its own inputs alone, whichever
    two elements Triton gives one call (pack 2). Where it gives a join's pair, as the layouts here do, an output
    register holds fields 2j and 2j + 1 of one word: consecutive inputs of one output, the register pair of
    tl.dot's operands."""
    if dtype == tl.bfloat16:
        nz = (-(z + 128.0)).to(dtype)
    else:
        nz = (-(z + 1024.0)).to(dtype)
    nz = tl.broadcast_to(nz, words.shape)
    w2, nz2 = tl.join(words, words >> 4), tl.join(nz, nz)
    t = nz.dtype
    if dtype == tl.bfloat16:
        f01, f23, f45, f67 = tl.inline_asm_elementwise(_PACKED_BF16, _PAIRS, [w2, nz2], (t, t, t, t), True, 2)
    else:
        f01, f23, f45, f67 = tl.inline_asm_elementwise(_PACKED_F16, _PAIRS, [w2, nz2], (t, t, t, t), True, 2)
    return tl.join(tl.join(f01, f23), tl.join(f45, f67))


@triton.jit
def _unpack_k_rows(words, z, BITS: tl.constexpr, dtype: tl.constexpr, MASKED: tl.constexpr, PACKED: tl.constexpr):
    """[KW, N] words -> [KW * 32 / BITS, N] weights q - z (z [N]): field j of word row kw to row kw * 32 / BITS
    + j, as a [KW, 32 / BITS, N] tensor folded (the layout the tl.dot operand compiles best from on sm_90).
    MASKED: the fields masked in place from half words (as _field does), z then [16 / BITS, N]: 2**(23 - BITS *
    i) + z for each place i in a half word. PACKED (4 bits; z [N]): two fields at a time (_paired_fields)."""
    PER_WORD: tl.constexpr = 32 // BITS
    if PACKED:  # [KW, N, p0, p1, half] -> [KW, half, p1, p0, N]
        w = tl.permute(_paired_fields(words, z[None, :], dtype), (0, 4, 3, 2, 1))
    elif MASKED:
        HALF: tl.constexpr = PER_WORD // 2
        halves = ((words[:, None, :] >> (tl.arange(0, 2) * 16)[None, :, None]) & 0xFFFF) | 0x4B000000
        place = tl.arange(0, HALF)
        keep = 0x4B000000 | (((1 << BITS) - 1) << (place * BITS))
        q = (halves[:, :, None, :] & keep[None, None, :, None]).to(tl.float32, bitcast=True)
        # 2**-(BITS * place) as a float: 1 << (BITS * place) is exact.
        f = 1.0 / (1 << (place * BITS)).to(tl.float32)
        w = (q * f[None, None, :, None] - z[None, None, :, :]).to(dtype)
    else:
        shifts = tl.arange(0, PER_WORD) * BITS
        w = _as_float((words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1), z[None, None, :], dtype)
    return tl.reshape(w, (words.shape[0] * PER_WORD, words.shape[1]))


@triton.jit
def _field(words, j: tl.constexpr, BITS: tl.constexpr, z, dtype: tl.constexpr, MASKED: tl.constexpr):
    """Field j of words as q - z in `dtype`, exactly. Shifted out: z given as 2**23 + z (_as_float). MASKED: one
    AND of a constant that keeps 2**23's bits, from the word's half ORed into the mantissa of 2**23 (the
    compiler computes each half once for all its fields), leaves 2**23 + q * 2**(BITS * i), i the field's
    place in its half, exactly; times 2**-(BITS * i), less 2**(23 - BITS * i) + z, that is q - z exactly (one
    FMA: the exact result is representable, so its one rounding changes nothing; the sum with z is on z's
    own shape, not each weight's)."""
    if MASKED:
        HALF: tl.constexpr = 16 // BITS
        i: tl.constexpr = j % HALF
        keep: tl.constexpr = 0x4B000000 | (((1 << BITS) - 1) << (BITS * i))
        half = ((words >> (16 * (j // HALF))) & 0xFFFF) | 0x4B000000
        q = (half & keep).to(tl.float32, bitcast=True)
        w = (q * (1.0 / (1 << (BITS * i))) - (z + (1 << (23 - BITS * i)))).to(dtype)
    else:
        w = _as_float((words >> (j * BITS)) & ((1 << BITS) - 1), z, dtype)
    return w


@triton.jit
def _unpack_k_cols(words, z, BITS: tl.constexpr, dtype: tl.constexpr, MASKED: tl.constexpr, PACKED: tl.constexpr):
    """[N, KW] words -> [N, KW * 32 / BITS] weights q - z (z [N, 1]; 2**23 + z unless MASKED or PACKED): field j of
    word kw to column kw * 32 / BITS + j, by interleaving the fields (pairs, then pairs of pairs: in registers).
    PACKED (4 bits): two fields at a time (_paired_fields)."""
    if PACKED:  # [N, KW, p0, p1, half] -> [N, KW, half, p1, p0]
        w = tl.permute(_paired_fields(words, z, dtype), (0, 1, 4, 3, 2))
        return tl.reshape(w, (words.shape[0], words.shape[1] * 8))
    if BITS == 4:
        even = tl.interleave(
            tl.interleave(_field(words, 0, BITS, z, dtype, MASKED), _field(words, 4, BITS, z, dtype, MASKED)),
            tl.interleave(_field(words, 2, BITS, z, dtype, MASKED), _field(words, 6, BITS, z, dtype, MASKED)),
        )
        odd = tl.interleave(
            tl.interleave(_field(words, 1, BITS, z, dtype, MASKED), _field(words, 5, BITS, z, dtype, MASKED)),
            tl.interleave(_field(words, 3, BITS, z, dtype, MASKED), _field(words, 7, BITS, z, dtype, MASKED)),
        )
    else:
        even = tl.interleave(_field(words, 0, BITS, z, dtype, MASKED), _field(words, 2, BITS, z, dtype, MASKED))
        odd = tl.interleave(_field(words, 1, BITS, z, dtype, MASKED), _field(words, 3, BITS, z, dtype, MASKED))
    return tl.interleave(even, odd)


@triton.jit
def _joined_fields(words, z, dtype: tl.constexpr, PACKED: tl.constexpr):
    """The 8 fields of 4-bit words as q - z in `dtype`, unpacked masked (_field), joined as three new last
    dimensions (p0, p1, half) of size 2: field 4 half + 2 p1 + p0, each dimension in registers. PACKED: two at
    a time (_paired_fields)."""
    if PACKED:
        return _paired_fields(words, z, dtype)
    lo = tl.join(
        tl.join(_field(words, 0, 4, z, dtype, True), _field(words, 1, 4, z, dtype, True)),
        tl.join(_field(words, 2, 4, z, dtype, True), _field(words, 3, 4, z, dtype, True)),
    )
    hi = tl.join(
        tl.join(_field(words, 4, 4, z, dtype, True), _field(words, 5, 4, z, dtype, True)),
        tl.join(_field(words, 6, 4, z, dtype, True), _field(words, 7, 4, z, dtype, True)),
    )
    return tl.join(lo, hi)


@triton.jit
def _fragment_tile(
    qw_ptr,
    sqn,
    k0,
    offs_n,
    mask_n,
    z,
    BLOCK_K: tl.constexpr,
    dtype: tl.constexpr,
    KWIDTH: tl.constexpr,
    PACKED: tl.constexpr,
):
    """The [BLOCK_K, BLOCK_N] tile q - z (z [BLOCK_N]) of a 4-bit weight in the fragment layout (fragment_pack) at
    inputs k0.. (BLOCK_K 32, 64 or 128, k0 a multiple of it), unpacked masked (_field) into the layout of
    tl.dot's second operand for mma.sync (m16n8k16) as it is loaded: a thread's C = BLOCK_K / 32 words of an
    output column are contiguous (one 8- or 16-byte load), the 4 lanes of a quad take the 4 words of a 32-input
    chunk, the 8 quads of a warp 8 columns, the warps the next columns. Field (half, p1, p0) of word t of chunk
    c is input 32c + 16 half + 8 p1 + 2 t + p0: one register bit under the lane bits and the rest above, as
    the operand wants, so the fields are joined (register dimensions) and permuted into [BLOCK_K, BLOCK_N]
    with no layout conversion (no shared-memory round trip of the unpacked tile; Triton 3.6 / 3.9 infer the
    operand layout through the joins, the permute and the reshape)."""
    C: tl.constexpr = BLOCK_K // 32
    # k0's 128-input block, then its chunk: a multiple of C by construction, so the words load as one vector
    base = (k0 // 128) * 16 + ((k0 // BLOCK_K) % (128 // BLOCK_K)) * C
    offs = offs_n[:, None, None] * sqn + base + tl.arange(0, 4)[None, :, None] * 4 + tl.arange(0, C)[None, None, :]
    words = tl.load(qw_ptr + offs, mask=mask_n[:, None, None], other=0)  # [BLOCK_N, 4 (t), C]
    zc = z[:, None, None]
    w = _joined_fields(words, zc, dtype, PACKED)  # [n, t, c, p0, p1, half]
    if KWIDTH == 2:  # k = 32c + 16 half + 8 p1 + 2t + p0
        w = tl.permute(w, (2, 5, 4, 1, 3, 0))
    else:  # k = 32c + 16 half + 4t + 2 p1 + p0
        w = tl.permute(w, (2, 5, 1, 4, 3, 0))
    return tl.reshape(w, (BLOCK_K, w.shape[5]))


@triton.jit
def _fragment_rows(qw_ptr, sqn, k0, pid_n, N, z, BLOCK_N: tl.constexpr, dtype: tl.constexpr, PACKED: tl.constexpr):
    """The [BLOCK_N, 64] tile q - z (z [BLOCK_N]) of a 4-bit weight in the trans fragment layout (fragment_pack
    with trans) at inputs k0..k0 + 63 (k0 a multiple of 64), unpacked masked (_field) into the layout of
    tl.dot's first operand for wgmma (its registers): per 16 outputs and 64 inputs 128 words, in order (row
    r < 8, t < 4, r8 < 2, c < 2) for output 16 g + 8 r8 + r, field (half, p1, p0) of the word holding input
    32c + 16 half + 8 p1 + 2t + p0. A thread loads its (r8, c) words as one 16-byte vector, the lanes take
    (r, t), the warps the groups g: the operand's layout, so Triton converts nothing."""
    G: tl.constexpr = BLOCK_N // 16
    g = pid_n * G + tl.arange(0, G)
    v = tl.arange(0, 8)[None, :, None, None] * 16 + tl.arange(0, 4)[None, None, :, None] * 4
    offs = g[:, None, None, None] * (16 * sqn) + (k0 // 64) * 128 + v + tl.arange(0, 4)[None, None, None, :]
    words = tl.load(qw_ptr + offs, mask=(g < N // 16)[:, None, None, None], other=0)
    words = tl.reshape(words, (G, 8, 4, 2, 2))  # [g, r, t, r8, c]
    zc = tl.permute(tl.reshape(z, (G, 2, 8)), (0, 2, 1))[:, :, None, :, None]
    w = tl.permute(
        _joined_fields(words, zc, dtype, PACKED), (0, 3, 1, 4, 7, 6, 2, 5)
    )  # -> [g, r8, r, c, half, p1, t, p0]
    return tl.reshape(w, (BLOCK_N, 64))


@triton.jit
def _mid_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, sxm, sxk, span, SPLIT, GROUP, sqn,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SCALE_AT_END: tl.constexpr, TRANS: tl.constexpr, HAS_PERM: tl.constexpr,
    PRECISION: tl.constexpr, MASKED: tl.constexpr, FRAGMENT: tl.constexpr, PACKED: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    """out[:M] = x[:M] @ W for M <= BLOCK_M rows (x's columns read through perm when HAS_PERM); program (n, s)
    covers outputs n*BLOCK_N.. over inputs s*span.. (span a multiple of BLOCK_K, whose steps each lie in one
    group; a run-time argument: one compiled kernel serves per-channel weights of any K). Each step loads its
    [BLOCK_K * BITS / 32, BLOCK_N] words once and unpacks them in registers (loading a word per weight, as
    the prompt kernel does, costs ~2.5x the instructions per weight on sm_90). SCALE_AT_END: the program's
    whole span lies in one group, so its scale multiplies the sum once. MASKED: the fields unpacked as the GEMV
    does (_field: an AND and an FMA a field where shifting it out costs a shift, an extract, an OR and
    a subtraction). FRAGMENT: a 4-bit weight in the fragment layout ([N, K / 8], row stride sqn), unpacked
    masked straight into tl.dot's operand layout (_fragment_tile; TRANS: _fragment_rows)."""
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PER_WORD
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    if TRANS:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.minimum((pid_k + 1) * span, K)
    # The step's group, counted along (a run-time division a step costs ~25 instructions on sm_90): g, and the
    # inputs of it left from the step on (a step lies in one group).
    g = pid_k * span // GROUP
    left = GROUP - pid_k * span % GROUP
    for k0 in range(pid_k * span, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        cols = offs_k
        if HAS_PERM:
            cols = tl.load(perm_ptr + offs_k)
        offs_kw = k0 // PER_WORD + tl.arange(0, BLOCK_KW)
        z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        # Loaded before the unpack, so its latency overlaps it (unused if SCALE_AT_END: compiled out).
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if TRANS and FRAGMENT:
            a = tl.load(x_ptr + offs_m[None, :] * sxm + cols[:, None] * sxk, mask=mask_m[None, :], other=0.0)
            w = _fragment_rows(qw_ptr, sqn, k0, pid_n, N, z, BLOCK_N, a.dtype, PACKED)
            if BLOCK_K == 128:  # the next 64 inputs as the upper half of K
                w2 = _fragment_rows(qw_ptr, sqn, k0 + 64, pid_n, N, z, BLOCK_N, a.dtype, PACKED)
                w = tl.reshape(tl.permute(tl.join(w, w2), (0, 2, 1)), (BLOCK_N, BLOCK_K))
            if SCALE_AT_END:
                acc = tl.dot(w, a, acc, input_precision=PRECISION)
            else:
                acc += tl.dot(w, a, input_precision=PRECISION) * s[:, None]
        elif TRANS:
            a = tl.load(x_ptr + offs_m[None, :] * sxm + cols[:, None] * sxk, mask=mask_m[None, :], other=0.0)
            words = tl.load(qw_ptr + offs_kw[None, :] * N + offs_n[:, None], mask=mask_n[:, None], other=0)
            if MASKED or PACKED:
                w = _unpack_k_cols(words, z[:, None], BITS, a.dtype, MASKED, PACKED)
            else:  # 2**23 + z: the field ORed into the mantissa of 2**23, less this, is q - z exactly
                w = _unpack_k_cols(words, z[:, None] + 8388608.0, BITS, a.dtype, False, False)
            if SCALE_AT_END:
                acc = tl.dot(w, a, acc, input_precision=PRECISION)
            else:
                acc += tl.dot(w, a, input_precision=PRECISION) * s[:, None]
        elif FRAGMENT:
            a = tl.load(x_ptr + offs_m[:, None] * sxm + cols[None, :] * sxk, mask=mask_m[:, None], other=0.0)
            w = _fragment_tile(qw_ptr, sqn, k0, offs_n, mask_n, z, BLOCK_K, a.dtype, FRAGMENT, PACKED)
            if SCALE_AT_END:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
            else:
                acc += tl.dot(a, w, input_precision=PRECISION) * s[None, :]
        else:
            a = tl.load(x_ptr + offs_m[:, None] * sxm + cols[None, :] * sxk, mask=mask_m[:, None], other=0.0)
            words = tl.load(qw_ptr + offs_kw[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
            if PACKED:
                w = _unpack_k_rows(words, z, BITS, a.dtype, False, True)
            elif MASKED:  # 2**(23 - BITS * i) + z for the field's place i in its half word
                place = (1 << (23 - BITS * tl.arange(0, 16 // BITS))).to(tl.float32)
                w = _unpack_k_rows(words, place[:, None] + z[None, :], BITS, a.dtype, True, False)
            else:
                w = _unpack_k_rows(words, z + 8388608.0, BITS, a.dtype, False, False)
            if SCALE_AT_END:
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
            else:
                acc += tl.dot(a, w, input_precision=PRECISION) * s[None, :]
        left -= BLOCK_K
        g += left == 0
        left = tl.where(left == 0, GROUP, left)
    if SCALE_AT_END:
        s = tl.load(s_ptr + (pid_k * span // GROUP) * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        acc = acc * (s[:, None] if TRANS else s[None, :])
    if TRANS:
        acc = tl.trans(acc)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (pid_k * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
        _split_k_reduce(out_ptr, part_ptr, count_ptr, pid_n, M, N, offs_n, mask_n, SPLIT, BLOCK_M, BLOCK_N,
                        part_ptr, part_ptr, False)  # fmt: skip


@triton.jit
def _gemv_step_loads(
    qw_ptr, s_ptr, z_ptr, kw0, kw_end, N, offs_n, mask_n,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_KW: tl.constexpr, SCALES: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """A step's packed words [BLOCK_KW, BLOCK_N] and, unless SCALES is 0 (applied once after the loop), its scales
    and zeros in their stored dtype: one row of them (SCALES 1: the step lies in one group) or each word row's
    own (2). A step at or past kw_end (the prefetch past a program's last step) loads nothing, or, EVEN (no
    masks: N whole slices, K whole steps), the program's last step again (unused)."""
    PER_WORD: tl.constexpr = 32 // BITS
    if EVEN:
        kw0 = tl.minimum(kw0, kw_end - BLOCK_KW)
    offs_kw = kw0 + tl.arange(0, BLOCK_KW)
    mask_kw = _gemv_mask(offs_kw, kw_end, EVEN)
    words = tl.load(qw_ptr + offs_kw[:, None].to(tl.int64) * N + offs_n[None, :],
                    mask=mask_kw[:, None] & mask_n[None, :], other=0)  # fmt: skip
    if SCALES == 1:
        g = tl.minimum(kw0, kw_end - 1) * PER_WORD // GROUP  # past the end: the last step's (loaded, unused)
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0)[None, :]
        z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0.0)[None, :]
    elif SCALES == 2:
        g = (offs_kw * PER_WORD // GROUP)[:, None] * N + offs_n[None, :]
        gmask = mask_kw[:, None] & mask_n[None, :]
        s = tl.load(s_ptr + g, mask=gmask, other=0.0)
        z = tl.load(z_ptr + g, mask=gmask, other=0.0)
    else:
        s = tl.zeros((1, 1), dtype=s_ptr.dtype.element_ty)
        z = tl.zeros((1, 1), dtype=z_ptr.dtype.element_ty)
    return words, s, z


@triton.jit
def _l2_prefetch(ptrs, issue):
    """_L2_PREFETCH over a tensor of pointers where `issue` (broadcast to them) holds."""
    tl.inline_asm_elementwise(_L2_PREFETCH, _L2_ARGS, [ptrs.to(tl.int64), issue.to(tl.int32)], tl.int32, False, 1)


@triton.jit
def _gemv_l2_prefetch(
    qw_ptr, s_ptr, z_ptr, kw0, kw_end, N, pid_n,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, SCALES: tl.constexpr,
):  # fmt: skip
    """Into L2 (_L2_PREFETCH), the step at word row kw0 of a program's slice (nothing at or past kw_end): its
    [BLOCK_KW, BLOCK_N] words a 32-byte sector an element (BLOCK_N a multiple of 8), and unless SCALES is 0 the
    rows of scales and zero points of the step's groups. For whole slices only (EVEN: no column past N)."""
    PER_WORD: tl.constexpr = 32 // BITS
    r = tl.arange(0, BLOCK_KW)[:, None]
    sectors = tl.arange(0, BLOCK_N // 8)[None, :] * 8  # 8 words a sector
    _l2_prefetch(qw_ptr + (kw0 + r).to(tl.int64) * N + pid_n * BLOCK_N + sectors, kw0 + r < kw_end)
    if SCALES > 0:
        GROUPS: tl.constexpr = (BLOCK_KW * PER_WORD + GROUP - 1) // GROUP  # the groups a step touches
        PER_SECTOR: tl.constexpr = 32 // (s_ptr.dtype.element_ty.primitive_bitwidth // 8)
        g = (kw0 * PER_WORD // GROUP + tl.arange(0, GROUPS)[:, None]).to(tl.int64) * N + pid_n * BLOCK_N
        cols = tl.arange(0, (BLOCK_N + PER_SECTOR - 1) // PER_SECTOR)[None, :] * PER_SECTOR
        inside = g * 0 + kw0 < kw_end
        _l2_prefetch(s_ptr + g + cols, inside)
        _l2_prefetch(z_ptr + g + cols, inside)


@triton.jit
def _gemv_mask(offs, end, EVEN: tl.constexpr):
    """offs < end, or all true (a constant: the loads it guards compile unpredicated) when EVEN."""
    if EVEN:
        return tl.full(offs.shape, 1, tl.int1)
    return offs < end


@triton.jit
def _row_products(x_ptr, row, offs_k, mask_kw, q, f: tl.constexpr, qx, xs):
    """One row's share of a field q (a subnormal, _gemv_kernel): qx += q * (x * f), the field times x times
    2**-GEMV_SHIFT exactly; xs += x."""
    x = tl.load(x_ptr + row + offs_k, mask=mask_kw, other=0.0).to(tl.float32)
    return qx + q * (x * f)[:, None], xs + x


@triton.jit
def _gemv_out(out_ptr, part_ptr, total, r, pid_k, M, N, offs_n, mask_n, SPLIT, BLOCK_M: tl.constexpr):
    """Row r's sums [BLOCK_N]: to the output, or, when K is split, to its partial."""
    mask = mask_n & (tl.full(offs_n.shape, r, tl.int32) < M)
    if SPLIT == 1:
        tl.store(out_ptr + r * N + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + (pid_k * BLOCK_M + r) * N + offs_n, total, mask=mask)


@triton.jit
def _gemv_total(acc, xt, s, z):
    """A row's [BLOCK_N] result from its element-wise sums [BLOCK_KW, BLOCK_N], kept times 2**-GEMV_SHIFT, and
    sums of x [BLOCK_KW]: s * (sum q x - z * sum x) (s 1 and z 0 where the loop applied them)."""
    return s * (tl.sum(acc, axis=0) * (2.0**GEMV_SHIFT) - z * tl.sum(xt, axis=0))


@triton.jit
def _gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, part_ptr, count_ptr,
    M, N, KW, sxm, sxk, span, SPLIT,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr, SCALES: tl.constexpr, PREFETCH: tl.constexpr, STAGES: tl.constexpr,
    EVEN: tl.constexpr, HAS_PERM: tl.constexpr,
    PDL: tl.constexpr = 0, L2_AHEAD: tl.constexpr = 0,
):  # fmt: skip
    """out[:M] = x[:M] @ W for M <= BLOCK_M <= 4 rows (x's columns read through perm when HAS_PERM: an
    act-order weight's rows are sorted by group); program (n, s) covers outputs n*BLOCK_N.. over word
    rows s*span.. (span a multiple of BLOCK_KW). Each step loads [BLOCK_KW, BLOCK_N] words once (PREFETCH
    steps ahead, 0 to 2: the words, scales and zeros of a later step are loaded in this one, so a warp's loads
    stay in flight while it computes; the compiler issues them late in the step, after most of its arithmetic,
    so one step ahead hides a part of the latency, two a whole step's; or STAGES > 1: Triton's pipeliner
    copies words and scales STAGES - 1 steps ahead into shared memory, cp.async, at the cost of a barrier a
    step) and takes their fields one at a time; every sum stays
    [BLOCK_KW, BLOCK_N] element-wise in registers until the end, so the loop has no cross-thread reduction.
    sum_k (q - z) * s * x = s * (sum_k q * x - z * sum_k x) within a group: scale and zero point cost per word
    row and step (SCALES 1: the step lies in one group; 2: each word row its own group), or once after the
    loop (SCALES 0: the program's whole span lies in one group, as per-channel weights). One accumulator per
    row (acc0..acc3): rows past M re-read row M - 1 (no masking) and are never stored.
    L2_AHEAD > 0 (CUDA, EVEN, STAGES 1): the first L2_AHEAD steps' words, scales and zeros are prefetched into
    L2 (_gemv_l2_prefetch) before the kernel waits for the one before it (PDL: the weight is no kernel's
    output, so its bytes may come while the previous kernel still runs), and each step prefetches the step
    L2_AHEAD ahead, so the bytes in flight are not bound by the registers that hold prefetched words."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    kw_start = pid_k * span
    kw_end = tl.minimum(kw_start + span, KW)
    for ahead in tl.static_range(L2_AHEAD):
        _gemv_l2_prefetch(qw_ptr, s_ptr, z_ptr, kw_start + ahead * BLOCK_KW, kw_end, N, pid_n, BITS, GROUP, BLOCK_N,
                          BLOCK_KW, SCALES)  # fmt: skip
    pdl.enter(PDL)
    PER_WORD: tl.constexpr = 32 // BITS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = _gemv_mask(offs_n, N, EVEN)
    row0, row1, row2, row3 = 0, tl.minimum(1, M - 1) * sxm, tl.minimum(2, M - 1) * sxm, tl.minimum(3, M - 1) * sxm
    acc0 = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
    # SCALES 0: sum_k x over the whole span, per row (the zero point's share, applied after the loop).
    xt0 = tl.zeros((BLOCK_KW,), dtype=tl.float32)
    xt1 = tl.zeros((BLOCK_KW,), dtype=tl.float32)
    xt2 = tl.zeros((BLOCK_KW,), dtype=tl.float32)
    xt3 = tl.zeros((BLOCK_KW,), dtype=tl.float32)
    if PREFETCH > 0:
        words, s_next, z_next = _gemv_step_loads(qw_ptr, s_ptr, z_ptr, kw_start, kw_end, N, offs_n, mask_n,
                                                 BITS, GROUP, BLOCK_KW, SCALES, EVEN)  # fmt: skip
    if PREFETCH > 1:
        words2, s_next2, z_next2 = _gemv_step_loads(qw_ptr, s_ptr, z_ptr, kw_start + BLOCK_KW, kw_end, N, offs_n,
                                                    mask_n, BITS, GROUP, BLOCK_KW, SCALES, EVEN)  # fmt: skip
    for kw0 in tl.range(kw_start, kw_end, BLOCK_KW, num_stages=STAGES):
        if L2_AHEAD > 0:
            _gemv_l2_prefetch(qw_ptr, s_ptr, z_ptr, kw0 + L2_AHEAD * BLOCK_KW, kw_end, N, pid_n, BITS, GROUP, BLOCK_N,
                              BLOCK_KW, SCALES)  # fmt: skip
        if PREFETCH == 1:
            cur, s, z = words, s_next, z_next
            words, s_next, z_next = _gemv_step_loads(qw_ptr, s_ptr, z_ptr, kw0 + BLOCK_KW, kw_end, N, offs_n,
                                                     mask_n, BITS, GROUP, BLOCK_KW, SCALES, EVEN)  # fmt: skip
        elif PREFETCH == 2:
            cur, s, z = words, s_next, z_next
            words, s_next, z_next = words2, s_next2, z_next2
            words2, s_next2, z_next2 = _gemv_step_loads(qw_ptr, s_ptr, z_ptr, kw0 + 2 * BLOCK_KW, kw_end, N,
                                                        offs_n, mask_n, BITS, GROUP, BLOCK_KW, SCALES,
                                                        EVEN)  # fmt: skip
        else:
            cur, s, z = _gemv_step_loads(qw_ptr, s_ptr, z_ptr, kw0, kw_end, N, offs_n, mask_n, BITS, GROUP,
                                         BLOCK_KW, SCALES, EVEN)  # fmt: skip
        offs_kw = kw0 + tl.arange(0, BLOCK_KW)
        mask_kw = _gemv_mask(offs_kw, kw_end, EVEN)
        # The fields as floats in one instruction each, without an int-to-float conversion (quarter rate) or
        # an offset to subtract: a field masked in place (one AND) from the word, or, past bit 22, from the
        # word shifted right by 12 once, read as a float, is a subnormal, the field times 2**(p - 149) exactly,
        # p the bit it starts at (never 0 in the shifted word: a field there would be taken out with a shift
        # and a bit-field extract). The row's x times 2**(149 - p - GEMV_SHIFT) (exact for 2**-52 < |x| <
        # 2**53) makes the product, one FMA, the field's times x times 2**-GEMV_SHIFT: the sums are the fp32
        # sums of the unshifted products scaled by a power of two (_gemv_total undoes it). The FMA takes
        # subnormal inputs at full rate (Triton compiles fp32 arithmetic without flush-to-zero).
        hi = cur >> 12
        qx0 = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
        qx1 = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
        qx2 = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
        qx3 = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
        xs0 = tl.zeros((BLOCK_KW,), dtype=tl.float32)
        xs1 = tl.zeros((BLOCK_KW,), dtype=tl.float32)
        xs2 = tl.zeros((BLOCK_KW,), dtype=tl.float32)
        xs3 = tl.zeros((BLOCK_KW,), dtype=tl.float32)
        for j in tl.static_range(PER_WORD):
            if BITS * (j + 1) <= 23:
                q = (cur & (((1 << BITS) - 1) << (BITS * j))).to(tl.float32, bitcast=True)
                f = 2.0 ** (149 - GEMV_SHIFT - BITS * j)
            else:
                q = (hi & (((1 << BITS) - 1) << (BITS * j - 12))).to(tl.float32, bitcast=True)
                f = 2.0 ** (161 - GEMV_SHIFT - BITS * j)
            offs_k = offs_kw * PER_WORD + j
            if HAS_PERM:
                offs_k = tl.load(perm_ptr + offs_k, mask=mask_kw, other=0)
            offs_k = offs_k * sxk
            qx0, xs0 = _row_products(x_ptr, row0, offs_k, mask_kw, q, f, qx0, xs0)
            if BLOCK_M > 1:
                qx1, xs1 = _row_products(x_ptr, row1, offs_k, mask_kw, q, f, qx1, xs1)
            if BLOCK_M > 2:
                qx2, xs2 = _row_products(x_ptr, row2, offs_k, mask_kw, q, f, qx2, xs2)
                qx3, xs3 = _row_products(x_ptr, row3, offs_k, mask_kw, q, f, qx3, xs3)
        if SCALES == 0:
            acc0 += qx0
            xt0 += xs0
            if BLOCK_M > 1:
                acc1 += qx1
                xt1 += xs1
            if BLOCK_M > 2:
                acc2 += qx2
                xt2 += xs2
                acc3 += qx3
                xt3 += xs3
        else:
            s = s.to(tl.float32)
            z = z.to(tl.float32)
            # The zero point's share, shifted as qx (a row's sums of x, shared by the thread's outputs).
            acc0 += s * (qx0 - z * (xs0 * 2.0**-GEMV_SHIFT)[:, None])
            if BLOCK_M > 1:
                acc1 += s * (qx1 - z * (xs1 * 2.0**-GEMV_SHIFT)[:, None])
            if BLOCK_M > 2:
                acc2 += s * (qx2 - z * (xs2 * 2.0**-GEMV_SHIFT)[:, None])
                acc3 += s * (qx3 - z * (xs3 * 2.0**-GEMV_SHIFT)[:, None])
    if SCALES == 0:  # the span's one group
        g = kw_start * PER_WORD // GROUP
        s_end = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z_end = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    else:
        s_end = tl.full((BLOCK_N,), 1.0, tl.float32)
        z_end = tl.zeros((BLOCK_N,), tl.float32)
    _gemv_out(out_ptr, part_ptr, _gemv_total(acc0, xt0, s_end, z_end), 0, pid_k, M, N, offs_n, mask_n, SPLIT, BLOCK_M)
    if BLOCK_M > 1:
        _gemv_out(out_ptr, part_ptr, _gemv_total(acc1, xt1, s_end, z_end), 1, pid_k, M, N, offs_n, mask_n, SPLIT,
                  BLOCK_M)  # fmt: skip
    if BLOCK_M > 2:
        _gemv_out(out_ptr, part_ptr, _gemv_total(acc2, xt2, s_end, z_end), 2, pid_k, M, N, offs_n, mask_n, SPLIT,
                  BLOCK_M)  # fmt: skip
        _gemv_out(out_ptr, part_ptr, _gemv_total(acc3, xt3, s_end, z_end), 3, pid_k, M, N, offs_n, mask_n, SPLIT,
                  BLOCK_M)  # fmt: skip
    if SPLIT > 1:
        _split_k_reduce(out_ptr, part_ptr, count_ptr, pid_n, M, N, offs_n, mask_n, SPLIT, BLOCK_M, BLOCK_N,
                        part_ptr, part_ptr, False)  # fmt: skip


def gemv_tiles(bits: int, n: int, k: int, num_sms: int, m: int = 1) -> GemvTiles:
    """The GEMV's tiles for m rows: GEMV_TABLE's entry for the shape, else 64 outputs by 16 words a step (8
    words per thread of 4 warps) with K split until about three programs per SM stream the weight, each
    keeping at least four steps; then fitted to the rows (gemv_rows)."""
    if (bits, k, n) in GEMV_TABLE:
        return gemv_rows(GEMV_TABLE[(bits, k, n)], m)
    bn, bkw = 64, 16
    kw = k * bits // 32
    programs, split = triton.cdiv(n, bn), 1
    while programs * split < 3 * num_sms and kw // (split * 2) >= 4 * bkw:
        split *= 2
    return gemv_rows(GemvTiles(bn, bkw, split), m)


def gemv_rows(config: GemvTiles, m: int) -> GemvTiles:
    """Tiles chosen for one row, fitted to m: each row keeps its own [BLOCK_KW, BLOCK_N] sums, so beyond two
    rows a step takes half the words (8 words per thread a step with 4 rows spill registers on sm_90)."""
    return config if m <= 2 else replace(config, block_kw=max(4, config.block_kw // 2))


@cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def weight_only_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    config: Tiles | MidTiles | GemvTiles | None = None,
    counters: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
    fragments: dict[tuple[int, bool], torch.Tensor] | None = None,
) -> torch.Tensor:
    """[M, K] activations x the packed [K, N] weight -> [M, N] in x's dtype, x's columns taken in `perm`'s
    order when given (an act-order weight's rows sorted by group: the GEMV and the decode tl.dot kernel read
    them so, the prompt kernel gets them gathered). `config` overrides the tiles (bench/quant_gpu.py --sweep
    times candidates) and so the kernel: GemvTiles the GEMV, MidTiles the decode tl.dot kernel (M <=
    block_m), Tiles the prompt kernel. MidTiles with `fragment` take the weight in the fragment layout
    (fragment_pack of the packed weight: [N, K / 8]), every other kernel the packed [K * bits / 32, N].
    `fragments`: the weight's copies in fragment layouts by (kwidth, trans) (WeightOnlyLinear keeps those
    MID_TABLE's tiles for its shape read, fragment_layouts); with them, or without config, qweight is the
    packed layout whatever the tiles: the table's fragment tiles read their copy, or, where none is kept,
    give way to their plain-layout tiles (table_tiles); a given config's fragment tiles without a copy run on
    it as their plain twin (fragment 0).
    `counters`: zeroed int32, one per output slice of a split kernel (N / 16 serve every tile), that a split
    launch leaves zeroed; WeightOnlyLinear owns one so a decode step allocates none."""
    m, k = x.shape
    if config is None:  # the table's tiles, for the packed weight or a copy of it
        config = table_tiles(bits, m, qweight.shape[1], k, group_size, _num_sms(x.device), set(fragments or ()))
        if isinstance(config, MidTiles) and config.fragment:
            qweight = fragments[config.fragment, config.trans]
    elif fragments is not None and isinstance(config, MidTiles) and config.fragment:
        copy = fragments.get((config.fragment, config.trans))
        qweight, config = (qweight, replace(config, fragment=0)) if copy is None else (copy, config)
    fragment = isinstance(config, MidTiles) and config.fragment
    n = qweight.shape[0 if fragment else 1]
    assert qweight.shape[1 if fragment else 0] * (32 // bits) == k
    assert scales.shape == zeros.shape == (-(-k // group_size), n)
    if isinstance(config, GemvTiles):
        return _gemv(x, qweight, scales, zeros, bits, group_size, config, counters, perm)
    if isinstance(config, MidTiles):
        return _mid(x, qweight, scales, zeros, bits, group_size, config, counters, perm)
    if perm is not None:
        x = x[:, perm]
    config.check(k, group_size)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _weight_only_kernel[grid](
        x, qweight, scales, zeros, out, m, n, k, x.stride(0), x.stride(1),
        BITS=bits, GROUP=group_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PRECISION=_precision(x), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def table_tiles(
    bits: int, m: int, n: int, k: int, group_size: int, num_sms: int, layouts: set[tuple[int, bool]]
) -> Tiles | MidTiles | GemvTiles:
    """The tables' tiles for m rows of a [K, N] weight: the GEMV's up to GEMV_MAX_M rows, the decode tl.dot
    kernel's up to MID_MAX_M, the prompt kernel's beyond. A fragment tile whose layout, (kwidth, trans), is not
    in `layouts` (the copies the weight keeps) gives way to MID_PLAIN_TABLE's tiles for its shape: the fastest
    on the packed weight (its plain twin may be far slower: at the 8B's 16-row shapes the step took 6.17 ms
    against 5.05 for those tiles on the H200)."""
    if 0 < m <= GEMV_MAX_M[bits]:
        return gemv_tiles(bits, n, k, num_sms, m)
    if m > MID_MAX_M:
        return tiles(m, n, k, group_size)
    config = mid_tiles(bits, m, n, k, group_size, num_sms)
    if config.fragment and (config.fragment, config.trans) not in layouts:
        plain = MID_PLAIN_TABLE.get((bits, k, n, config.block_m))
        config = plain if plain is not None and group_size % plain.block_k == 0 else replace(config, fragment=0)
    return config


def fragment_layouts(bits: int, k: int, n: int) -> set[tuple[int, bool]]:
    """The fragment layouts, (kwidth, trans), that MID_TABLE's tiles for a [K, N] weight read: WeightOnlyLinear
    keeps a fragment_pack copy in each (for the 8B's W4 weights every layout listed costs their packed size
    again: ~3.5 GB)."""
    listed = (t for (b, tk, tn, _), t in MID_TABLE.items() if (b, tk, tn) == (bits, k, n) and t.fragment)
    return {(t.fragment, t.trans) for t in listed}


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _split(length: int, step: int, split: int) -> tuple[int, int]:
    """K's `length` rows cut into at most `split` spans of whole steps: (span, programs), no program left
    without rows."""
    span = triton.cdiv(triton.cdiv(length, step), split) * step
    return span, triton.cdiv(length, span)


def _split_buffers(
    split: int, block_m: int, n: int, slices: int, counters, device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """A split launch's partials [split, block_m, n] in `dtype` (no memset: every element read is written
    first) and its counters (a fresh zeroed array when none is given); typed placeholders when K is not split."""
    if split == 1:
        return torch.empty(1, dtype=dtype, device=device), torch.empty(1, dtype=torch.int32, device=device)
    if counters is None:
        counters = torch.zeros(slices, dtype=torch.int32, device=device)
    assert counters.numel() >= slices and counters.dtype == torch.int32
    return torch.empty((split, block_m, n), dtype=dtype, device=device), counters


@cache
def _runs_ptx() -> bool:
    """Whether kernels compile to PTX, which inline assembly needs (the interpreter runs none)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def _packs(x: torch.Tensor, bits: int) -> bool:
    """Whether MidTiles.packed applies: 4-bit fields, 16-bit activations (packed halves of their type) and
    PTX to run."""
    return bits == 4 and x.dtype in (torch.bfloat16, torch.float16) and _runs_ptx()


def _mid(x, qweight, scales, zeros, bits, group_size, config: MidTiles, counters, perm) -> torch.Tensor:
    """One launch of the decode tl.dot kernel: one program per output slice and span of K covers every row."""
    m, k = x.shape
    n = qweight.shape[0 if config.fragment else 1]
    config.check(k, group_size)
    assert m <= config.block_m, f"{config} covers {config.block_m} rows, not {m}"
    if config.fragment and (bits != 4 or (config.trans and n % 16)):
        raise ValueError(f"{config}: the fragment layout packs 4-bit weights (N a multiple of 16 for trans)")
    if config.packed and not _packs(x, bits):
        config = replace(config, packed=False, masked=True)  # the same weights, unpacked one at a time
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    slices = triton.cdiv(n, config.block_n)
    span, split = _split(k, config.block_k, config.split)
    part, counters = _split_buffers(split, config.block_m, n, slices, counters, x.device)
    _mid_kernel[(slices, split)](
        x, qweight, scales, zeros, out if perm is None else perm, out, part, counters,
        m, n, k, x.stride(0), x.stride(1), span, split, group_size, qweight.stride(0),
        BITS=bits, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SCALE_AT_END=group_size % span == 0, TRANS=config.trans, HAS_PERM=perm is not None,
        PRECISION=_precision(x), MASKED=config.masked, FRAGMENT=config.fragment, PACKED=config.packed,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl.launch(x.device, m),
    )  # fmt: skip
    return out


# fragment_pack's layouts: the view of the [K, N] fields taken (input bits high to low, then outputs) and its
# order as the words lay them out, per (kwidth, trans). Plain: per output, per 128 inputs (block b), [t, c, half, p1,
# p0]; trans: per 16 outputs (group g) and 64 inputs (block b), [r, t, r8, c, half, p1, p0].
_FRAGMENT_VIEW = {
    (2, False): ((4, 2, 2, 4, 2, -1), (6, 0, 4, 1, 2, 3, 5)),  # [b, c, half, p1, t, p0, n]
    (4, False): ((4, 2, 4, 2, 2, -1), (6, 0, 3, 1, 2, 4, 5)),  # [b, c, half, t, p1, p0, n]
    (2, True): ((2, 2, 2, 4, 2, -1, 2, 8), (6, 0, 8, 4, 7, 1, 2, 3, 5)),  # [b, c, half, p1, t, p0, g, r8, r]
}


def fragment_pack(qweight: torch.Tensor, kwidth: int = 2, trans: bool = False) -> torch.Tensor:
    """A 4-bit weight packed [K / 8, N] (pack_int32 along K) -> the fragment layout the decode tl.dot kernel reads
    with MidTiles.fragment = kwidth (and `trans` as the tiles'): N * K / 8 int32 as [N, K / 8]. Plain, for
    mma.sync's second operand: each output's inputs in blocks of 128, a block's 16 words in order (t, c) for t,
    c < 4, field (half, p1, p0) (bits 16 half + 8 p1 + 4 p0) of word (t, c) holding input 32c + 16 half + 8 p1
    + 2t + p0 (kwidth 2) or 32c + 16 half + 4t + 2 p1 + p0 (4): the inputs a thread holds of the operand in
    the layout Triton gives it (kWidth 2: Triton 3.9; 4: Triton 3.6), _fragment_tile. Trans, for wgmma's
    first operand (kwidth 2, N a multiple of 16): per 16 outputs and 64 inputs, _fragment_rows."""
    from engine.quant import pack_int32, unpack_int32

    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if k % 128 or (trans and n % 16):
        raise ValueError(f"the fragment layout takes K in blocks of 128 (and N of 16 for trans), not K={k}, N={n}")
    view, order = _FRAGMENT_VIEW[(kwidth, trans)]
    q = unpack_int32(qweight, 4, dim=0).view(-1, *view[:5], *((n,) if not trans else (n // 16, *view[6:])))
    return pack_int32(q.permute(order).reshape(n, k), 4, dim=1)


def fragment_unpack(words: torch.Tensor, kwidth: int = 2, trans: bool = False) -> torch.Tensor:
    """fragment_pack's inverse: the fragment layout [N, K / 8] -> the packed [K / 8, N]."""
    from engine.quant import pack_int32, unpack_int32

    n, k = words.shape[0], words.shape[1] * 8
    view, order = _FRAGMENT_VIEW[(kwidth, trans)]
    sizes = [k // (128 if not trans else 64), *view[:5], *((n,) if not trans else (n // 16, *view[6:]))]
    q = unpack_int32(words, 4, dim=1).reshape(*(sizes[i] for i in order))
    back = [order.index(i) for i in range(len(order))]
    return pack_int32(q.permute(back).reshape(k, n), 4, dim=0)


def gemv_scales(bits: int, k: int, group_size: int, span: int, block_kw: int) -> int:
    """Where the GEMV applies scales and zero points (its SCALES): 0 once per program, where a program's span
    of `span` words lies in one group (per-channel weights); 1 per step, where a step does; 2 per word row."""
    per_word = 32 // bits
    if k <= group_size or group_size % (span * per_word) == 0:
        return 0
    return 1 if group_size % (block_kw * per_word) == 0 else 2


def _gemv(x, qweight, scales, zeros, bits, group_size, config: GemvTiles, counters, perm) -> torch.Tensor:
    """One GEMV launch; the float32 partials of a split K go to a [split, BLOCK_M, N] buffer."""
    m, k = x.shape
    n = qweight.shape[1]
    kw = qweight.shape[0]
    block_m = triton.next_power_of_2(m)
    assert block_m <= 4, "the GEMV keeps one accumulator per row, four at most"
    slices = triton.cdiv(n, config.block_n)
    span, split = _split(kw, config.block_kw, config.split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:  # nothing to launch (block_m would be 0); only explicit tiles get here with no rows
        return out
    part, counters = _split_buffers(split, block_m, n, slices, counters, x.device)
    even = n % config.block_n == 0 and kw % config.block_kw == 0
    # The L2 prefetch (inline PTX) takes whole slices and steps and no cp.async pipeline.
    l2_ahead = config.l2_ahead if even and config.num_stages == 1 and _runs_ptx() else 0
    _gemv_kernel[(slices, split)](
        x, qweight, scales, zeros, out if perm is None else perm, out, part, counters,
        m, n, kw, x.stride(0), x.stride(1), span, split,
        BITS=bits, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_KW=config.block_kw,
        SCALES=gemv_scales(bits, k, group_size, span, config.block_kw), PREFETCH=config.prefetch,
        STAGES=config.num_stages, EVEN=even, HAS_PERM=perm is not None, num_warps=config.num_warps,
        **pdl.launch(x.device, m), L2_AHEAD=l2_ahead,
    )  # fmt: skip
    return out
