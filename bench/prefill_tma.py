"""Experiment: causal prefill of fresh prompts (nothing cached) reading K/V from the step's own
contiguous k/v through TMA tensor descriptors, against the engine's paged kernel and the bound.

The engine's prefill kernel gathers K/V rows through the block table with pointer loads; FA3 is
1.4-1.8x faster at these shapes. This measures how much of that a descriptor-fed Triton kernel
takes back when the keys are the prompt's own (the common case: a whole prompt in one step).
One program per (query tile, query head); keys of the KV head come through descriptors, so the
copy engine computes the addresses. Rows past a sequence are loaded (descriptors bound only the
whole tensor) and masked by the causal test; the store is a masked pointer store.

    python bench/prefill_tma.py [--check]     (GPU; --check: small shapes against torch, any device)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

_LOG2E = 1.4426950408889634


@triton.jit
def _tile(acc, m_i, l_i, q, rows, k_desc, v_desc, begin, start, col, qk_scale,
          BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold keys start..start+BLOCK_N-1 of the sequence beginning at row `begin` into the state."""
    k = k_desc.load([begin + start, col])
    s = tl.dot(q, tl.trans(k))
    if CAUSAL:
        cols = start + tl.arange(0, BLOCK_N)
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([begin + start, col])
    return tl.dot(p.to(v.dtype), v, acc * alpha[:, None]), m_new, l_i


@triton.jit
def _fresh_prefill_kernel(
    q_desc, k_desc, v_desc, out_ptr, query_start_ptr, qk_scale, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kvh = head // GROUP
    begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - begin
    first = tile * BLOCK_M
    if first >= q_len:
        return
    rows = first + tl.arange(0, BLOCK_M)
    q = q_desc.load([begin + first, head * HEAD_DIM])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Whole key tiles below the tile's first row need no mask; the rest (the diagonal) do.
    full_end = first // BLOCK_N * BLOCK_N
    end = tl.minimum(first + BLOCK_M, q_len)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, rows, k_desc, v_desc, begin, start, kvh * HEAD_DIM, qk_scale,
                              BLOCK_N, False)
    for start in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, rows, k_desc, v_desc, begin, start, kvh * HEAD_DIM, qk_scale,
                              BLOCK_N, True)
    acc = acc / l_i[:, None]
    d = tl.arange(0, HEAD_DIM)
    offs = (begin + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None])


def fresh_prefill(q, k, v, query_start, max_q, scale, block_m=128, block_n=64, num_warps=8, num_stages=3):
    """q [T, H, D], k/v [T, KVH, D] (rows contiguous in D; any row stride), whole prompts."""
    t, h, d = q.shape
    kvh = k.shape[1]
    out = torch.empty_like(q)
    q_desc = TensorDescriptor(q, [t, h * d], [q.stride(0), 1], [block_m, d])
    k_desc = TensorDescriptor(k, [t, kvh * d], [k.stride(0), 1], [block_n, d])
    v_desc = TensorDescriptor(v, [t, kvh * d], [v.stride(0), 1], [block_n, d])
    grid = (triton.cdiv(max_q, block_m), query_start.shape[0] - 1, h)
    _fresh_prefill_kernel[grid](q_desc, k_desc, v_desc, out, query_start, scale * _LOG2E, out.stride(0), out.stride(1),
                                GROUP=h // kvh, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
                                num_warps=num_warps, num_stages=num_stages)
    return out


def _reference(q, k, v, lens, scale):
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (x[start:start + n].transpose(0, 1).float() for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs).to(q.dtype)


def _inputs(lens, h, kvh, d, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lens)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=gen).to(dtype=dtype, device=device)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    return q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d), cu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefill_tma.jsonl"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.check:
        for lens, h, kvh, d, bm, bn in (([5, 40, 17], 8, 2, 64, 32, 16), ([33], 4, 4, 64, 16, 16)):
            q, k, v, cu = _inputs(lens, h, kvh, d, torch.float32 if device == "cpu" else torch.bfloat16, device)
            out = fresh_prefill(q, k, v, cu, max(lens), d**-0.5, bm, bn, 4, 2)
            ref = _reference(q, k, v, lens, d**-0.5)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            print("check", lens, h, kvh, d, "rel err", err)
            assert err < 1e-2
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.gpu_check import _paged_cache, cuda_time
    from engine.kernels.attention import paged_prefill

    h, kvh, d, bs = 32, 8, 128, 16
    # The first calls also tried heads side by side in the grid (the "h" keys of the results): 10-20% slower.
    configs = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3)]
    for num_seqs, ctx in ((32, 512), (8, 2048), (2, 8192), (1, 32768)):
        lens = [ctx] * num_seqs
        q, k, v, cu = _inputs(lens, h, kvh, d, torch.bfloat16, "cuda")
        flops = 4 * num_seqs * h * d * ctx * (ctx + 1) / 2
        ref = _reference(q, k, v, lens, d**-0.5) if ctx <= 8192 else None
        gen = torch.Generator(device="cuda").manual_seed(0)
        k_cache, v_cache, tables = _paged_cache(num_seqs, ctx, kvh, d, bs, gen)
        seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
        paged_s = cuda_time(lambda: paged_prefill(q, k_cache, v_cache, tables, cu, seq_lens, d**-0.5, ctx), iters=10)
        row = {"num_seqs": num_seqs, "context": ctx, "paged_tflops": flops / paged_s / 1e12}
        for bm, bn, warps, stages in configs:
            key = f"{bm}x{bn}w{warps}s{stages}"
            try:
                out = fresh_prefill(q, k, v, cu, ctx, d**-0.5, bm, bn, warps, stages)
                s = cuda_time(lambda: fresh_prefill(q, k, v, cu, ctx, d**-0.5, bm, bn, warps, stages), iters=10)
            except Exception as exc:  # e.g. out of shared memory
                row[key] = repr(exc)[:120]
                continue
            row[key] = flops / s / 1e12
            if ref is not None:
                row[key + "_err"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
