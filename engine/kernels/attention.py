"""Paged attention in Triton: the tile loop every attention kernel here shares, and the varlen causal
prefill kernel (decode.py has the split-KV decode kernel, prefill_fresh.py the whole-prompt one).

The paged kernels read K and V through block tables from the cache layout of engine/attention/base.py:
k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim]; position p of sequence s
lives in block block_tables[s, p // block_size] at offset p % block_size. The new tokens' K/V
are already in the cache, so both kernels read everything from there.

GQA is handled the same way in both kernels: the G = H / KVH query heads that share a KV head
are packed into the M (row) dimension of one program, so every K/V tile is loaded once per KV
head instead of once per query head.

The math is FlashAttention-2: scores in fp32, online softmax (running max and sum, rescaled
accumulator), base-2 exponentials with log2(e) folded into the scale.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from engine.kv_fp8 import is_fp8

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _kv_offsets(bt_row_ptr, pos, pos_ok, kvh, stride_b, stride_s, stride_h, BLOCK_SIZE: tl.constexpr):
    """Element offset of each key position's row for KV head kvh, gathered through the block table."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    # int64: num_blocks * block stride can pass 2**31 on a large cache.
    return block.to(tl.int64) * stride_b + (pos % BLOCK_SIZE) * stride_s + kvh * stride_h


# How an fp8 K/V tile becomes q's dtype in registers (the kernels' WIDEN constexpr):
# "cast" is triton's conversion; on an H100 it lowers e4m3 -> bf16 to cvt.rn.f16x2.e4m3x2 plus a
# cvt.bf16.f16 per element, 1.5 conversion instructions per element at 16 per clock per SM: as many
# cycles as streaming the bytes takes, so the decode kernel was conversion-bound over fp8.
# "bits" moves the fp8 sign / exponent / mantissa bits into q's 16-bit format with integer ops and
# leaves the exponent bias out (the value comes out times 2^-(bias difference), undone once per score
# and per output row with the scales): exact, interpreter-safe, one element at a time.
# "asm" is the same bits four bytes at a time in PTX (two prmt + shift/and/or per pair, no cvt); it
# needs a GPU, and the kernels' callers switch it to "bits" under the interpreter.
# "f16" runs the attention in float16 whatever q's 16-bit dtype: q is cast to float16 once per program,
# tiles go e4m3 -> f16 by one cvt.rn.f16x2.e4m3x2 per two elements (e5m2 is f16's high byte), the softmax
# weights enter P @ V as float16. Exact for every fp8 code (f16 holds them all); q loses nothing a bf16 q
# has (f16 has more mantissa) unless beyond f16's range, where it is clamped (a q entry past 65504 is
# outside any model we serve). An Nsight Compute look at "asm" on the H100 found the decode kernel bound
# by its integer widening work (IMAD / LOP3 / PRMT / SHF 58% of its instructions), not by HBM.
# "words" is f16 whose V tile (and K tile) is read as 32-bit words, four codes each, widened four at a time
# (two cvt.rn.f16x2.e4m3x2 per word on the GPU) and joined back into [keys, dims] in registers: the
# float16 tile then reaches the MMA through shared memory as 16-bit rows (ldmatrix), not as bytes
# gathered one at a time (an fp8 V must be transposed for P @ V, which the 8-bit operand path does byte by byte).
WIDENS = ("cast", "bits", "asm", "f16", "words")
_F16 = WIDENS.index("f16")
# Four fp8 e4m3 codes of a 32-bit word as four float16 values (exact): two conversions of two codes each.
_WORDS_ASM = (
    "{ .reg .b16 lo, hi; .reg .b32 a, b;\n"
    "mov.b32 {lo, hi}, $4;\n"
    "cvt.rn.f16x2.e4m3x2 a, lo;\n"
    "cvt.rn.f16x2.e4m3x2 b, hi;\n"
    "mov.b32 {$0, $1}, a;\n"
    "mov.b32 {$2, $3}, b; }"
)


@dataclass(frozen=True)
class Fp8Widen:
    """The constexprs of a widening: WIDEN (index in WIDENS), WIDEN_SHIFT (bits the fp8 code moves right
    inside a 16-bit lane), PRESCALE (q and the softmax weights are multiplied by it before their dots, so
    that the products of the unbiased, tiny K and V stay normal float32 numbers) and UNBIAS (what every
    score and output row is multiplied by to undo both)."""

    WIDEN: int = 0
    WIDEN_SHIFT: int = 0
    PRESCALE: float = 1.0
    UNBIAS: float = 1.0
    WIDEN_ASM: str = ""


