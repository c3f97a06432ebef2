"""W8A8 on CUDA: activations quantized per row in one launch, and an 8-bit GEMM with the scales in its epilogue.

quantize_rows rounds exactly as engine/layers/linear.py's torch reference (quantize_per_row and a static
scale): the scale is amax / qmax in float32 (IEEE division), each value x / scale clamped to +-qmax, then
rounded to nearest even (int8) or cast to E4M3 (also round to nearest even). scaled_matmul multiplies 8-bit
rows by an 8-bit [N, K] weight on tensor cores, int8 into int32 (exact), fp8 into float32, then applies the
row and channel scales in the order the reference does: (acc * row_scale) * channel_scale, rounded once to
the output dtype.

Decode batches (M <= BLOCK_M, one program covering every row) split K where N alone gives too few programs
to stream the weight at HBM speed: each program stores its unscaled partial (int32 for int8: the sum stays
exact) and the last of an output slice to arrive adds them and applies the scales (quant_gemm._split_k_reduce,
the weight-only kernels' reduction; counters left zeroed, so a CUDA graph replays it).

fused_scaled_matmul is the same GEMM on unquantized activations: each program quantizes its rows per BLOCK_K
step (scale = the amax of the row's step / qmax; each value times qmax / amax, clamped and rounded as
quantize_rows rounds) and multiplies each step's 8-bit product by the step's row scales before adding it to a
float32 sum: no quantize_rows launch, and scales at least as fine as per row. engine/layers/linear.py
block_scaled_matmul is its torch reference. Which variant and tiles a shape takes is W8A8Tiles'
(engine/kernels/quant_tiles.py W8A8_TABLE, else w8a8_rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.quant_gemm import _num_sms, _split, _split_buffers, _split_k_reduce
from engine.kernels.quant_tiles import ROW_TILES, W8A8_TABLE, RowTiles, W8A8Tiles

FP8 = torch.float8_e4m3fn


def qmax(qdtype: torch.dtype) -> float:
    """The largest magnitude of int8 or fp8 E4M3: the quantizers' QMAX."""
    return 127.0 if qdtype == torch.int8 else torch.finfo(FP8).max


