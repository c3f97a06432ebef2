"""Build, check and time pagoda's CUDA path in one device call; one JSON line per measurement.

    python bench/gpu_check.py peaks                      # measured HBM copy rate and bf16 matmul rate
    python bench/gpu_check.py kernels                    # own Triton paged decode/prefill vs FlashAttention, vs bounds
    python bench/gpu_check.py decode-tiles               # decode kernel alone per tiling, bf16 and fp8 cache
    python bench/gpu_check.py greedy                     # Triton backend == torch backend, Llama-3-8B shape, 256 tokens
    python bench/gpu_check.py workload w1 --backend triton [--eager]   # W1 / W2 output tok/s
    python bench/gpu_check.py transformers               # W1 with transformers generate (the baseline)
    python bench/gpu_check.py roofline                   # decode step at batch 1/16/64 (ctx 1k), prefill 8k tokens
    python bench/gpu_check.py long-prompt                # TTFT of 4k-32k prompts: flash-attn-4 vs own kernels
    python bench/gpu_check.py long-decode                # batch 64 decode at 8k contexts, bf16 vs fp8 KV cache
    python bench/gpu_check.py workload w2 --kv-cache-dtype fp8   # any workload over an fp8 KV cache
    python bench/gpu_check.py quant-decode               # decode tok/s, bf16 vs W8A16 / W4A16 / FP8 / W8A8
    python bench/gpu_check.py workload w1 --quantization fp8
    python bench/gpu_check.py verify                     # spec-decode verify step (k = 4) vs decode step, batch 1-8

Dummy bf16 weights of the shapes in bench/configs, ignore_eos, greedy. Each mode prints its rows
(prefixed RESULT) and appends them to --out (default $OUT/gpu_check.jsonl when $OUT is set, else
bench-results/<date>-<device>-<commit>-gpu-check.jsonl in the repository, which git ignores).
The FlashAttention peer is the build vLLM ships (vllm.vllm_flash_attn, FA3 on Hopper) or the
flash-attn package, whichever imports; `kernels` adds flash-attn-4 (flash_attn.cute, carried by
bench/fa4_h100.sh) as a second peer when it imports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.naming import results_path  # noqa: E402  (needs ROOT on the path)
from bench.throughput import random_prompts, ranged_workload  # noqa: E402

LLAMA_8B = str(ROOT / "bench/configs/llama3-8b")
QWEN3_06B = str(ROOT / "bench/configs/qwen3-0.6b")
HBM_SPEC = 3.35e12  # H100 SXM HBM3, bytes/s (datasheet)
ASYNC = True  # --sync: engines wait for step N's tokens before scheduling step N+1


def _commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()


def emit(args, row: dict) -> None:
    row.update(
        device_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",  # cpu: a dry run
        commit=_commit(),
        torch=torch.__version__,
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        command="python " + " ".join(sys.argv),
    )
    line = json.dumps(row)
    print("RESULT", line, flush=True)
    with open(args.out, "a") as f:
        f.write(line + "\n")


def cuda_time(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, timed with CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_time(fn, iters: int = 20, calls: int = 10) -> float | None:
    """Median seconds per call of `calls` calls captured in one CUDA graph: the GPU's time without
    the host's launch cost, as the engine sees it inside its decode graphs. None if fn cannot be
    captured."""
    fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # allocations of the first call happen outside the capture
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
    except RuntimeError as exc:
        print(f"graph capture failed: {exc}", file=sys.stderr)
        torch.cuda.synchronize()
        return None
    return cuda_time(graph.replay, iters=iters) / calls


def measure_peaks() -> tuple[float, float]:
    """(bytes/s of a device-to-device copy counting read + write, bf16 matmul FLOP/s at 8192^3)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = cuda_time(lambda: a @ b, iters=10)
    return 2 * 2**30 / copy_s, 2 * 8192**3 / mm_s


def mode_peaks(args) -> None:
    hbm, mm = measure_peaks()
    emit(args, {"mode": "peaks", "copy_bytes_per_s": hbm, "matmul_flops": mm})


# ----- kernels -----


def _paged_cache(num_seqs: int, ctx: int, kvh: int, d: int, block_size: int, gen: torch.Generator):
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = num_seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, block_size, kvh, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    return k_cache, v_cache, perm.view(num_seqs, blocks_per_seq)


def _flash_peer():
    from engine.attention.flash_attn import flash_attn_module

    found = flash_attn_module()
    if found is None:
        return None, None
    varlen, vllm_build = found
    if vllm_build:
        import importlib.metadata

        return (lambda **kw: varlen(fa_version=3, **kw)), f"vllm {importlib.metadata.version('vllm')} FA3"
    import flash_attn

    return varlen, f"flash_attn {flash_attn.__version__}"


def _fa4_peer():
    """flash-attn-4's varlen attention (CuTe DSL, its own Hopper forward) as (call, name), or (None, None)."""
    from engine.attention.flash_attn import fa4_varlen

    varlen = fa4_varlen()
    if varlen is None:
        return None, None

    def call(**kw) -> torch.Tensor:
        out = varlen(**kw)
        return out[0] if isinstance(out, tuple) else out  # (out, lse)

    import importlib.metadata

    try:  # flash_attn.cute.__version__ reads 0.0.0 when installed with --target
        version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        version = "(version unknown)"
    return call, f"flash-attn-4 {version}"


def _rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