def _widen_asm(shift: int) -> str:
    """PTX of the asm widening: prmt puts codes 0, 1 (then 2, 3) of the input register into the high
    bytes of two 16-bit lanes, zeros below; the sign stays, the rest moves `shift` bits down."""
    mag = 0x7F00 >> shift
    return (
        "{ .reg .b32 z, a, b, c, d;\n"
        "mov.b32 z, 0;\n"
        "prmt.b32 a, $2, z, 0x1404;\n"
        "prmt.b32 b, $2, z, 0x3424;\n"
        f"shr.b32 c, a, {shift};\n"
        f"shr.b32 d, b, {shift};\n"
        f"and.b32 c, c, {(mag << 16) | mag};\n"
        f"and.b32 d, d, {(mag << 16) | mag};\n"
        "and.b32 a, a, 0x80008000;\n"
        "and.b32 b, b, 0x80008000;\n"
        "or.b32 $0, a, c;\n"
        "or.b32 $1, b, d; }"
    )


# (exponent bits, exponent bias) of the formats the bits widening maps between.
_FORMATS = {
    torch.float8_e4m3fn: (4, 7),
    torch.float8_e5m2: (5, 15),
    torch.bfloat16: (8, 127),
    torch.float16: (5, 15),
}
# bf16 K/V widened by bits are 2^-120 (e4m3) or 2^-112 (e5m2) times their value: a q or softmax weight
# below 1 times such a number would fall under float32's normal range inside the MMA. q and the weights
# go into their dots times 2^64 (exact; no bf16 q reaches 2^64), which keeps every product that matters
# normal; fp16 keeps its values within 2^-8 of the true ones and needs no prescale.
_PRESCALE_EXP = {torch.bfloat16: 64, torch.float16: 0}


def fp8_widen(
    cache_dtype: torch.dtype, q_dtype: torch.dtype, widen: str, on_gpu: bool, head_dim: int = 128
) -> Fp8Widen:
    """The widening constexprs for an fp8 cache read by a q of q_dtype; "cast" for a float32 q (its
    dots run in float32, there is no 16-bit lane to fill), "bits" in place of "asm" off the GPU, and
    "f16" in place of "words" for e5m2 or a head dim that is not a power of two (the tile's width)."""
    assert widen in WIDENS, f"widen must be one of {WIDENS}"
    if widen == "cast" or q_dtype not in _PRESCALE_EXP:
        return Fp8Widen()
    words_fit = cache_dtype == torch.float8_e4m3fn and head_dim == triton.next_power_of_2(head_dim) >= 4
    if widen == "f16" or (widen == "words" and not words_fit):
        return Fp8Widen(WIDEN=_F16)  # words' conversion is e4m3's; e5m2 takes f16's
    if widen == "words":
        return Fp8Widen(WIDEN=WIDENS.index(widen), WIDEN_ASM=_WORDS_ASM if on_gpu else "")
    if widen == "asm" and not on_gpu:
        widen = "bits"
    (fp8_exp, fp8_bias), (q_exp, q_bias) = _FORMATS[cache_dtype], _FORMATS[q_dtype]
    prescale = _PRESCALE_EXP[q_dtype]
    shift = q_exp - fp8_exp
    asm = _widen_asm(shift) if widen == "asm" else ""
    return Fp8Widen(WIDENS.index(widen), shift, 2.0**prescale, 2.0 ** (q_bias - fp8_bias - prescale), asm)


@triton.jit
def _widen_fp8(x, like, WIDEN: tl.constexpr, WIDEN_SHIFT: tl.constexpr, WIDEN_ASM: tl.constexpr):
    """An fp8 tile in the dtype of the tensor `like` (Fp8Widen): exact for cast; times 2^-(bias difference)
    for bits and asm."""
    if WIDEN == 0 or WIDEN == 3:  # cast, f16 (`like` is the float16 q then)
        return x.to(like.dtype)
    # The fp8 code in the high byte of a 16-bit lane: sign in place, exponent and mantissa shifted down
    # to the lane's exponent field (a zero code stays 0, subnormals stay subnormal).
    MAG: tl.constexpr = 0x7F00 >> WIDEN_SHIFT
    if WIDEN == 1:
        lane = x.to(tl.uint8, bitcast=True).to(tl.uint16) << 8
        return ((lane & 0x8000) | ((lane >> WIDEN_SHIFT) & MAG)).to(like.dtype, bitcast=True)
    # Four codes per 32-bit register in, two lanes per register out (Fp8Widen.WIDEN_ASM).
    return tl.inline_asm_elementwise(
        WIDEN_ASM, "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=like.dtype, is_pure=True, pack=4
    )


