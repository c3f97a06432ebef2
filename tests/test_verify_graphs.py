"""Whole-step CUDA graphs for the verify steps of speculative decoding (engine/runner/cuda_graphs.py,
DecodeGraphs with k + 1 query rows a sequence).

On the CPU: the verify graphs' layout (rows padded to k + 1, padded sequences, the split-KV decode kernel
attending several causal queries a sequence, under the Triton interpreter) gives the logits of the eager
verify step. On the GPU: greedy output with verify graphs equals the eager engine's and no speculation's, for
n-gram and draft-model speculation; the graphs are replayed (their counter); nothing is captured or compiled
after start-up.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.runner.cuda_graphs import rows_metadata, stage_verify
from engine.runner.step_inputs import attention_metadata, block_table_array
from engine.sampling_params import SamplingParams
from tests.conftest import KV_BYTES
from tests.test_spec_decode import NGRAM, repetitive_prompts, run

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parents[1]


# ----- the layout, on the CPU (Triton interpreter) -----


@torch.inference_mode()
def verify_layout_logits(runner, queries, batch, token_ids, positions, tables, num_new, select):
    """The forward a verify graph captures, run eagerly: inputs staged as DecodeGraphs.run stages them, the
    lengths derived as its graph derives them; the logits of the tokens `select`."""
    n = len(num_new)
    host = np.zeros((4, batch * queries), dtype=np.int64)
    tables_host = np.zeros((batch, 64), dtype=np.int32)
    block_table_array(tables, tables_host)
    rows = stage_verify(host, queries, runner.block_size, batch, token_ids, positions, tables_host, num_new)
    inputs = torch.from_numpy(host)
    ids, pos, slots = inputs[0], inputs[1], inputs[2]
    seq_lens = (pos.view(batch, queries)[:, -1] + 1).to(torch.int32)
    query_lens = inputs[3, :batch].to(torch.int32)
    query_start = torch.arange(batch + 1, dtype=torch.int32) * queries
    meta = rows_metadata(batch, queries, slots, torch.from_numpy(tables_host), seq_lens, query_start, query_lens, 256)
    assert meta.decode_only and meta.queries_per_seq == queries
    runner.backend.plan(meta)
    logits = runner.model.compute_logits(runner.model(ids, pos, meta))
    assert logits.isfinite().all()  # padding rows included
    assert n == batch or (host[2, n * queries :] == -1).all()
    return logits[torch.from_numpy(rows[select])]


@torch.inference_mode()
def eager_logits(runner, token_ids, positions, tables, num_new, select):
    meta = attention_metadata(runner.backend, runner.block_size, runner.device, num_new, positions, tables)
    hidden = runner.model(torch.from_numpy(token_ids), torch.from_numpy(positions), meta)
    return runner.model.compute_logits(hidden[torch.from_numpy(select)])


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runs the kernels in Triton's interpreter, off where a GPU is (the CUDA tests below cover the layout)",
)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_verify_layout_gives_the_eager_verify_steps_logits(arch, tiny_model_dir):
    """Sequences with contexts of 0 to 70 tokens (one shorter than a block, several across blocks) verify
    drafts of 3, 1 and 0 tokens with k = 3 (q = 4 rows each, two of them partly padding) in a batch padded
    from 4 to 8 sequences: every scored token's logits equal the eager verify step's (paged prefill kernel).
    The KV the layout stores is the eager step's too: the same step run again eagerly after it agrees."""
    llm = LLM(
        str(tiny_model_dir(arch)), dtype="float32", device="cpu", attention_backend="triton", cpu_kv_cache_bytes=1 << 24
    )
    runner = llm.engine.runner
    bs, q = runner.block_size, 4
    gen = np.random.default_rng(5)
    contexts, num_new = [37, 70, 5, 16], np.array([4, 2, 1, 4])
    tables = [list(range(10 * s + 9, 10 * s, -1)) for s in range(len(contexts))]  # non-contiguous, descending
    # The contexts' K/V: one eager prompt step.
    prompt_lens = [c for c in contexts if c]
    prompt_tables = [t for t, c in zip(tables, contexts) if c]
    prompt_pos = np.concatenate([np.arange(c) for c in prompt_lens])
    ids = gen.integers(0, 500, size=len(prompt_pos))
    eager_logits(runner, ids, prompt_pos, prompt_tables, prompt_lens, np.array([0]))
    positions = np.concatenate([np.arange(c, c + m) for c, m in zip(contexts, num_new)])
    token_ids = gen.integers(0, 500, size=len(positions))
    select = np.arange(len(positions))  # every token's logits (a verify step reads its drafting rows' all)
    got = verify_layout_logits(runner, q, 8, token_ids, positions, tables, num_new, select)
    want = eager_logits(runner, token_ids, positions, tables, num_new, select)
    assert bs == 16 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


# ----- the engine on the GPU -----


def run_counting(llm: LLM, prompts, params):
    """tests/test_spec_decode.py's run(), and how many of its steps verified drafts."""
    engine = llm.engine
    step = engine.step
    verify_steps = []

    def counted():
        outs = step()
        verify_steps.append(engine.last_step.num_drafts > 0)
        return outs

    engine.step = counted
    try:
        got, stats = run(llm, prompts, params)
    finally:
        engine.step = step
    return got, stats, sum(verify_steps)