def mode_kernels(args) -> None:
    from engine.kernels.attention import paged_prefill
    from engine.kernels.decode import paged_decode
    from engine.kernels.prefill_fresh import prefill_fresh

    hbm, mm = measure_peaks()
    peer, peer_name = _flash_peer()
    fa4, fa4_name = _fa4_peer()
    h, kvh, d, bs = 32, 8, 128, 16  # Llama-3-8B attention: GQA 4:1, head dim 128
    scale = d**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    for batch in (1, 16, 64, 256):
        for ctx in (512, 2048, 8192, 32768):
            if batch * ctx > 2**22:  # 4M cached tokens per layer (17 GB) is enough for the trend
                continue
            k_cache, v_cache, tables = _paged_cache(batch, ctx, kvh, d, bs, gen)
            q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda", generator=gen)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
            ours = paged_decode(q, k_cache, v_cache, tables, seq_lens, scale)
            eager_s = cuda_time(lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, scale))
            own_s = graph_time(lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, scale)) or eager_s
            row = {
                "mode": "kernel",
                "kernel": "decode",
                "timing": "cuda_graph",
                "batch": batch,
                "context": ctx,
                "heads": h,
                "kv_heads": kvh,
                "head_dim": d,
                "block_size": bs,
                "own_us": own_s * 1e6,
                "own_eager_us": eager_s * 1e6,
            }
            kv_bytes = 2 * batch * ctx * kvh * d * 2
            row["bound_us"] = kv_bytes / hbm * 1e6
            row["own_hbm_fraction"] = kv_bytes / own_s / hbm
            if peer is not None:
                cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                kw = dict(
                    q=q,
                    k=k_cache,
                    v=v_cache,
                    cu_seqlens_q=cu_q,
                    max_seqlen_q=1,
                    seqused_k=seq_lens,
                    max_seqlen_k=ctx,
                    softmax_scale=scale,
                    causal=True,
                    block_table=tables,
                )
                theirs = peer(**kw)
                peer_eager_s = cuda_time(lambda: peer(**kw))
                peer_s = graph_time(lambda: peer(**kw)) or peer_eager_s
                row.update(
                    peer=peer_name,
                    peer_us=peer_s * 1e6,
                    peer_eager_us=peer_eager_s * 1e6,
                    own_over_peer=own_s / peer_s,
                    rel_diff=_rel_diff(ours, theirs),
                )
            if fa4 is not None:  # the same paged cache through its page table (no split-KV on Hopper)
                cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
                kw = dict(
                    q=q,
                    k=k_cache,
                    v=v_cache,
                    cu_seqlens_q=cu_q,
                    max_seqlen_q=1,
                    seqused_k=seq_lens,
                    page_table=tables,
                    softmax_scale=scale,
                    causal=True,
                )
                theirs = fa4(**kw)
                fa4_s = graph_time(lambda: fa4(**kw)) or cuda_time(lambda: fa4(**kw))
                row.update(
                    fa4=fa4_name, fa4_us=fa4_s * 1e6, own_over_fa4=own_s / fa4_s, fa4_rel_diff=_rel_diff(ours, theirs)
                )
            emit(args, row)
    for ctx in (512, 2048, 8192, 32768):
        num_seqs = max(1, 16384 // ctx)  # about 16k new tokens per call, whole prompts (pure prefill)
        k_cache, v_cache, tables = _paged_cache(num_seqs, ctx, kvh, d, bs, gen)
        q = torch.randn(num_seqs * ctx, h, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
        cu_q = torch.arange(0, num_seqs * ctx + 1, ctx, dtype=torch.int32, device="cuda")
        ours = paged_prefill(q, k_cache, v_cache, tables, cu_q, seq_lens, scale, ctx)
        own_s = cuda_time(lambda: paged_prefill(q, k_cache, v_cache, tables, cu_q, seq_lens, scale, ctx), iters=10)
        flops = 4 * num_seqs * h * d * ctx * (ctx + 1) / 2  # causal: QK^T and PV over the lower triangle
        # The fresh-prompt kernel reads the step's own k/v: the same keys, laid out contiguously.
        k_new, v_new = (c[tables.long()].reshape(num_seqs * ctx, kvh, d) for c in (k_cache, v_cache))
        fresh = prefill_fresh(q, k_new, v_new, cu_q, scale, ctx)
        fresh_s = cuda_time(lambda: prefill_fresh(q, k_new, v_new, cu_q, scale, ctx), iters=10)
        row = {
            "mode": "kernel",
            "kernel": "prefill",
            "num_seqs": num_seqs,
            "context": ctx,
            "heads": h,
            "kv_heads": kvh,
            "head_dim": d,
            "block_size": bs,
            "own_us": own_s * 1e6,
            "own_tflops": flops / own_s / 1e12,
            "own_matmul_fraction": flops / own_s / mm,
            "fresh_us": fresh_s * 1e6,
            "fresh_tflops": flops / fresh_s / 1e12,
            "fresh_vs_paged_diff": ((fresh.float() - ours.float()).abs().max() / ours.float().abs().max()).item(),
        }
        if peer is not None:
            kw = dict(
                q=q,
                k=k_cache,
                v=v_cache,
                cu_seqlens_q=cu_q,
                max_seqlen_q=ctx,
                seqused_k=seq_lens,
                max_seqlen_k=ctx,
                softmax_scale=scale,
                causal=True,
                block_table=tables,
            )
            theirs = peer(**kw)
            peer_s = cuda_time(lambda: peer(**kw), iters=10)
            row.update(
                peer=peer_name,
                peer_us=peer_s * 1e6,
                peer_tflops=flops / peer_s / 1e12,
                own_over_peer=own_s / peer_s,
                fresh_over_peer=fresh_s / peer_s,
                rel_diff=_rel_diff(ours, theirs),
            )
        if fa4 is not None:  # through the paged cache, and from the step's own contiguous k/v as prefill_fresh
            kw = dict(
                q=q,
                k=k_cache,
                v=v_cache,
                cu_seqlens_q=cu_q,
                max_seqlen_q=ctx,
                seqused_k=seq_lens,
                page_table=tables,
                softmax_scale=scale,
                causal=True,
            )
            paged_theirs = fa4(**kw)
            fa4_paged_s = cuda_time(lambda: fa4(**kw), iters=10)
            kw = dict(
                q=q,
                k=k_new,
                v=v_new,
                cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_q,
                max_seqlen_q=ctx,
                max_seqlen_k=ctx,
                softmax_scale=scale,
                causal=True,
            )
            theirs = fa4(**kw)
            fa4_s = cuda_time(lambda: fa4(**kw), iters=10)
            row.update(
                fa4=fa4_name,
                fa4_us=fa4_s * 1e6,
                fa4_tflops=flops / fa4_s / 1e12,
                fa4_paged_us=fa4_paged_s * 1e6,
                fa4_paged_tflops=flops / fa4_paged_s / 1e12,
                fresh_over_fa4=fresh_s / fa4_s,
                own_over_fa4_paged=own_s / fa4_paged_s,
                fa4_rel_diff=_rel_diff(fresh, theirs),
                fa4_paged_rel_diff=_rel_diff(ours, paged_theirs),
            )
        emit(args, row)


def _decode_batch(batch: int, ctx: int, h: int, kvh: int, d: int, bs: int, ragged: bool, gen: torch.Generator):
    """q [batch, h, d], a random bf16 paged cache and its block tables, and lengths: ctx each, or U[100, ctx]
    when ragged."""
    k_cache, v_cache, tables = _paged_cache(batch, ctx, kvh, d, bs, gen)
    q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda", generator=gen)
    if ragged:
        seq_lens = torch.randint(100, ctx + 1, (batch,), dtype=torch.int32, device="cuda", generator=gen)
    else:
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables, seq_lens


def mode_decode_splits(args) -> None:
    """Own decode kernel, CUDA-graph timed, for each split count at the batch x context shapes of
    W1 and W2 (uniform and ragged lengths): which split count each shape wants."""
    from engine.kernels.decode import decode_num_splits, num_sms, paged_decode

    hbm, _ = measure_peaks()
    h, kvh, d, bs = 32, 8, 128, 16
    scale = d**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(b, c, False) for b in (16, 64, 128, 256) for c in (256, 640, 1024, 2048)]
    shapes += [(b, 2048, True) for b in (8, 32, 64, 256)]  # ragged: lengths U[100, 2048], like W2's mid-run
    shapes += [(1, 8192, False), (1, 32768, False), (4, 32768, False)]  # one user, long context
    for batch, ctx, ragged in shapes:
        q, k_cache, v_cache, tables, seq_lens = _decode_batch(batch, ctx, h, kvh, d, bs, ragged, gen)
        kv_bytes = 2 * int(seq_lens.sum()) * kvh * d * 2
        times = {}
        for splits in sorted(
            {1, 2, 4, 8, 16, decode_num_splits(batch, kvh, num_sms(torch.device("cuda")))}
            | ({32, 64} if batch <= 4 else set())
        ):
            t = graph_time(lambda: paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, num_splits=splits))
            times[splits] = t * 1e6 if t is not None else float("inf")
        best = min(times, key=times.get)
        default = decode_num_splits(batch, kvh, num_sms(torch.device("cuda")))
        emit(
            args,
            {
                "mode": "decode_splits",
                "batch": batch,
                "context": ctx,
                "ragged": ragged,
                "us": times,
                "best_splits": best,
                "default_splits": default,
                "default_over_best": times[default] / times[best],
                "best_hbm_fraction": kv_bytes / (times[best] / 1e6) / hbm,
            },
        )


# Candidate decode tilings per cache kind (engine/kernels/decode.py DecodeTiles): (keys per tile, warps,
# stages, fp8 widening). The first of each kind is what shipped before the per-dtype table.
DECODE_TILE_CANDIDATES = {
    "16bit": [(64, 4, 2, "cast"), (128, 4, 2, "cast"), (64, 8, 2, "cast"), (64, 4, 3, "cast"), (32, 4, 2, "cast")],
    "fp8": [
        (64, 4, 2, "cast"),
        (128, 4, 2, "cast"),
        (64, 4, 2, "asm"),
        (128, 4, 2, "asm"),
        (128, 4, 3, "asm"),
        (128, 8, 2, "asm"),
        (256, 8, 2, "asm"),
        (128, 4, 2, "bits"),
        (64, 4, 2, "words"),
        (64, 4, 3, "words"),
        (128, 4, 2, "words"),
        (128, 4, 3, "words"),
        (128, 8, 2, "words"),
    ],
}


