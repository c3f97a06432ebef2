"""W8A8 on CUDA: activations quantized per row in one launch, and an 8-bit GEMM with the scales in its epilogue.

quantize_rows rounds exactly as engine/layers/linear.py's torch reference (quantize_per_row and a static
scale): the scale is amax / qmax in float32 (IEEE division), each value x / scale clamped to +-qmax, then
rounded to nearest even (int8) or cast to E4M3 (also round to nearest even). scaled_matmul multiplies 8-bit
rows by an 8-bit [N, K] weight on tensor cores, int8 into int32 (exact), fp8 into float32, then applies the
row and channel scales in the order the reference does: (acc * row_scale) * channel_scale, rounded once to
the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.quant_tiles import ROW_TILES, W8A8_TABLE, RowTiles, Tiles

FP8 = torch.float8_e4m3fn


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_ptr, K, sxm,
    QMAX: tl.constexpr, INT8: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
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
        scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), QMAX)
    # NaNs seen in the row: tl.maximum / tl.minimum return the non-NaN operand (maxnum), so a NaN would
    # otherwise become -QMAX and the row a finite, wrong result. The row's scale is made NaN instead, and
    # with it the row's output, which the engine's non-finite-logits check then fails on its own.
    nans = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        v = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        nans = tl.where(v != v, v, nans)
        v = tl.minimum(tl.maximum(tl.div_rn(v, scale), -QMAX), QMAX)
        if INT8:
            # Adding and taking away 1.5 * 2**23 leaves |v| < 2**22 rounded to an integer, to nearest even
            # (float32 addition's rounding); exact after the clamp to +-127.
            q = ((v + 12582912.0) - 12582912.0).to(tl.int8)
        else:
            q = v.to(tl.float8e4nv)
        tl.store(q_ptr + row * K + k0 + offs, q, mask=mask)
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
        QMAX=127.0 if qdtype == torch.int8 else torch.finfo(FP8).max, INT8=qdtype == torch.int8,
        STATIC=static_scale is not None, BLOCK=min(config.block, triton.next_power_of_2(k)),
        num_warps=config.num_warps,
    )  # fmt: skip
    return q, scales


@triton.jit
def _scaled_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, out_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INT8: tl.constexpr,
):  # fmt: skip
    """out = (a @ b.T) * a_scale * b_scale for a [M, K] and b [N, K], both int8 or both fp8, K contiguous."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if INT8 else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
        # out_dtype must name the accumulator's type: Triton 3.6 rejects an int32 acc under the float32 default.
        acc = tl.dot(a, b, acc, out_dtype=tl.int32 if INT8 else tl.float32)
    a_scale = tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)
    b_scale = tl.load(bs_ptr + offs_n, mask=mask_n, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


def w8a8_tiles(kind: str, n: int, k: int) -> Tiles:
    """W8A8_TABLE's entry for ("int8" or "fp8", K, N), else 16 rows (the smallest 8-bit MMA) by 32 outputs: a
    decode batch gets N / 32 programs (128 for the 8B's N = 4096) streaming 128-input steps, four in flight."""
    return W8A8_TABLE.get((kind, k, n), Tiles(16, 32, 128, 1, num_warps=4, num_stages=4))


def scaled_matmul(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    config: Tiles | None = None,
) -> torch.Tensor:
    """(a [M, K] @ b [N, K].T) * a_scale [M, 1] * b_scale [1, N] -> [M, N] in out_dtype; a and b both int8 or
    both fp8 E4M3."""
    m, k = a.shape
    n = b.shape[0]
    int8 = a.dtype == torch.int8
    config = config or w8a8_tiles("int8" if int8 else "fp8", n, k)
    assert config.split == 1 and a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n))
    _scaled_gemm_kernel[grid](
        a, b, a_scale, b_scale, out, m, n, k,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, INT8=int8,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