@CUDA
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_verify_graphs_equal_eager_and_no_speculation(method, arch, tiny_model_dir, tmp_path, monkeypatch):
    """Greedy output with verify graphs equals the eager engine's (--enforce-eager) and no speculation's; the
    verify graphs were replayed (their counter) and no graph was captured while serving. Drafts of 3 tokens cut
    short near max_tokens (and by the adaptive k) pad their rows; six sequences under a batch limit of 4 leave
    steps where some rows draft and others only decode."""
    from tests.test_spec_draft import cuda_greedy_case, noisy_copy

    model_dir = tiny_model_dir(arch)
    prompts, params, kwargs, want = cuda_greedy_case(model_dir, seed=21)
    if method == "ngram":
        spec = {**NGRAM, "num_speculative_tokens": 3, "disable_by_batch_size": 4}
    else:
        spec = {"model": str(noisy_copy(model_dir, tmp_path / "draft", 0.03)), "num_speculative_tokens": 3}
        spec["disable_by_batch_size"] = 4
    captures = []
    begin = torch.cuda.CUDAGraph.capture_begin
    for eager in (True, False):
        llm = LLM(str(model_dir), speculative_config=spec, enforce_eager=eager, **kwargs)
        llm.engine.speculator.speculate_always()
        verify = llm.engine.runner.verify_graphs
        assert (verify is None) == eager
        monkeypatch.setattr(
            torch.cuda.CUDAGraph, "capture_begin", lambda *a, **kw: captures.append(1) or begin(*a, **kw)
        )
        got, stats, verify_steps = run_counting(llm, prompts, params)
        monkeypatch.undo()
        assert got == want, (method, eager)
        assert stats.num_accepted_tokens > 0
        if not eager:
            assert verify.queries == 4 and verify.sizes[-1] == 4
            # After the first step (every prompt whole) no prompt chunk comes beside the drafts: every verify
            # step replays a verify graph.
            assert verify.replays == verify_steps > 0
        assert not any(llm.engine.block_manager.ref_counts)
        del llm
    assert captures == []


@CUDA
def test_cuda_verify_graphs_with_the_default_model(default_model_dir):
    """The real default model with n-gram speculation (k = 5) on tests/test_spec_decode.py's prompts: greedy
    output equal to no speculation's, drafts accepted, the verify steps on the graphs. float32, so that no
    near-tie between two tokens turns on bf16 rounding that differs between the verify and decode kernels."""
    from tests.test_spec_decode import REPEAT

    prompts = [REPEAT, "List the numbers from 1 to 12, separated by commas: 1, 2, 3,"]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    kwargs = dict(dtype="float32", device="cuda", num_gpu_blocks_override=512, max_model_len=512)
    want, _ = run(LLM(str(default_model_dir), **kwargs), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(default_model_dir), speculative_config=spec, **kwargs)
    llm.engine.speculator.speculate_always()
    got, stats, verify_steps = run_counting(llm, prompts, params)
    assert got == want and stats.num_accepted_tokens >= 5
    assert llm.engine.runner.verify_graphs.replays == verify_steps > 0


_NO_COMPILE_SCRIPT = """
import json, sys, torch
from bench.compiles import count_compiles
from engine import LLM, SamplingParams
spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": 8}
llm = LLM(sys.argv[1], dtype="bfloat16", device="cuda", num_gpu_blocks_override=256, max_model_len=256,
          max_num_batched_tokens=128, max_prefill_graph_tokens=64, kv_cache_dtype=sys.argv[2],
          speculative_config=spec)
llm.engine.speculator.speculate_always()
prompts = json.loads(sys.argv[3])
captures = []
begin = torch.cuda.CUDAGraph.capture_begin
torch.cuda.CUDAGraph.capture_begin = lambda *a, **kw: captures.append(1) or begin(*a, **kw)
with count_compiles() as compiled:
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=1), use_tqdm=False)
print(json.dumps({"compiled": dict(compiled), "captures": len(captures),
                  "verify_replays": llm.engine.runner.verify_graphs.replays}))
"""


@CUDA
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cuda_nothing_compiles_or_captures_after_start_up_with_speculation(kv_cache_dtype, tiny_model_dir):
    """As tests/test_cuda.py's test of that name, with n-gram speculation (k = 4): prompts of 17 to 174
    tokens (chunked at 128, so some steps mix a prompt chunk with verify rows and take the prompt-step graphs),
    verify steps on the verify graphs (greedy, then sampled), over a 16-bit and an fp8 cache: no Triton kernel
    compiles and no CUDA graph is captured after start-up, and the verify graphs were replayed. A fresh
    process."""
    prompts = [p * 6 for p in repetitive_prompts(4, seed=13)] + [repetitive_prompts(1, length=17)[0]]
    args = [str(tiny_model_dir("llama")), kv_cache_dtype, json.dumps(prompts)]
    result = subprocess.run(
        [sys.executable, "-c", _NO_COMPILE_SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["compiled"] == {} and report["captures"] == 0
    assert report["verify_replays"] > 0


def test_no_verify_graphs_without_speculation_or_on_the_cpu(tiny_model_dir):
    """Verify graphs exist only where speculation is configured and graphs are captured: none on the CPU
    (whose path is unchanged), none without --speculative-config."""
    model_dir = str(tiny_model_dir("llama"))
    spec = {**NGRAM, "num_speculative_tokens": 2}
    cpu = LLM(model_dir, dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES, speculative_config=spec)
    assert cpu.engine.runner.verify_graphs is None
    if torch.cuda.is_available():
        plain = LLM(model_dir, dtype="float32", device="cuda", num_gpu_blocks_override=64)
        assert plain.engine.runner.verify_graphs is None and plain.engine.runner.graphs is not None