def _decode_reference(q, k_cache, v_cache, tables, seq_lens, scale, k_scale, v_scale, rows) -> torch.Tensor:
    """float32 attention of sequences `rows` against their cached keys (stored x scale), the check every
    candidate passes before it is timed."""
    bs, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = []
    for s in rows:
        n = int(seq_lens[s])
        blocks = tables[s, : -(-n // bs)].long()
        k = (k_cache[blocks].flatten(0, 1)[:n].float() * k_scale).repeat_interleave(group, 1)  # [n, H, D]
        v = (v_cache[blocks].flatten(0, 1)[:n].float() * v_scale).repeat_interleave(group, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[s].float(), k) * scale, -1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


def mode_decode_tiles(args) -> None:
    """The decode kernel alone, CUDA-graph timed, for each DECODE_TILE_CANDIDATES tiling of the bf16 and the
    fp8 (e4m3) cache at batch 64 x 8k and batch 64 x 512 (Llama-3-8B attention: 32 / 8 heads, D 128) and a
    W2-like batch (Qwen3-0.6B: 16 / 8 heads, 256 sequences of U[100, 1280] keys); each candidate is checked
    against a float32 reference first (rel_err; a wrong one is not timed). us, and achieved GB/s of K/V
    bytes read, per candidate; the shipped DECODE_TILES marked `default`. Then the paged prefill's fp8
    tilings (_prefill_tiles), and the fastest of each shape and cache kind ("best" lines)."""
    from engine import kv_fp8
    from engine.kernels.decode import DecodeTiles, decode_num_splits, decode_tiles, num_sms, paged_decode

    hbm, _ = measure_peaks()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bs, d = 16, 128
    best: dict[tuple[str, str], tuple[float, str]] = {}
    shapes = [("64x8k", 64, 32, 8, 8192, False), ("64x512", 64, 32, 8, 512, False), ("w2", 256, 16, 8, 1280, True)]
    for name, batch, h, kvh, ctx, ragged in shapes:
        q, k16, v16, tables, seq_lens = _decode_batch(batch, ctx, h, kvh, d, bs, ragged, gen)
        splits = decode_num_splits(batch, kvh, num_sms(torch.device("cuda")))
        rows = [0, batch // 2, batch - 1]
        for kind in ("16bit", "fp8"):
            shipped = decode_tiles(kind == "fp8", batch, kvh, num_sms(torch.device("cuda")))
            if kind == "fp8":
                # randn values: amax ~5 mapped well inside e4m3, as --calculate-kv-scales does
                ks = vs = torch.tensor([0.05], device="cuda")
                k_cache, v_cache = (kv_fp8.quantize(c, ks, torch.float8_e4m3fn) for c in (k16, v16))
                scales = dict(k_scale=ks, v_scale=vs)
            else:
                k_cache, v_cache, scales = k16, v16, {}
                ks = vs = torch.tensor([1.0], device="cuda")
            ref = _decode_reference(q, k_cache, v_cache, tables, seq_lens, d**-0.5, ks, vs, rows)
            kv_bytes = 2 * int(seq_lens.sum()) * kvh * d * k_cache.element_size()
            for block_n, warps, stages, widen in DECODE_TILE_CANDIDATES[kind]:
                tiles = DecodeTiles(block_n, warps, stages, widen)

                def call():
                    return paged_decode(
                        q, k_cache, v_cache, tables, seq_lens, d**-0.5, num_splits=splits, tiles=tiles, **scales
                    )

                row = {"mode": "decode_tiles", "shape": name, "cache": kind, "batch": batch, "heads": h,
                       "kv_heads": kvh, "context": ctx, "ragged": ragged, "splits": splits, "block_n": block_n,
                       "num_warps": warps, "num_stages": stages, "widen": widen,
                       "default": tiles == shipped}  # fmt: skip
                try:
                    out = call()[rows].float()
                except Exception as exc:  # a tiling that does not compile (shared memory, registers) is reported
                    emit(args, dict(row, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    continue
                row["rel_err"] = ((out - ref).abs().max() / ref.abs().max()).item()
                if not row["rel_err"] < 2e-2:
                    emit(args, dict(row, error="WRONG: differs from the reference"))
                    continue
                t = graph_time(call)
                if t is not None:
                    row.update(us=t * 1e6, gb_s=kv_bytes / t / 1e9, hbm_fraction=kv_bytes / t / hbm)
                    label = f"{block_n}/{warps}w/{stages}s/{widen}" + (" (default)" if row["default"] else "")
                    best[name, kind] = min(best.get((name, kind), (float("inf"), "")), (t * 1e6, label))
                emit(args, row)
    _prefill_tiles(args, gen, best)
    for (name, kind), (us, label) in best.items():
        print(f"best {name:9s} {kind:6s} {us:9.1f} us  {label}")


# Candidate paged-prefill tilings (engine/kernels/attention.py PrefillTiles): (query rows, keys per tile, warps,
# stages, fp8 widening); the first of each kind is what shipped before the per-dtype table.
PREFILL_TILE_CANDIDATES = {
    "16bit": [(64, 64, 4, 2, "cast"), (128, 64, 8, 2, "cast")],
    "fp8": [
        (64, 64, 4, 2, "cast"),
        (64, 64, 4, 2, "bits"),
        (64, 64, 4, 2, "asm"),
        (128, 64, 8, 2, "asm"),
        (128, 64, 4, 2, "asm"),
        (64, 128, 4, 2, "asm"),
        (64, 64, 4, 2, "words"),
        (64, 128, 4, 2, "words"),
    ],
}


def _prefill_tiles(args, gen: torch.Generator, best: dict) -> None:
    """decode-tiles' prefill leg: the paged prefill kernel (Llama-3-8B attention) over a bf16 cache and over
    an fp8 one for each PREFILL_TILE_CANDIDATES tiling, on what W1 sends it: 16 prompts of 512 tokens with
    nothing cached (a step that also carries decodes is not all-fresh, so its prompts go here, not to
    prefill_fresh) and 64 one-token rows at 640 keys (those decodes). fp8 is checked against the 16-bit
    kernel over the dequantized cache first."""
    from engine import kv_fp8
    from engine.kernels.attention import PREFILL_TILES, PrefillTiles, paged_prefill

    h, kvh, d, bs = 32, 8, 128, 16
    for name, batch, q_len, ctx in (("pf-16x512", 16, 512, 512), ("pf-64x1", 64, 1, 640)):
        _, k16, v16, tables, seq_lens = _decode_batch(batch, ctx, h, kvh, d, bs, False, gen)
        q = torch.randn(batch * q_len, h, d, dtype=torch.bfloat16, device="cuda", generator=gen)
        cu_q = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * q_len
        ks = vs = torch.tensor([0.05], device="cuda")
        k8, v8 = (kv_fp8.quantize(c, ks, torch.float8_e4m3fn) for c in (k16, v16))
        ref = paged_prefill(q, *(kv_fp8.dequantize(c, ks, torch.bfloat16) for c in (k8, v8)), tables, cu_q, seq_lens,
                            d**-0.5, q_len)  # fmt: skip
        for kind in ("16bit", "fp8"):
            caches = (k16, v16, {}) if kind == "16bit" else (k8, v8, dict(k_scale=ks, v_scale=vs))
            for candidate in PREFILL_TILE_CANDIDATES[kind]:
                tiles = PrefillTiles(*candidate)

                def call():
                    return paged_prefill(q, caches[0], caches[1], tables, cu_q, seq_lens, d**-0.5, q_len, tiles=tiles,
                                         **caches[2])  # fmt: skip

                row = {"mode": "prefill_tiles", "shape": name, "cache": kind, "batch": batch, "q_len": q_len,
                       "context": ctx, **asdict(tiles), "default": tiles == PREFILL_TILES[kind]}  # fmt: skip
                try:
                    out = call()
                except Exception as exc:  # a tiling that does not compile (shared memory, registers) is reported
                    emit(args, dict(row, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    continue
                if kind == "fp8":
                    row["rel_err"] = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                    if not row["rel_err"] < 2e-2:
                        emit(args, dict(row, error="WRONG: differs from the bf16 kernel over the dequantized cache"))
                        continue
                t = graph_time(call)
                if t is not None:
                    kv_bytes = 2 * batch * ctx * kvh * d * caches[0].element_size()
                    row.update(us=t * 1e6, kv_gb_s=kv_bytes / t / 1e9)
                    label = "/".join(map(str, candidate)) + (" (default)" if row["default"] else "")
                    best[name, kind] = min(best.get((name, kind), (float("inf"), "")), (t * 1e6, label))
                emit(args, row)


def _fixed_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    return random_prompts(num, length, 128256, seed)


def w1_prompts() -> list[list[int]]:
    """The vLLM peer's W1 prompts: numpy's legacy generator, seed 0, ids in [100, 20000)."""
    return np.random.RandomState(0).randint(100, 20000, size=(64, 512)).tolist()


def _llm(model: str, backend: str, eager: bool, **kw):
    from engine import LLM

    kw.setdefault("async_scheduling", ASYNC)
    return LLM(model, dtype="bfloat16", load_format="dummy", attention_backend=backend, enforce_eager=eager, **kw)


def mode_greedy(args) -> None:
    """Greedy tokens of the Triton backend vs the torch backend, same dummy weights (same seed)."""
    from engine import SamplingParams

    # --prompt-len 3000: prompts long enough for the flash-attn-4 route where it is installed.
    prompts = _fixed_prompts(4, args.prompt_len, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, logprobs=2)
    max_len = args.prompt_len + 256 + 16
    runs = {}
    for backend in ("torch", "triton"):
        llm = _llm(
            LLAMA_8B,
            backend,
            eager=False,
            num_gpu_blocks_override=4 * (max_len // 16 + 1) + 16,
            max_model_len=max(1024, max_len),
        )
        runs[backend] = llm.generate(prompts, params, use_tqdm=False)
        if backend == "triton":
            runs["triton_fa4"] = getattr(llm.engine.runner.backend, "min_tokens", 0)  # 0: the route is off here
        del llm
        torch.cuda.empty_cache()
    for i, (ref, got) in enumerate(zip(runs["torch"], runs["triton"])):
        ref_ids, got_ids = ref.outputs[0].token_ids, got.outputs[0].token_ids
        first = next((j for j, (a, b) in enumerate(zip(ref_ids, got_ids)) if a != b), None)
        row = {
            "mode": "greedy",
            "prompt": i,
            "prompt_len": args.prompt_len,
            "tokens": len(ref_ids),
            "equal": first is None,
            "first_divergence": first,
            "fa4_threshold": runs["triton_fa4"],
        }
        if first is not None:
            top = ref.outputs[0].logprobs[first].top
            # The torch backend's own top-2 margin at the divergence: a tie within bf16 rounding
            # (logits near 10-20 round in steps of 0.06-0.125) explains a flip.
            row["ref_top2"] = top[:2]
            row["ref_top2_margin"] = top[0][1] - top[1][1] if len(top) > 1 else None
            row["got_token"] = got_ids[first]
        emit(args, row)


def mode_workload(args) -> None:
    from bench.compiles import count_compiles
    from engine import SamplingParams

    model, prompts, outs = _workload(args.name)
    t0 = time.perf_counter()
    engine_kw = _engine_kw(args)
    llm = _llm(model, args.backend, args.eager, **engine_kw)
    load_s = time.perf_counter() - t0
    warm = [p[:32] for p in prompts[:8]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    llm.engine.block_manager.reset_prefix_cache()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outs]
    torch.cuda.synchronize()
    # A kernel variant compiled while the workload is timed is seconds the start-up should have taken.
    before = _allocator_counts()
    with count_compiles() as compiled:
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    allocator = {k: v - before[k] for k, v in _allocator_counts().items()}
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    emit(
        args,
        {
            "mode": "workload",
            "workload": args.name,
            "engine": "pagoda",
            "backend": args.backend,
            "cuda_graphs": not args.eager,
            "async_scheduling": ASYNC,
            "elapsed_s": elapsed,
            "output_tokens": tokens,
            "engine_kw": engine_kw,
            "output_tok_s": tokens / elapsed,
            "load_s": load_s,
            "allocator": allocator,
            "compiled_during_run": dict(compiled),
        },
    )


def _allocator_counts() -> dict:
    """cudaMalloc / cudaFree calls and out-of-memory retries of the caching allocator so far: a
    cudaFree (or a retry, which frees cached blocks) synchronizes the device inside a step."""
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def mode_gemms(args) -> None:
    """The decode steps' linear layers (W1: Llama-3-8B at 64 rows; W2: Qwen3-0.6B at 256 and 64
    rows) under each BLAS library torch can pick, graph timed, against the bytes they must read."""
    hbm, _ = measure_peaks()
    shapes = {
        "w1": (64, [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]),
        "w2": (256, [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]),
        "w2-64": (64, [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]),
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (m, layers) in shapes.items():
        for k, n in layers:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
            # Several weight copies in rotation, so that no repeat finds the weight in L2.
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda", generator=gen) for _ in range(4)]
            row = {"mode": "gemm", "workload": name, "m": m, "k": k, "n": n}
            for lib in ("default", "cublas", "cublaslt"):
                if lib != "default":
                    torch.backends.cuda.preferred_blas_library(lib)
                t = graph_time(lambda: [torch.nn.functional.linear(x, w) for w in ws])
                row[f"{lib}_us"] = t / len(ws) * 1e6 if t is not None else None
                row[f"{lib}_tb_s"] = (n * k * 2) / (t / len(ws)) / 1e12 if t is not None else None
            torch.backends.cuda.preferred_blas_library("default")
            row["bound_us"] = n * k * 2 / hbm * 1e6
            emit(args, row)


def mode_transformers(args) -> None:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(LLAMA_8B), dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(w1_prompts(), device="cuda")

    def generate(n: int):
        with torch.no_grad():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    generate(4)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = generate(256)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    emit(
        args,
        {
            "mode": "workload",
            "workload": "w1",
            "engine": "transformers",
            "version": transformers.__version__,
            "elapsed_s": elapsed,
            "output_tokens": tokens,
            "output_tok_s": tokens / elapsed,
        },
    )


def _step_times(llm, prompts: list[list[int]], max_tokens: int, timed_steps: int) -> list[float]:
    """Admit the prompts, run until every one has its first token, then time `timed_steps` decode steps."""
    from engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    started = set()
    while len(started) < len(prompts):
        started |= {o.request_id for o in engine.step()}
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def mode_roofline(args) -> None:
    hbm, mm = measure_peaks()
    llm = _llm(LLAMA_8B, args.backend, args.eager)
    model = llm.engine.runner.model
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    for batch in (1, 16, 64):
        times = _step_times(llm, _fixed_prompts(batch, 1024, seed=batch), max_tokens=40, timed_steps=32)
        step_s = statistics.median(times)
        moved = weight_bytes + batch * 1040 * kv_bytes_per_token  # weights + the cached context read once
        emit(
            args,
            {
                "mode": "roofline",
                "phase": "decode",
                "batch": batch,
                "context": 1024,
                "backend": args.backend,
                "cuda_graphs": not args.eager,
                "step_ms": step_s * 1e3,
                "bytes_moved": moved,
                "hbm_fraction_measured": moved / step_s / hbm,
                "hbm_fraction_spec": moved / step_s / HBM_SPEC,
            },
        )
    # Prefill: 8 prompts of 1024 tokens scheduled in one 8192-token step.
    matmul_params = (
        sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight"))
        + cfg.vocab_size * cfg.hidden_size / 1024
    )  # lm_head runs for the 8 sampled rows only
    for _ in range(2):  # the first compiles the prefill kernels for this shape
        from engine import SamplingParams

        prompts = _fixed_prompts(8, 1024, seed=int(time.monotonic_ns() % 1000))
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"p{time.monotonic_ns()}-{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.engine.step()
        step_s = time.perf_counter() - t0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    attn_flops = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 8 * 1024 * 1025 / 2
    flops = 2 * matmul_params * 8192 + attn_flops
    emit(
        args,
        {
            "mode": "roofline",
            "phase": "prefill",
            "tokens": 8192,
            "backend": args.backend,
            "cuda_graphs": not args.eager,
            "step_ms": step_s * 1e3,
            "flops": flops,
            "tflops": flops / step_s / 1e12,
            "matmul_fraction": flops / step_s / mm,
        },
    )


def _verify_phase(engine, draft_on: dict, on: bool, steps: int) -> tuple[list[float], int]:
    """`steps` engine steps with drafts forced on or off: their wall times, and the draft tokens accepted."""
    draft_on["on"] = on
    times, accepted = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        accepted += engine.last_step.num_accepted_tokens
    return times, accepted


def _replays(runner) -> tuple[int, int]:
    """Steps run so far through the verify graphs and the prompt-step graphs."""
    return tuple(0 if g is None else g.replays for g in (runner.verify_graphs, runner.prefill_graphs))


def _verify_path(whole: int, prompt: int, steps: int) -> str:
    """Which path `steps` verify steps took, from the graphs' replay counts over them."""
    if whole >= steps:
        return "whole-step verify cuda graphs"
    if whole + prompt >= steps:
        return f"prompt-step cuda graphs ({whole} of {steps} steps through verify graphs)"
    return f"eager ({whole} of {steps} steps through verify graphs, {prompt} through prompt-step graphs)"


def mode_verify(args) -> None:
    """Issue 21's verify-step goal (Llama-3-8B shape, k = 4: at most 1.15x a decode step at batch 1-8).

    One engine with n-gram speculation and the same running sequences (prompts of --verify-context tokens) in
    alternating phases: steps whose every sequence verifies a k-token draft (k + 1 query tokens against the paged
    cache, as the engine schedules them) and plain decode steps (drafts forced off). Both kinds of step then run
    synchronously (a step that may speculate does), so their wall times compare the same work plus its drafts.
    The drafts are forced (k copies of the sequence's last token, whatever n-gram lookup would find): a verify
    step costs the same whichever tokens it scores, and dummy weights give no text to look up. The acceptance
    estimates are frozen so that the cost model keeps every draft at k. The plain decode steps of an engine
    without speculation (asynchronous scheduling, the production path) are timed too, as a second baseline.
    Rows say which path each kind of step took: decode steps replay whole-step CUDA graphs, verify steps (several
    query tokens per sequence) the whole-step verify graphs (engine/runner/cuda_graphs.py), or else the prompt-step
    graphs, or eager forwards.
    """
    model = args.verify_model or LLAMA_8B
    k, ctx, steps = args.verify_k, args.verify_context, args.verify_steps
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    on_cuda = torch.cuda.is_available()
    max_len = ctx + 3 * steps * (k + 1) + 64
    budget = {"num_gpu_blocks_override": 8 * (max_len // 16 + 2) + 64} if on_cuda else {"cpu_kv_cache_bytes": 256 << 20}
    # Prompt-step graphs up to 64 tokens: the sizes (16, 32, 48, 64) the default's 1024 has there, without the time
    # capturing the larger ones takes; a verify step of batch 8 is 8 x (k + 1) = 40 tokens.
    common = {"max_model_len": max_len, "max_num_seqs": 8, "max_prefill_graph_tokens": 64, **budget, **_engine_kw(args)}
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    llm = _llm(model, args.backend, args.eager, speculative_config=spec, **common)
    plain = _llm(model, args.backend, args.eager, **common)
    engine = llm.engine
    speculator = engine.speculator
    speculator.speculate_always()  # every draft as long as its room allows ...
    speculator.observe = lambda *a: None  # ... at the prior acceptance estimate, whatever was accepted
    draft_on = {"on": True}

    def forced(seqs, ks):
        return {s.seq_id: [int(s.token_ids[-1])] * int(n) for s, n in zip(seqs, ks)} if draft_on["on"] else {}

    speculator._propose = forced
    runner = engine.runner
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_len - ctx - 8, ignore_eos=True)
    for batch in args.verify_batches:
        prompts = [[int(t) % vocab for t in p] for p in _fixed_prompts(batch, ctx, seed=100 + batch)]
        phases: dict[str, list[float]] = {"decode": [], "verify": []}
        accepted = 0
        for e in (engine, plain.engine):
            for i, p in enumerate(prompts):
                e.add_request(f"v{batch}-{i}", p, params)
            started = set()
            while len(started) < batch:  # prefill, then every sequence is decoding
                started |= {o.request_id for o in e.step()}
        _verify_phase(engine, draft_on, True, 3)  # warm-up of both kinds of step at this batch size
        _verify_phase(engine, draft_on, False, 3)
        replays0 = _replays(runner)
        for on in (False, True, False, True):  # alternating: the context grows alike under both
            times, acc = _verify_phase(engine, draft_on, on, steps // 2)
            phases["verify" if on else "decode"] += times
            accepted += acc if on else 0
        whole, prompt = (now - before for now, before in zip(_replays(runner), replays0))
        async_times = []
        for _ in range(steps + 3):
            t0 = time.perf_counter()
            plain.engine.step()
            async_times.append(time.perf_counter() - t0)
        for e in (engine, plain.engine):
            for i in range(batch):
                e.abort_request(f"v{batch}-{i}")
            while e.has_unfinished_requests():
                e.step()
        decode, verify = statistics.median(phases["decode"]), statistics.median(phases["verify"])
        emit(
            args,
            {
                "mode": "verify",
                "model": Path(model).name,
                "batch": batch,
                "k": k,
                "context": ctx,
                "backend": args.backend,
                "decode_step_ms": decode * 1e3,
                "verify_step_ms": verify * 1e3,
                "verify_over_decode": verify / decode,
                "goal_1_15x_met": verify / decode <= 1.15,
                "async_plain_decode_step_ms": statistics.median(async_times[3:]) * 1e3,
                "verify_over_async_decode": verify / statistics.median(async_times[3:]),
                "timed_steps_each": len(phases["verify"]),
                "accepted_per_verify_step": accepted / max(1, len(phases["verify"]) * batch),
                "decode_path": "cuda graph (whole step)" if runner.graphs is not None else "eager",
                "verify_path": _verify_path(whole, prompt, len(phases["verify"])),
            },
        )


# Quantized kinds at the Llama-3-8B shape (dummy weights): kind -> (--quantization, recipe of config.json's
# quantization_config in bench/quant_checkpoints.py, or None for a load-time scheme or none).
QUANT_KINDS = {
    "bf16": (None, None),
    "w8a16": ("int8", None),
    "w4a16-g128": (None, "gptq-w4g128"),
    "fp8": ("fp8", None),
    "w8a8-int8": (None, "ct-w8a8-int8"),
}


def _quant_model_dir(recipe: str | None, base: str = LLAMA_8B) -> str:
    """The `base` config (Llama-3-8B's), with the recipe's quantization_config when it names one (a temporary
    copy)."""
    import tempfile

    from bench.quant_checkpoints import RECIPES, _quantization_config

    if recipe is None:
        return base
    cfg = json.loads((Path(base) / "config.json").read_text())
    cfg["quantization_config"] = _quantization_config(RECIPES[recipe])
    out = Path(tempfile.mkdtemp(prefix=f"llama3-8b-{recipe}-"))
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _linear_bytes(model: torch.nn.Module) -> int:
    """Bytes of every linear layer's own tensors (weights, packed integers, scales, zero points, biases): what
    a decode step reads in full; the embedding (a few rows a step), the norms (kilobytes) and a WeightOnlyLinear's
    fragment-layout copies (a step reads one layout of each weight) are left out."""
    from engine.layers.linear import PackedLinear, ScaledLinear, WeightOnlyLinear

    total = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, PackedLinear, WeightOnlyLinear, ScaledLinear)):
            buffers = [b for name, b in module.named_buffers(recurse=False) if not name.startswith("qweight_fragment")]
            tensors = list(module.parameters(recurse=False)) + buffers
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def mode_quant_decode(args) -> None:
    """Decode steps of Llama-3-8B (dummy weights) in bf16 and each quantized kind at each --decode-batches size
    (1, 16 and 64 by default) with 128-token prompts: tok/s, and the achieved linear-weight bandwidth (linear
    bytes / median step time)."""
    import gc

    hbm, _ = measure_peaks()
    # bf16's step times, for vs_bf16: from this call, or from an earlier one at this commit in --out (one
    # process per kind, as bench/gpu_check.sh runs it, so each engine's memory is surely returned).
    base: dict[int, float] = {}
    if os.path.exists(args.out):
        for line in open(args.out):
            row = json.loads(line)
            if row.get("mode") == "quant-decode" and row["kind"] == "bf16" and row["commit"] == _commit():
                base[row["batch"]] = row["step_ms"] / 1e3
    kinds = args.kinds or list(QUANT_KINDS)
    for kind in kinds:
        quantization, recipe = QUANT_KINDS[kind]
        llm = _llm(
            _quant_model_dir(recipe),
            args.backend,
            args.eager,
            quantization=quantization,
            quant_fragment_copies=not args.no_quant_fragment_copies,
        )
        model = llm.engine.runner.model
        cfg = model.config
        weight_bytes = _linear_bytes(model)
        kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
        for batch in args.decode_batches:
            times = _step_times(llm, _fixed_prompts(batch, 128, seed=batch), max_tokens=48, timed_steps=32)
            step_s = statistics.median(times)
            if kind == "bf16":
                base[batch] = step_s
            emit(
                args,
                {
                    "mode": "quant-decode",
                    "kind": kind,
                    "quantization": quantization,
                    "checkpoint_config": recipe,
                    "batch": batch,
                    "context": 128,
                    "backend": args.backend,
                    "cuda_graphs": not args.eager,
                    "fragment_copies": not args.no_quant_fragment_copies,
                    "step_ms": step_s * 1e3,
                    "tok_s": batch / step_s,
                    "vs_bf16": base[batch] / step_s if batch in base else None,
                    "linear_bytes": weight_bytes,
                    "weight_gbps": weight_bytes / step_s / 1e9,
                    "weight_hbm_fraction_measured": weight_bytes / step_s / hbm,
                    "kv_bytes_read": batch * (128 + 24) * kv_bytes_per_token,  # about mid-way through the timed steps
                },
            )
        del llm, model
        gc.collect()
        torch.cuda.empty_cache()


def mode_long_prompt(args) -> None:
    """Time to the first token of one long prompt (Llama-3-8B shape), its attention through
    flash-attn-4 or through pagoda's kernels, alternating in one engine (the route toggled on its
    layers). Whole prompts in one step (a step budget of the longest), then an 8k prompt in
    2,048-token chunks and a 32k prompt in 8,192-token chunks (the chunks after the first read
    cached context through the block tables)."""
    import shutil
    import tempfile

    from engine import SamplingParams

    # Llama-3-8B's config stops at 8,192 positions; Llama-3.1-8B is the same shape with 131,072.
    model = Path(tempfile.mkdtemp()) / "llama3-8b-long"
    shutil.copytree(LLAMA_8B, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (model / "config.json").write_text(json.dumps(config))
    # The engine's threshold at 1,024 tokens, so that every length here can take either route.
    for budget, lengths in ((32768, (1024, 2048, 4096, 8192, 16384, 32768)), (2048, (8192,)), (8192, (32768,))):
        llm = _llm(
            str(model),
            args.backend,
            True,
            max_num_batched_tokens=budget,
            max_model_len=32768 + 64,
            fa4_prefill_min_tokens=1024,
        )
        runner = llm.engine.runner
        if not runner.fa4_min_tokens:
            print("flash-attn-4 does not import here: nothing to compare")
            return
        layers = list(runner.model.attention_layers())
        for n in lengths:
            for rep in range(3):
                for route in ("fa4", "own"):
                    for attn in layers:
                        attn.fa4_min_tokens = runner.fa4_min_tokens if route == "fa4" else 0
                    prompt = _fixed_prompts(1, n, seed=10_000 * rep + n + (route == "fa4"))[0]
                    llm.engine.add_request(
                        f"{route}-{n}-{rep}-{budget}", prompt, SamplingParams(temperature=0.0, max_tokens=1)
                    )
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    while llm.engine.has_unfinished_requests():
                        llm.engine.step()
                    emit(
                        args,
                        {
                            "mode": "long_prompt",
                            "route": route,
                            "prompt_tokens": n,
                            "step_budget": budget,
                            "rep": rep,
                            "ttft_ms": (time.perf_counter() - t0) * 1e3,
                        },
                    )
        del llm, runner, layers
        torch.cuda.empty_cache()


def mode_long_decode(args) -> None:
    """Decode throughput of a batch of long contexts (Llama-3-8B shape; default 64 prompts of 8,000
    tokens, 192 tokens out each, so contexts reach 8,192), once per KV-cache dtype (bf16 "auto", then
    fp8), with the pool size in tokens of each. A bf16 pool may not hold the whole batch: the scheduler
    then decodes fewer sequences at a time (and preempts), which is what the fp8 cache's capacity buys.
    decode_tok_s counts the steps that carried no prompt tokens: their tokens over their wall time."""
    from engine import SamplingParams

    model = args.long_model or LLAMA_8B
    batch, context, out = args.long_batch, args.long_context, args.long_output
    for kv in args.long_kv:
        llm = _llm(model, args.backend, args.eager, kv_cache_dtype=kv, max_model_len=context + out, max_num_seqs=batch)
        engine = llm.engine
        pool_tokens = engine.block_manager.num_blocks * engine.config.block_size
        prompts = random_prompts(batch, context, engine.runner.vocab_size, 3)  # the same for every dtype
        params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"long-{kv}-{i}", p, params)
        decode_s, decode_tokens, decode_batches = 0.0, 0, []
        preempted = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t0
            stats = engine.last_step
            preempted += stats.num_preempted
            if stats.num_prefill_tokens == 0 and stats.num_generated_tokens > 0:
                decode_s += wall
                decode_tokens += stats.num_generated_tokens
                decode_batches.append(stats.num_generated_tokens)
        elapsed = time.perf_counter() - start
        emit(
            args,
            {
                "mode": "long_decode",
                "kv_cache_dtype": kv,
                "cache_dtype": str(engine.runner.kv_cache.dtype).removeprefix("torch."),
                "pool_tokens": pool_tokens,
                "batch": batch,
                "prompt_tokens": context,
                "output_tokens": batch * out,
                "decode_steps": len(decode_batches),
                "median_decode_batch": statistics.median(decode_batches) if decode_batches else 0,
                "decode_tok_s": decode_tokens / decode_s if decode_s else None,
                "output_tok_s_overall": batch * out / elapsed,
                "elapsed_s": elapsed,
                "preemptions": preempted,
                "backend": args.backend,
                "cuda_graphs": not args.eager,
                "async_scheduling": ASYNC,
            },
        )
        del llm, engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def mode_profile(args) -> None:
    """Where a step's time goes: W2 (or W1), per-step wall time, cProfile of the host work over
    steps 100-400 and a torch.profiler trace of steps 400-410 (kernel time by name)."""
    import cProfile
    import io
    import pstats

    from engine import SamplingParams

    model, prompts, outs = _workload(args.name)
    llm = _llm(model, args.backend, args.eager, **_engine_kw(args))
    engine = llm.engine
    for i, (p, n) in enumerate(zip(prompts, outs)):
        engine.add_request(
            f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind="final_only")
        )  # as LLM.generate does
    profiler = cProfile.Profile()
    walls, step = [], 0
    first, last = (20, 120) if args.name == "w1" else (100, 400)
    if args.trace_at is not None:  # trace other steps (e.g. 0: the first prompt-heavy steps)
        first, last = 0, args.trace_at
    while engine.has_unfinished_requests():
        if step == first:
            profiler.enable()
        if step == last:
            profiler.disable()
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                t0 = time.perf_counter()
                for i in range(10):
                    with torch.profiler.record_function(f"engine.step {step + i}"):
                        engine.step()
                torch.cuda.synchronize()
                traced_wall = time.perf_counter() - t0
            if args.chrome_trace:
                prof.export_chrome_trace(args.chrome_trace)
                subprocess.run(["gzip", "-f", args.chrome_trace], check=True)
            step += 10
            continue
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        step += 1
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))
    device_us = sum(e.self_device_time_total for e in prof.key_averages())
    emit(
        args,
        {
            "mode": "profile",
            "workload": args.name,
            "backend": args.backend,
            "cuda_graphs": not args.eager,
            "async_scheduling": ASYNC,
            "steps": step,
            "step_ms_median": statistics.median(walls) * 1e3,
            "total_s": sum(walls),
            "traced_steps_wall_ms": traced_wall * 1e3,
            "traced_steps_device_ms": device_us / 1e3,
        },
    )


def mode_decode_ncu(args) -> None:
    """The decode kernel alone at the W2-like shape (Qwen3-0.6B attention: 16 / 8 heads, D 128, 256 sequences
    of U[100, 1280] keys), shipped tiles, fp8 then bf16 cache, three calls each: for `ncu -k regex:_decode_kernel`
    (bash bench/gpu_check.sh decode-ncu)."""
    from engine import kv_fp8
    from engine.kernels.decode import paged_decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k16, v16, tables, seq_lens = _decode_batch(256, 1280, 16, 8, 128, 16, True, gen)
    ks = torch.tensor([0.05], device="cuda")
    k8, v8 = (kv_fp8.quantize(c, ks, torch.float8_e4m3fn) for c in (k16, v16))
    for k_cache, v_cache, scales in ((k8, v8, dict(k_scale=ks, v_scale=ks)), (k16, v16, {})):
        for _ in range(3):
            paged_decode(q, k_cache, v_cache, tables, seq_lens, 128**-0.5, **scales)
    torch.cuda.synchronize()
    print("keys", int(seq_lens.sum()))


def write_random_checkpoint(config: dict, path: Path, device: str, seed: int = 0) -> None:
    """A bf16 safetensors checkpoint of a Llama config with random weights, named as transformers names them
    (made on `device` a tensor at a time, so no host holds the model)."""
    from safetensors.torch import save_file

    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    names = list(shapes)
    for i, name in enumerate(names):  # shards of about 512 MiB, and the index transformers reads them by
        shard[name] = (torch.randn(shapes[name], generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()
        if i == len(names) - 1 or sum(t.nbytes for t in shard.values()) > 2**29:
            file = f"model-{i:05d}.safetensors"
            save_file(shard, str(path / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, file)
            shard = {}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))


def mode_load_memory(args) -> None:
    """The memory a load peaks at and keeps, Llama-3-8B shape (or --load-model's): dummy weights for each
    QUANT_KINDS kind (a quantized config's linears made one layer at a time), then a bf16 checkpoint read in
    bf16 and with `--quantization fp8 / int8` (quantized as the checkpoint fills each linear): --load-model's own
    safetensors when it has them, else random ones for its first --load-layers layers. One row per load: peak and
    kept bytes (GiB beside them), the CUDA allocator's on a GPU, the storages torch allocated on the CPU
    (bench/live_bytes.py)."""
    import gc
    import shutil
    import tempfile

    from bench.live_bytes import LiveBytes
    from engine.loader import load_model

    device = torch.device(args.load_device)

    def measure(model_dir: str, load_format: str, quantization: str | None) -> dict:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            model, _ = load_model(model_dir, torch.bfloat16, device, load_format=load_format, quantization=quantization)
            peak, kept = torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
        else:
            with LiveBytes() as watch:
                model, _ = load_model(
                    model_dir, torch.bfloat16, device, load_format=load_format, quantization=quantization
                )
            peak, kept = watch.peak, watch.live
        del model
        return {
            "peak_gib": round(peak / 2**30, 3),
            "kept_gib": round(kept / 2**30, 3),
            "peak_bytes": peak,
            "kept_bytes": kept,
        }

    base = args.load_model or LLAMA_8B
    config = json.loads((Path(base) / "config.json").read_text())
    for kind, (quantization, recipe) in QUANT_KINDS.items():
        row = measure(_quant_model_dir(recipe, base), "dummy", quantization)
        emit(args, {"mode": "load-memory", "load": "dummy", "kind": kind, "layers": config["num_hidden_layers"], **row})
    random = not list(Path(base).glob("*.safetensors"))
    ckpt = Path(tempfile.mkdtemp(prefix="load-memory-")) if random else Path(base)
    try:
        if random:
            config["num_hidden_layers"] = min(args.load_layers, config["num_hidden_layers"])
            write_random_checkpoint(config, ckpt, args.load_device)
        for quantization in (None, "fp8", "int8"):
            row = measure(str(ckpt), "auto", quantization)
            emit(args, {"mode": "load-memory", "load": "random checkpoint" if random else "checkpoint",
                        "kind": quantization or "bf16", "layers": config["num_hidden_layers"], **row})  # fmt: skip
    finally:
        if random:
            shutil.rmtree(ckpt)


def mode_quant_profile(args) -> None:
    """Kernel time by name over 10 decode steps of Llama-3-8B (dummy weights) at batch 1 and 64 (128-token
    prompts) for each --kinds kind (default bf16 and fp8): where a quantized decode step's time goes."""
    from engine import SamplingParams

    for kind in args.kinds or ["bf16", "fp8"]:
        quantization, recipe = QUANT_KINDS[kind]
        llm = _llm(_quant_model_dir(recipe), args.backend, args.eager, quantization=quantization)
        engine = llm.engine
        for batch in (1, 64):
            params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            for i, p in enumerate(_fixed_prompts(batch, 128, seed=batch)):
                engine.add_request(f"{kind}-{batch}-{i}", p, params)
            for _ in range(12):
                engine.step()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for _ in range(10):
                    engine.step()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            while engine.has_unfinished_requests():
                engine.step()
            events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
            device_us = sum(e.self_device_time_total for e in events)
            print(f"--- {kind} batch {batch}: wall {wall * 1e2:.3f} ms/step, device {device_us / 10 / 1e3:.3f} ms/step")
            for e in events[:14]:
                print(f"  {e.self_device_time_total / 10:9.1f} us/step  {e.count // 10:4d}/step  {e.key[:110]}")
            top = [(e.key[:110], e.self_device_time_total / 10, e.count // 10) for e in events[:14]]
            emit(args, {"mode": "quant-profile", "kind": kind, "batch": batch, "wall_ms_per_step": wall * 1e2,
                        "device_ms_per_step": device_us / 1e4, "top": top})  # fmt: skip
        del llm, engine
        torch.cuda.empty_cache()


def _workload(name: str):
    if name == "w1":
        return LLAMA_8B, w1_prompts(), [256] * 64
    prompts, outs = ranged_workload(256, 100, 1024, 151936, 0)
    return QWEN3_06B, prompts, outs


def _engine_kw(args) -> dict:
    return {
        k: v
        for k, v in (
            ("max_num_seqs", args.max_num_seqs),
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("max_prefill_graph_tokens", args.max_prefill_graph_tokens),
            ("gpu_memory_utilization", args.gpu_memory_utilization),
            ("kv_cache_dtype", args.kv_cache_dtype),
            ("quantization", args.quantization),
        )
        if v is not None
    }


def mode_timeline(args) -> None:
    """Where a workload's wall time goes, step by step: steps that carry prompt tokens, and pure
    decode steps by batch size. With async scheduling a step() call returns the step launched by
    the call before, so its wall time is that step's device time once the GPU is the bottleneck."""
    from engine import SamplingParams

    model, prompts, outs = _workload(args.name)
    llm = _llm(model, args.backend, args.eager, **_engine_kw(args))
    engine = llm.engine
    for i, (p, n) in enumerate(zip(prompts, outs)):
        engine.add_request(
            f"t{i}", p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind="final_only")
        )
    cfg = engine.runner.model.config
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V, every layer
    rows = []
    torch.cuda.synchronize()
    before = _allocator_counts()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        st = engine.last_step
        # The KV a decode step reads: the running sequences' cached tokens (give or take the step in flight).
        context = sum(seq.num_computed_tokens for seq in engine.scheduler.running)
        rows.append(
            (time.perf_counter() - t0, st.num_batched_tokens, st.num_prefill_tokens, st.num_generated_tokens, context)
        )
    total = time.perf_counter() - start
    buckets: dict[str, list] = {}
    for row in rows:
        wall, batched, prefill = row[:3]
        if prefill:
            key = "prefill"
        else:
            key = next(f"decode<={b}" for b in (1, 8, 32, 64, 128, 256, 1 << 30) if batched <= b)
        buckets.setdefault(key, []).append(row)
    summary = {
        k: {
            "steps": len(v),
            "wall_s": sum(r[0] for r in v),
            "step_ms_median": statistics.median(r[0] for r in v) * 1e3,
            "tokens": sum(r[1] for r in v),
            "prefill_tokens": sum(r[2] for r in v),
            "generated": sum(r[3] for r in v),
            "kv_read_tb": sum(r[4] for r in v) * kv_per_token / 1e12,
            "kv_tb_per_s": sum(r[4] for r in v) * kv_per_token / 1e12 / sum(r[0] for r in v),
        }
        for k, v in sorted(buckets.items())
    }
    for k, v in summary.items():
        print(
            f"{k:14s} {v['steps']:6d} steps {v['wall_s']:7.3f} s  median {v['step_ms_median']:7.2f} ms  "
            f"tokens {v['tokens']:8d} prefill {v['prefill_tokens']:8d} generated {v['generated']:7d} "
            f"KV {v['kv_read_tb']:6.2f} TB at {v['kv_tb_per_s']:5.2f} TB/s"
        )
    emit(
        args,
        {
            "mode": "timeline",
            "engine_kw": _engine_kw(args),
            "workload": args.name,
            "backend": args.backend,
            "cuda_graphs": not args.eager,
            "async_scheduling": ASYNC,
            "total_s": total,
            "steps": len(rows),
            "buckets": summary,
            "allocator": {k: v - before[k] for k, v in _allocator_counts().items()},
        },
    )


def mode_ttft(args) -> None:
    """Time to first token of one 512-token prompt on an idle engine (Llama-3-8B shape): the engine's
    share of the online sweep's TTFT at one user, and a profile of that first step."""
    from engine import SamplingParams

    llm = _llm(LLAMA_8B, args.backend, args.eager, **_engine_kw(args))
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def first_token(i: int) -> float:
        prompt = _fixed_prompts(1, 512, seed=1000 + i)[0]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.add_request(f"ttft{i}", prompt, params)
        while not any(o.outputs[0].token_ids for o in engine.step() if o.request_id == f"ttft{i}"):
            pass
        elapsed = time.perf_counter() - t0
        engine.abort_request(f"ttft{i}")
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    import cProfile
    import io
    import pstats

    launches: list[float] = []
    launch = engine.runner.launch

    def timed_launch(*a, **kw):  # the host's share of a step: schedule-to-enqueued
        t0 = time.perf_counter()
        out = launch(*a, **kw)
        launches.append(time.perf_counter() - t0)
        return out

    engine.runner.launch = timed_launch
    for i in range(3):
        first_token(i)
    launches.clear()
    times = [first_token(10 + i) for i in range(10)]
    launch_ms = sorted(t * 1e3 for t in launches)
    profiler = cProfile.Profile()
    profiler.enable()
    first_token(50)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    # A launch that waits for the device somewhere (a blocking copy, a sync) takes as long as the
    # work queued before it: enqueue ~50 ms of sleep, then time the launches of a prefill and a decode.
    busy = {}
    engine.add_request("busy", _fixed_prompts(1, 512, seed=77)[0], params)
    for kind in ("prefill", "decode"):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        launches.clear()
        engine.step()
        busy[kind] = round(launches[0] * 1e3, 2)
    engine.abort_request("busy")
    while engine.has_unfinished_requests():
        engine.step()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        traced = first_token(99)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=20))
    device_us = sum(e.self_device_time_total for e in prof.key_averages())
    emit(
        args,
        {
            "mode": "ttft",
            "engine_kw": _engine_kw(args),
            "backend": args.backend,
            "cuda_graphs": not args.eager,
            "async_scheduling": ASYNC,
            "prompt_tokens": 512,
            "ttft_ms_median": statistics.median(times) * 1e3,
            "ttft_ms": [round(t * 1e3, 2) for t in times],
            "traced_wall_ms": traced * 1e3,
            "launch_ms_sorted": [round(t, 2) for t in launch_ms],
            "launch_ms_behind_50ms_sleep": busy,
            "traced_device_ms": device_us / 1e3,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "mode",
        choices=[
            "peaks",
            "kernels",
            "decode-splits",
            "decode-tiles",
            "greedy",
            "workload",
            "transformers",
            "roofline",
            "profile",
            "timeline",
            "ttft",
            "gemms",
            "long-prompt",
            "long-decode",
            "quant-decode",
            "verify",
            "decode-ncu",
            "quant-profile",
            "load-memory",
        ],
    )
    parser.add_argument("name", nargs="?", default="w1", choices=["w1", "w2"])
    parser.add_argument("--backend", default="triton", choices=["torch", "triton", "flash_attn", "cpu"])
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--sync",
        dest="async_scheduling",
        action="store_false",
        help="no async scheduling (the engine default on CUDA is async)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-prefill-graph-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--kv-cache-dtype", default=None, help="workload modes: the engine's kv_cache_dtype")
    parser.add_argument("--long-model", default=None, help="long-decode: HF directory (default Llama-3-8B shape)")
    parser.add_argument("--long-batch", type=int, default=64, help="long-decode: prompts decoded together")
    parser.add_argument("--long-context", type=int, default=8000, help="long-decode: tokens per prompt")
    parser.add_argument("--long-output", type=int, default=192, help="long-decode: tokens out per prompt")
    parser.add_argument("--long-kv", nargs="+", default=["auto", "fp8"], help="long-decode: KV dtypes, in order")
    parser.add_argument("--quantization", default=None, help="workload mode: --quantization (e.g. fp8)")
    parser.add_argument("--kinds", nargs="+", choices=list(QUANT_KINDS), help="quant-decode mode: these kinds only")
    parser.add_argument(
        "--no-quant-fragment-copies",
        action="store_true",
        help="quant-decode mode: EngineConfig.quant_fragment_copies off (4-bit tiles read the packed weight)",
    )
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64], help="quant-decode mode: batches")
    parser.add_argument("--prompt-len", type=int, default=64, help="greedy mode: tokens per prompt")
    parser.add_argument("--trace-at", type=int, default=None, help="profile mode: trace steps N..N+10")
    parser.add_argument("--chrome-trace", default=None, help="profile mode: write the trace there (gzipped)")
    parser.add_argument("--verify-model", default=None, help="verify mode: HF directory (default Llama-3-8B shape)")
    parser.add_argument("--verify-k", type=int, default=4, help="verify mode: draft tokens per verify step")
    parser.add_argument("--verify-context", type=int, default=1024, help="verify mode: prompt tokens per sequence")
    parser.add_argument("--verify-batches", type=int, nargs="+", default=[1, 2, 4, 8], help="verify mode: batches")
    parser.add_argument("--verify-steps", type=int, default=40, help="verify mode: timed steps of each kind")
    parser.add_argument("--load-model", default=None, help="load-memory mode: HF directory (default Llama-3-8B shape)")
    parser.add_argument("--load-layers", type=int, default=8, help="load-memory mode: layers of its checkpoint")
    parser.add_argument("--load-device", default="cuda", help="load-memory mode: the device loaded to")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if min(args.decode_batches) < 1:
        parser.error(f"--decode-batches: batch sizes are at least 1, not {min(args.decode_batches)}")
    if args.out is None:
        args.out = (
            os.path.join(os.environ["OUT"], "gpu_check.jsonl")
            if os.environ.get("OUT")
            else str(ROOT / results_path("gpu-check", "cuda"))
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    global ASYNC
    ASYNC = args.async_scheduling
    {
        "peaks": mode_peaks,
        "kernels": mode_kernels,
        "decode-splits": mode_decode_splits,
        "decode-tiles": mode_decode_tiles,
        "greedy": mode_greedy,
        "workload": mode_workload,
        "transformers": mode_transformers,
        "roofline": mode_roofline,
        "profile": mode_profile,
        "long-prompt": mode_long_prompt,
        "long-decode": mode_long_decode,
        "timeline": mode_timeline,
        "ttft": mode_ttft,
        "gemms": mode_gemms,
        "quant-decode": mode_quant_decode,
        "verify": mode_verify,
        "decode-ncu": mode_decode_ncu,
        "quant-profile": mode_quant_profile,
        "load-memory": mode_load_memory,
    }[args.mode](args)


if __name__ == "__main__":
    main()