@triton.jit
def _quantize(v, QMAX: tl.constexpr, INT8: tl.constexpr):
    """Scaled float32 values clamped to +-QMAX, to int8 (nearest even) or E4M3."""
    v = tl.minimum(tl.maximum(v, -QMAX), QMAX)
    if INT8:
        # Adding and taking away 1.5 * 2**23 leaves |v| < 2**22 rounded to an integer, to nearest even
        # (float32 addition's rounding); exact after the clamp to +-127.
        q = ((v + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        q = v.to(tl.float8e4nv)
    return q


@triton.jit
def _row_scale(amax, QMAX: tl.constexpr):
    """A row's scale from its absolute maximum: amax / qmax in IEEE float32, floored at 1e-12 / qmax."""
    return tl.div_rn(tl.maximum(amax, 1e-12), QMAX)


@triton.jit
def quantize_row(v, QMAX: tl.constexpr, INT8: tl.constexpr):
    """One whole row in registers (float32, padding 0) quantized as quantize_rows quantizes it: (values, scale),
    the scale NaN where the row holds a NaN (see _quantize_rows_kernel). For the kernels that produce a W8A8
    linear's input (engine/kernels/norm.py, activation.py) and hand it over quantized."""
    scale = _row_scale(tl.max(tl.abs(v), axis=0), QMAX)
    q = _quantize(tl.div_rn(v, scale), QMAX, INT8)
    return q, scale + tl.sum(tl.where(v != v, v, 0.0), axis=0)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_ptr, K, sxm,
    QMAX: tl.constexpr, INT8: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * sxm
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        scale = _row_scale(tl.max(amax, axis=0), QMAX)
    # NaNs seen in the row: tl.maximum / tl.minimum return the non-NaN operand (maxnum), so a NaN would
    # otherwise become -QMAX and the row a finite, wrong result. The row's scale is made NaN instead, and
    # with it the row's output, which the engine's non-finite-logits check then fails on its own.
    nans = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        v = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        nans = tl.where(v != v, v, nans)
        tl.store(q_ptr + row * K + k0 + offs, _quantize(tl.div_rn(v, scale), QMAX, INT8), mask=mask)
    tl.store(scale_ptr + row, scale + tl.sum(nans, axis=0))  # + 0.0, or NaN


def quantize_rows(
    x: torch.Tensor, qdtype: torch.dtype, static_scale: torch.Tensor | None = None, config: RowTiles | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (contiguous [M, K] in fp8 E4M3 or int8, float32 [M, 1] scales): per row (dynamic) or at one
    static scale (then every row's scale is it, the layout torch._scaled_mm's rowwise scaling takes)."""
    m, k = x.shape
    config = config or ROW_TILES
    q = torch.empty((m, k), dtype=qdtype, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scales
    assert x.stride(1) == 1, "rows must be contiguous"
    _quantize_rows_kernel[(m,)](
        x, q, scales, scales if static_scale is None else static_scale, k, x.stride(0),
        QMAX=qmax(qdtype), INT8=qdtype == torch.int8,
        STATIC=static_scale is not None, BLOCK=min(config.block, triton.next_power_of_2(k)),
        num_warps=config.num_warps,
        **pdl.launch(x.device, m),
    )  # fmt: skip
    return q, scales


# An sm_90 fp8 MMA (wgmma, 64-row tiles) adds its products at reduced precision; Triton's default lets the
# whole K loop accumulate that way (up to 4% off float32 on small outputs, 1e-4 of the largest, on an H200).
# Promoting into the float32 accumulator every 128 inputs bounds that (the interval DeepSeek-V3's fp8 GEMMs
# use) at 32 float adds a thread per 64 x 64 x 128 step.
FP8_PROMOTE = tl.constexpr(128)


@triton.jit
def _scaled_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, out_ptr, part_ptr, count_ptr, M, N, K, sam, span, SPLIT,
    QMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INT8: tl.constexpr, FUSED: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    """out = (a @ b.T) * a_scale * b_scale for a [M, K] (rows sam apart) and b [N, K], K contiguous; b int8 or
    fp8, a the same (a_scale its row scales) or, FUSED, 16/32-bit floats quantized here per row and BLOCK_K
    step (as_ptr unused). Program (n, s, m) covers outputs n*BLOCK_N.. of rows m*BLOCK_M.. over inputs
    s*span.. (span a multiple of BLOCK_K); with SPLIT > 1 the grid has one row block (M <= BLOCK_M)."""
    pdl.enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int8 products add exactly in int32; scaled steps (FUSED) and fp8 add in float32.
    ACC: tl.constexpr = tl.int32 if INT8 and not FUSED else tl.float32
    PROMOTE: tl.constexpr = FP8_PROMOTE if BLOCK_K >= FP8_PROMOTE else BLOCK_K  # at most the step's K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
    k_end = tl.minimum((pid_k + 1) * span, K)
    for k0 in range(pid_k * span, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # EVEN_K (BLOCK_K divides K, so every step is whole): no mask along K to compute each step (~10 of the
        # unfused main loop's 70 to 150 instructions on sm_90).
        mask_k = (offs_k < k_end) | EVEN_K
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * sam + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
        if FUSED:
            v = a.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12)
            # A NaN in the step makes its row's scale NaN, and so the row's output (tl.maximum drops NaNs):
            # the engine's non-finite-logits check fails that request, as on the unfused path.
            scale = tl.div_rn(amax, QMAX) + tl.sum(tl.where(v != v, v, 0.0), axis=1)
            # Values times the reciprocal (one IEEE division per row and step: a division per value costs
            # more instructions than the step's tl.dot), as block_scaled_matmul rounds them.
            q = _quantize(v * tl.div_rn(QMAX, amax)[:, None], QMAX, INT8)
            # out_dtype must name the product's type: Triton 3.6 rejects int32 under the float32 default.
            if INT8:
                step = tl.dot(q, b, out_dtype=tl.int32)
            else:
                step = tl.dot(q, b, out_dtype=tl.float32, max_num_imprecise_acc=PROMOTE)
            acc += step.to(tl.float32) * scale[:, None]
        elif INT8:
            acc = tl.dot(a, b, acc, out_dtype=ACC)
        else:
            acc = tl.dot(a, b, acc, out_dtype=ACC, max_num_imprecise_acc=PROMOTE)
    b_scale = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT == 1:
        out = acc.to(tl.float32)
        if not FUSED:
            out = out * tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
        out = out * b_scale[None, :]
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    else:
        # Fused steps are already row-scaled: the channel scale goes on each partial, the reduction adds only.
        part = acc * b_scale[None, :] if FUSED else acc
        tl.store(part_ptr + (pid_k * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :], part, mask=mask)
        _split_k_reduce(out_ptr, part_ptr, count_ptr, pid_n, M, N, offs_n, mask_n, SPLIT, BLOCK_M, BLOCK_N,
                        as_ptr, bs_ptr, not FUSED)  # fmt: skip


def w8a8_tiles(kind: str, m: int, n: int, k: int, num_sms: int) -> W8A8Tiles:
    """W8A8_TABLE's entry for ("int8" or "fp8", K, N) with the smallest BLOCK_M that covers m rows (the sweep
    lists 16 and 64), else w8a8_rule's tiles (BLOCK_M the next power of two >= m, at least 16; 64 above 64)."""
    bm = min(64, max(16, triton.next_power_of_2(m)))
    for listed_m in (16, 32, 64):
        if listed_m >= m and (kind, k, n, listed_m) in W8A8_TABLE:
            return W8A8_TABLE[(kind, k, n, listed_m)]
    return w8a8_rule(bm, m, n, k, num_sms)


def w8a8_rule(bm: int, m: int, n: int, k: int, num_sms: int) -> W8A8Tiles:
    """Tiles for a shape W8A8_TABLE does not list: 64 outputs by 128 inputs a step, 4 warps, 4 stages, the
    unfused kernel; when one program covers every row (m <= bm), K split until 1.5 to 3 programs per SM stream
    the weight, each keeping at least four steps (on an H100's 132 SMs the 8B's N 4096: 64 slices, 4 ways;
    N 6144: 4 ways; N 28672: 448 slices, unsplit)."""
    bn, bk, split = 64, 128, 1
    while m <= bm and 2 * triton.cdiv(n, bn) * split < 3 * num_sms and k // (bk * split * 2) >= 4 and split < 16:
        split *= 2
    return W8A8Tiles(bm, bn, bk, split, num_warps=4, num_stages=4)


def _launch(a, a_scale, b, b_scale, out_dtype, config: W8A8Tiles | None, counters, fused: bool) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    config = config or w8a8_tiles("int8" if b.dtype == torch.int8 else "fp8", m, n, k, _num_sms(a.device))
    assert a.stride(1) == 1 and b.is_contiguous() and b.shape[1] == k
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    slices = triton.cdiv(n, config.block_n)
    span, split = _split(k, config.block_k, config.split)
    assert split == 1 or m <= config.block_m, f"{config}: a split K needs every row in one program, not {m}"
    int8 = b.dtype == torch.int8
    part_dtype = torch.int32 if int8 and not fused else torch.float32
    part, counters = _split_buffers(split, config.block_m, n, slices, counters, a.device, part_dtype)
    _scaled_gemm_kernel[(slices, split, triton.cdiv(m, config.block_m))](
        a, b, a_scale, b_scale, out, part, counters, m, n, k, a.stride(0), span, split,
        QMAX=qmax(b.dtype), BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        INT8=int8, FUSED=fused, EVEN_K=k % config.block_k == 0, num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.launch(a.device, m),
    )  # fmt: skip
    return out


def scaled_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: W8A8Tiles | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """(a [M, K] @ b [N, K].T) * a_scale [M, 1] * b_scale [1, N] -> [M, N] in out_dtype; a and b both int8 or
    both fp8 E4M3. `config` overrides the tiles (its `fused` does not apply: a is quantized already);
    `counters`: zeroed int32, one per output slice of a split launch (N / 16 serve every tile), left zeroed
    (ScaledLinear owns one; a fresh array when None)."""
    assert a.dtype == b.dtype and a.is_contiguous()
    return _launch(a, a_scale, b, b_scale, out_dtype, config, counters, fused=False)


def fused_scaled_matmul(
    x: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: W8A8Tiles | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (float; K contiguous) quantized per row and BLOCK_K step to b's type inside the GEMM, times
    b [N, K] (int8 or fp8 E4M3) with channel scales b_scale [1, N] -> [M, N] in out_dtype: what
    engine/layers/linear.py block_scaled_matmul computes at the tiles' BLOCK_K. config / counters as in
    scaled_matmul."""
    return _launch(x, b_scale, b, b_scale, out_dtype, config, counters, fused=True)