@triton.jit
def _load_fp8_words(ptr, offs, pos_ok, BOUNDED: tl.constexpr, BLOCK_D: tl.constexpr, WIDEN_ASM: tl.constexpr):
    """The [keys, BLOCK_D] e4m3 tile at row offsets `offs` (elements = bytes) as float16, read as 32-bit words
    and widened four codes at a time ("words" in WIDENS); BLOCK_D is the head dim (a multiple of 4)."""
    words = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    w_offs = (offs // 4)[:, None] + tl.arange(0, BLOCK_D // 4)[None, :]
    if BOUNDED:
        w = tl.load(words + w_offs, mask=pos_ok[:, None], other=0)
    else:
        w = tl.load(words + w_offs)
    if WIDEN_ASM != "":
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            WIDEN_ASM, "=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 4, is_pure=True, pack=1
        )
    else:  # the interpreter: the same values by triton's casts
        c0 = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c1 = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c2 = ((w >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c3 = ((w >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    # join adds its axis last: [keys, words, 2 (inner joins' axis), 2 (outer's)], so code 2 * p + q of word i
    # sits at [.., i, p, q], which is dim 4 * i + 2 * p + q row-major.
    x = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    return tl.reshape(x, (offs.shape[0], BLOCK_D))


@triton.jit
def _fp8_scales(qk_scale, k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr, UNBIAS: tl.constexpr = 1.0):
    """(softmax scale, output scale): an fp8 cache's K scale multiplies every score, so it joins the
    softmax scale; its V scale multiplies every output row, so it is applied once at the end. Both
    read on the device (a CUDA graph sees scales set after its capture). UNBIAS: Fp8Widen's."""
    if KV_FP8:
        return qk_scale * (tl.load(k_scale_ptr) * UNBIAS), tl.load(v_scale_ptr) * UNBIAS
    return qk_scale, 1.0


@triton.jit
def _prescale_q(q, KV_FP8: tl.constexpr, PRESCALE: tl.constexpr, WIDEN: tl.constexpr = 0):
    """q times Fp8Widen.PRESCALE (exact: a power of two), once per program before its key loop; float16 for
    the f16 widening (clamped to its range)."""
    # One return: compiled Triton types every return statement of a function, taken branch or not.
    if KV_FP8 and WIDEN >= 3:
        out = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    elif KV_FP8 and PRESCALE != 1.0:
        out = (q.to(tl.float32) * PRESCALE).to(q.dtype)
    else:
        out = q
    return out


@triton.jit
def _attend_keys(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_ptr,
    v_ptr,
    bt_row_ptr,
    kvh,
    lo,
    hi,
    qk_scale,
    stride_b,
    stride_s,
    stride_h,
    d,
    d_ok,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    BOUNDED: tl.constexpr,
    PRECISION: tl.constexpr,
    FOLD_SCALE: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
    WIDEN: tl.constexpr = 0,
    WIDEN_SHIFT: tl.constexpr = 0,
    PRESCALE: tl.constexpr = 1.0,
    WIDEN_ASM: tl.constexpr = "",
):
    """Fold keys lo..hi-1 into the running softmax state of the query rows q.

    CAUSAL masks key positions after each row's q_pos; BOUNDED masks positions >= hi. Callers
    turn both off for the key tiles every row sees in full, which skips the masking work there.
    FOLD_SCALE applies the softmax scale to the row maxima and inside the exponent's
    multiply-add instead of to every score first, and accumulates P @ V inside the MMA.
    KV_FP8: the cache holds fp8; its tiles are widened to q's dtype in registers (_widen_fp8, WIDEN*),
    and the caller has folded the K scale into qk_scale and multiplies the output by the V scale
    (_fp8_scales), both times Fp8Widen.UNBIAS; q comes in times PRESCALE (_prescale_q), and the softmax
    weights go into the P @ V dot times PRESCALE here.
    """
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        if BOUNDED:
            pos_ok = pos < hi
            load_ok = pos_ok[:, None] & d_ok[None, :]
        else:
            pos_ok = pos >= 0
            load_ok = d_ok[None, :]
        offs = _kv_offsets(bt_row_ptr, pos, pos_ok, kvh, stride_b, stride_s, stride_h, BLOCK_SIZE)
        if KV_FP8 and WIDEN == 4:
            k = _load_fp8_words(k_ptr, offs, pos_ok, BOUNDED, d.shape[0], WIDEN_ASM)
        else:
            k = tl.load(k_ptr + offs[:, None] + d[None, :], mask=load_ok, other=0.0)
        if KV_FP8 and WIDEN != 4:
            k = _widen_fp8(k, q, WIDEN, WIDEN_SHIFT, WIDEN_ASM)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if not FOLD_SCALE:
            scores = scores * qk_scale
        if CAUSAL:
            visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        elif BOUNDED:
            scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        # Every row has a finite score in its first tile (key 0 is visible to every query,
        # and a decode split's first tile holds at least one key), so m_new is never -inf
        # and exp2(m_i - m_new) never sees -inf - -inf.
        if FOLD_SCALE:
            # qk_scale > 0, so scaling the maximum equals the maximum of the scaled scores.
            m_new = tl.maximum(m_i, tl.max(scores, 1) * qk_scale)
            p = tl.exp2(scores * qk_scale - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8 and WIDEN == 4:
            v = _load_fp8_words(v_ptr, offs, pos_ok, BOUNDED, d.shape[0], WIDEN_ASM)
        else:
            v = tl.load(v_ptr + offs[:, None] + d[None, :], mask=load_ok, other=0.0)
        if KV_FP8 and WIDEN != 4:
            v = _widen_fp8(v, q, WIDEN, WIDEN_SHIFT, WIDEN_ASM)
            if PRESCALE != 1.0:
                p = p * PRESCALE
        if FOLD_SCALE:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    bt_ptr,
    query_start_ptr,
    seq_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    tile_map_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_b,
    stride_s,
    stride_h,
    stride_bt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    FOLD_SCALE: tl.constexpr = False,
    KV_FP8: tl.constexpr = False,
    WIDEN: tl.constexpr = 0,
    WIDEN_SHIFT: tl.constexpr = 0,
    PRESCALE: tl.constexpr = 1.0,
    UNBIAS: tl.constexpr = 1.0,
    WIDEN_ASM: tl.constexpr = "",
    TILE_MAP: tl.constexpr = False,
):
    # Row r of the tile is query first_q + r // GROUP of head kvh * GROUP + r % GROUP.
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    if TILE_MAP:
        # A fixed grid (a captured graph's): program i runs tile tile_map[i] = (sequence, query tile), or
        # nothing past the step's tiles (sequence -1).
        seq = tl.load(tile_map_ptr + 2 * tl.program_id(0))
        if seq < 0:
            return
        tile = tl.load(tile_map_ptr + 2 * tl.program_id(0) + 1)
    else:
        # Highest query tiles see the most keys; launching them first shortens the tail.
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    first_q = tile * BLOCK_Q
    if first_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context + q_idx
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    token = (q_begin + q_idx).to(tl.int64)
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    bt_row_ptr = bt_ptr + seq * stride_bt
    qk_scale, v_scale = _fp8_scales(qk_scale, k_scale_ptr, v_scale_ptr, KV_FP8, UNBIAS)
    q = _prescale_q(q, KV_FP8, PRESCALE, WIDEN)
    # Keys 0..context+first_q are visible to every row; whole tiles of them need no mask.
    full_end = (context + first_q + 1) // BLOCK_N * BLOCK_N
    # The last valid query of the tile bounds the key loop (causal early stop).
    kv_end = context + tl.minimum(first_q + BLOCK_Q, q_len)
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_ptr,
        v_ptr,
        bt_row_ptr,
        kvh,
        0,
        full_end,
        qk_scale,
        stride_b,
        stride_s,
        stride_h,
        d,
        d_ok,
        BLOCK_SIZE,
        BLOCK_N,
        False,
        False,
        PRECISION,
        FOLD_SCALE,
        KV_FP8,
        WIDEN,
        WIDEN_SHIFT,
        PRESCALE,
        WIDEN_ASM,
    )
    acc, m_i, l_i = _attend_keys(
        acc,
        m_i,
        l_i,
        q,
        q_pos,
        k_ptr,
        v_ptr,
        bt_row_ptr,
        kvh,
        full_end,
        kv_end,
        qk_scale,
        stride_b,
        stride_s,
        stride_h,
        d,
        d_ok,
        BLOCK_SIZE,
        BLOCK_N,
        True,
        True,
        PRECISION,
        FOLD_SCALE,
        KV_FP8,
        WIDEN,
        WIDEN_SHIFT,
        PRESCALE,
        WIDEN_ASM,
    )
    acc = acc / l_i[:, None]
    if KV_FP8:
        acc = acc * v_scale
    o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass(frozen=True)
class PrefillTiles:
    """paged_prefill's tiling for one cache kind: query rows per program (G heads x block_m / G queries),
    keys per tile (at head_dim <= 128; half that above), warps, stages, and the fp8 widening (WIDENS)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    widen: str = "cast"


# 64 rows: G heads x 64/G queries. A pure long prefill costs the same K/V traffic as one head per program,
# while short queries (chunk tails, q_len 1 rows in mixed batches) fill the rows. 64x64 tiles, 4 warps, 2
# stages: best or within 3% of a 24-config sweep on an H100 (bf16, D 64 and 128, G 2..4), about 60% of
# cuDNN's dense causal attention there. The folded scale gained 3% there (283 -> 292 TFLOP/s at 8 x 2k,
# 336 -> 346 at 2 x 8k). fp8: the same tiles, widened by the asm bit moves (in a prefill tile every K/V
# byte feeds 64 query rows, so widening costs less than in decode; words / f16 were no faster on the H200,
# bench/results/2026-11-26-h200-decd8d2-decode-tiles-words.jsonl). `bash bench/gpu_check.sh decode-tiles`
# times other tilings over fp8 (H100: bench/results/2026-11-25-h100-6a8c92f-decode-tiles.jsonl): block_m
# 128 is no faster for 16 x 512-token prompts (195.7-243 us against 196.1) and slower for 64 one-token rows
# (89.8-114.5 against 55.5 us); block_n 128 is 13% faster for those rows (48.8 us) and 4% slower for the
# prompts (204 us), so the 64 x 64 tiles stay.
PREFILL_TILES = {"16bit": PrefillTiles(), "fp8": PrefillTiles(widen="asm")}


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Shape, dtype and stride checks; host-only, so they cost nothing under graph capture. Returns
    whether the cache is fp8 (then the scales must be given)."""
    assert q.dim() == 3 and k_cache.dim() == 4, (
        "q is [tokens, heads, head_dim], caches [blocks, block_size, kv_heads, head_dim]"
    )
    fp8 = is_fp8(k_cache.dtype)
    assert q.dtype in _DTYPES and k_cache.dtype == v_cache.dtype and (fp8 or k_cache.dtype == q.dtype), (
        "q must be fp16/bf16/fp32, the caches q's dtype or both one fp8 type"
    )
    assert not fp8 or (k_scale is not None and v_scale is not None), "an fp8 cache needs k_scale and v_scale"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), (
        "k_cache and v_cache must match in shape and strides"
    )
    head_dim, kv_heads, block_size = q.shape[2], k_cache.shape[2], k_cache.shape[1]
    assert k_cache.shape[3] == head_dim, "q and cache head_dim differ"
    assert 16 <= head_dim <= 256, f"head_dim {head_dim} unsupported: 16..256 (padded to a power of two inside)"
    assert q.shape[1] % kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} must be a power of two"
    assert q.stride(2) == k_cache.stride(3) == out.stride(2) == 1, "head_dim must be the contiguous dimension"
    assert out.shape == q.shape and out.dtype == q.dtype, "out must be like q"
    return fp8


def _precision(dtype: torch.dtype) -> str:
    # fp32 tl.dot defaults to TF32 on the GPU (~1e-3 error); fp32 callers want fp32 accuracy.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_m(tiles: PrefillTiles, group: int) -> int:
    return max(tiles.block_m, triton.next_power_of_2(group))


def prefill_queries_per_tile(heads: int, kv_heads: int, fp8: bool) -> int:
    """Queries one paged_prefill program attends (of each of the G = heads / kv_heads heads of its KV head),
    with the default tiles: the unit of prefill_tile_map."""
    group = heads // kv_heads
    return _block_m(PREFILL_TILES["fp8" if fp8 else "16bit"], group) // group


def prefill_tile_capacity(num_tokens: int, num_seqs: int, queries_per_tile: int) -> int:
    """Programs (a KV head) that cover any step of up to `num_tokens` tokens in up to `num_seqs` sequences:
    each sequence's last tile may be partial, so at most one tile a sequence more than the tokens fill."""
    return -(-num_tokens // queries_per_tile) + min(num_tokens, num_seqs)


def prefill_tile_map(query_lens: np.ndarray, queries_per_tile: int, out: np.ndarray) -> None:
    """Fill `out` [P, 2] (int32, P at least the tiles needed) with the (sequence, query tile) pairs of a step
    whose sequences have `query_lens` queries each, the highest tiles (those that see the most keys) first,
    and (-1, 0) after them: paged_prefill's `tile_map`."""
    per_seq = -(-query_lens // queries_per_tile)
    total = int(per_seq.sum())
    assert total <= len(out), f"{total} query tiles, room for {len(out)}"
    seq = np.repeat(np.arange(len(query_lens), dtype=np.int32), per_seq)
    tile = np.arange(total, dtype=np.int32) - np.repeat((np.cumsum(per_seq) - per_seq).astype(np.int32), per_seq)
    order = np.argsort(-tile, kind="stable")
    out[:total, 0] = seq[order]
    out[:total, 1] = tile[order]
    out[total:] = (-1, 0)


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
    tile_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat varlen batch q [T, H, D] against the paged cache -> [T, H, D].

    Sequence s owns q[query_start[s]:query_start[s+1]]; its cache holds seq_lens[s] tokens
    including those new ones, so query i sits at position seq_lens[s] - q_len + i. An fp8 cache is
    read as stored * k_scale / v_scale (one-element float32 tensors). `tiles` overrides PREFILL_TILES
    (the sweep of bench/gpu_check.py decode-tiles).

    `tile_map` [P, 2] int32 on the device (a CUDA graph's launch, whose grid cannot follow the step): P
    programs a KV head, program i attending query tile tile_map[i, 1] of sequence tile_map[i, 0] (as
    prefill_tile_map lays them out), or nothing where that is -1; max_query_len is then not read, and rows
    of q that no tile covers (a graph's padding) are left as `out` held them.
    """
    out = torch.empty_like(q) if out is None else out
    fp8 = _check_inputs(q, k_cache, v_cache, out, k_scale, v_scale)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or (tile_map is None and max_query_len == 0):
        return out
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    tiles = tiles or PREFILL_TILES["fp8" if fp8 else "16bit"]
    launch = {
        "BLOCK_M": _block_m(tiles, group),
        "BLOCK_N": tiles.block_n if head_dim <= 128 else tiles.block_n // 2,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
        "FOLD_SCALE": True,
    }
    if fp8:  # the widening's constexprs; a 16-bit cache passes none, so it compiles as before fp8 caches
        launch.update(asdict(fp8_widen(k_cache.dtype, q.dtype, tiles.widen, q.is_cuda, head_dim)))
    if tile_map is not None:
        assert tile_map.dim() == 2 and tile_map.shape[1] == 2 and tile_map.dtype == torch.int32
        assert tile_map.is_contiguous(), "tile_map is read as flat (sequence, tile) pairs"
        assert tiles is PREFILL_TILES["fp8" if fp8 else "16bit"], "a tile map's tiles are the default ones"
        launch["TILE_MAP"] = True
        grid = (tile_map.shape[0], 1, kv_heads)
    else:
        grid = (triton.cdiv(max_query_len, launch["BLOCK_M"] // group), num_seqs, kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start,
        seq_lens,
        # None (a constexpr) for a 16/32-bit cache: the kernel compiles as it did before fp8 caches.
        k_scale if fp8 else None,
        v_scale if fp8 else None,
        tile_map,  # None (a constexpr) without a map
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION=_precision(q.dtype),
        KV_FP8=fp8,
        **launch,
    )
    return out
