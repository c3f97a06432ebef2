"""W4A16 / W8A16 matmul: activations times a weight kept as packed integers, dequantized in registers.

The weight is the layout engine/layers/linear.py WeightOnlyLinear keeps for every weight-only scheme
(GPTQ, AWQ, compressed-tensors, int8 at load): int32 words packing 32 / bits consecutive input rows,
[K * bits / 32, N], with per-group scales and zero points [ceil(K / group), N]. A tile of BLOCK_K rows lies in
one group (BLOCK_K divides the group size), so each tile loads one row of scales and zeros.

Decode-sized batches (a few rows) read the whole weight for little arithmetic: there the K dimension is
split over more programs (split-K) that add their partial sums into a float32 output, so enough programs
stream the weight to fill the GPU; prompt-sized batches use larger M tiles and no split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _weight_only_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, sxm, sxk,
    BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    PER_WORD: tl.constexpr = 32 // BITS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_span = K // SPLIT_K  # the host makes it a multiple of BLOCK_K
    for t in range(0, k_span // BLOCK_K):
        k0 = pid_k * k_span + t * BLOCK_K
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
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out, acc, mask=mask)


def _block_k(k: int, group: int) -> int:
    # Dividing both, a tile never straddles groups, even in a short last group (K = 576, groups of 128).
    for bk in (128, 64, 32, 16):
        if group % bk == 0 and k % bk == 0:
            return bk
    raise ValueError(f"weight-only matmul needs K ({k}) and the group size ({group}) to be multiples of 16")


@dataclass(frozen=True)
class Tiles:
    """One launch's shape: BLOCK_M x BLOCK_N outputs per program, BLOCK_K inputs per loop step, K split over
    `split` programs; num_warps and num_stages as Triton takes them (stages: loads in flight per program)."""

    block_m: int
    block_n: int
    block_k: int
    split: int
    num_warps: int = 4
    num_stages: int = 3

    def check(self, k: int, group: int) -> None:
        if group % self.block_k or k % (self.block_k * self.split):
            raise ValueError(f"{self} does not tile K={k} in groups of {group}")


def tiles(m: int, n: int, k: int, group: int, num_sms: int) -> Tiles:
    """The tiles for an [m, k] x [k, n] product."""
    bk = min(_block_k(k, group), 64)
    if m > 16:
        return Tiles(64 if m > 32 else 32, 64, bk, 1)
    bn = 64
    programs = triton.cdiv(n, bn)
    split = 1
    # Split K until about two programs per SM stream the weight, keeping each split whole tiles.
    while programs * split * 2 < 2 * num_sms and k % (bk * split * 2) == 0 and k // (split * 2) >= 4 * bk:
        split *= 2
    return Tiles(16, bn, bk, split)


def weight_only_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    group_size: int,
    config: Tiles | None = None,
) -> torch.Tensor:
    """[M, K] activations x the packed [K, N] weight -> [M, N] in x's dtype; `config` overrides the tiles
    (bench/quant_gpu.py --sweep times candidates)."""
    m, k = x.shape
    n = qweight.shape[1]
    assert qweight.shape[0] * (32 // bits) == k and scales.shape == zeros.shape == (-(-k // group_size), n)
    if config is None:
        num_sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        config = tiles(m, n, k, group_size, num_sms)
    config.check(k, group_size)
    bm, bn, bk, split = config.block_m, config.block_n, config.block_k, config.split
    if split == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _weight_only_kernel[grid](
        x, qweight, scales, zeros, out,
        m, n, k, x.stride(0), x.stride(1),
        BITS=bits, GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out if split == 1 else out.to(x.dtype)
