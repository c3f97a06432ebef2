"""SwiGLU (silu(gate) * up on a fused gate/up projection) as a Triton kernel, optionally quantized per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import pdl
from engine.kernels.quant_tiles import ROW_TILES
from engine.kernels.w8a8 import _quantize, _row_scale, qmax, quantize_row

_BLOCK = 1024
# The quantizing kernel holds a row of up to this many products in registers (16 warps: 32 a thread), so each
# program has its whole row's loads in flight at once (Llama-3-8B's 14336); longer rows go in steps.
WHOLE_ROW_MAX = 16384
# ...but only for batches of up to this many rows. A whole-row program of 16 warps holding 32 products a thread
# fills an SM's registers alone, so a prompt-sized batch streams one row per SM at a time: on an H200, 8192 rows of
# the 8B's 14336 took 418 us whole against 283 us in the two-pass steps (1.40 against 2.07 TB/s), which keep many
# rows in flight per SM and read each row's second pass back from L2; the steps lead by 25-33% from 1024 rows, and
# up to 512 the two forms (tens of us) were each ahead in one of two runs (bench/swiglu_quant_gpu.py,
# 2026-12-01-h200-d7db857-swiglu-quant.jsonl). Decode batches keep the whole rows.
WHOLE_ROW_MAX_ROWS = 512


@triton.jit
def _silu_mul(row, cols, mask, x_s1, inter, dtype: tl.constexpr):
    """silu(gate) * up at `cols` of one row, rounded to `dtype`, returned in float32."""
    gate = tl.load(row + cols * x_s1, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + (cols + inter) * x_s1, mask=mask, other=0.0).to(tl.float32)
    # Like the reference: F.silu rounds to the input dtype, then the product rounds again.
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_s0, x_s1, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl.enter(PDL)
    # Grid: (tokens, column blocks of the intermediate size).
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    h = _silu_mul(x_ptr + t * x_s0, cols, mask, x_s1, inter, dtype)
    tl.store(out_ptr + t * inter + cols, h.to(dtype), mask=mask)  # out is contiguous


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, scale_ptr, x_s0, x_s1, inter,
    QMAX: tl.constexpr, INT8: tl.constexpr, BLOCK: tl.constexpr, WHOLE_ROW: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    """One row's silu(gate) * up quantized as quantize_rows quantizes the rounded product. WHOLE_ROW (BLOCK
    covers the row): the row in registers, read once. Else in BLOCK-column steps, two passes: the row's
    absolute maximum, then the products computed again (the same instructions, so the same values; the row
    is in L2 by then) and stored quantized at the row's scale."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = x_ptr + t * x_s0
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty  # the unquantized product's dtype: gate_up's
    offs = tl.arange(0, BLOCK)
    if WHOLE_ROW:
        mask = offs < inter
        q, scale = quantize_row(_silu_mul(row, offs, mask, x_s1, inter, DTYPE), QMAX, INT8)
        tl.store(q_ptr + t * inter + offs, q, mask=mask)
        tl.store(scale_ptr + t, scale)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        nans = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, inter, BLOCK):
            h = _silu_mul(row, c0 + offs, c0 + offs < inter, x_s1, inter, DTYPE)
            amax = tl.maximum(amax, tl.abs(h))
            nans = tl.where(h != h, h, nans)  # a NaN makes the row's scale NaN, as in quantize_rows
        scale = _row_scale(tl.max(amax, axis=0), QMAX)
        for c0 in range(0, inter, BLOCK):
            mask = c0 + offs < inter
            h = _silu_mul(row, c0 + offs, mask, x_s1, inter, DTYPE)
            tl.store(q_ptr + t * inter + c0 + offs, _quantize(tl.div_rn(h, scale), QMAX, INT8), mask=mask)
        tl.store(scale_ptr + t, scale + tl.sum(nans, axis=0))


def silu_and_mul(
    gate_up: torch.Tensor,
    out: torch.Tensor | None = None,
    quant: torch.dtype | None = None,
    whole_row: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """[..., 2 * I] -> [..., I] = silu(gate) * up, gate the first half.

    Written into `out` when given (contiguous, gate_up's dtype), else into a new tensor. With `quant`
    (torch.int8 or float8_e4m3fn; gate_up 2-d, `out` unused): in place of the product, the pair (q, scale)
    that engine/kernels/w8a8.py quantize_rows(silu_and_mul(gate_up), quant) returns, bit for bit (contiguous
    [rows, I] 8-bit values, float32 [rows, 1] scales); the product itself is never stored. `whole_row` picks the
    quantizing kernel's form (None: whole rows for rows up to WHOLE_ROW_MAX long in batches of up to
    WHOLE_ROW_MAX_ROWS, else steps); both give the same bits."""
    two_i = gate_up.shape[-1]
    assert two_i % 2 == 0
    inter = two_i // 2
    x = gate_up.reshape(-1, two_i)  # a view for 2-d inputs, whatever their row stride
    if quant is not None:
        assert gate_up.dim() == 2 and out is None, "a quantized SwiGLU is of [tokens, 2 * I] rows, into new tensors"
        q = torch.empty((x.shape[0], inter), dtype=quant, device=x.device)
        scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
        whole = triton.next_power_of_2(inter)
        if whole_row is None:
            whole_row = whole <= WHOLE_ROW_MAX and x.shape[0] <= WHOLE_ROW_MAX_ROWS
        if whole_row:  # one block per row, warps as the RMSNorm kernel takes them
            block, warps = whole, max(1, min(16, whole // 512))
        else:  # steps of the activation quantizer's tiles, as quantize_rows takes a row
            block, warps = ROW_TILES.block, ROW_TILES.num_warps
        if x.shape[0] > 0:
            _silu_and_mul_quant_kernel[(x.shape[0],)](
                x, q, scales, x.stride(0), x.stride(1), inter, QMAX=qmax(quant), INT8=quant == torch.int8,
                BLOCK=block, WHOLE_ROW=block == whole, num_warps=warps,
                **pdl.launch(x.device, x.shape[0]),
            )  # fmt: skip
        return q, scales
    shape = (*gate_up.shape[:-1], inter)
    if out is None:
        out = torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == shape and out.dtype == gate_up.dtype and out.is_contiguous()
    if x.shape[0] > 0:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            x, out, x.stride(0), x.stride(1), inter, BLOCK=block, num_warps=4, **pdl.launch(x.device, x.shape[0])
        )
    return out
