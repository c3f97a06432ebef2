"""Speculative decoding with a draft model (engine/spec_decode/draft_model.py): the output is the target
model's own, token for token under greedy and in distribution under sampling (chi-square, with a draft unlike
the target, and a mutated acceptance rule that the check catches), batched, chunked, preempted both ways,
with prefix hits; no KV block leaked; bad drafts refused in one line; the server through the openai SDK."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.llm import LLM
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from tests.conftest import KV_BYTES
from tests.test_spec_decode import (
    MODES,
    REPEAT,
    SAMPLES,
    STAT_PARAMS,
    assert_no_leaks_and_nothing_unverified_named,
    chi_square_p,
    filtered_next_token_probs,
    penalized_params,
    repetitive_prompts,
    run,
)


def noisy_copy(model_dir, out_dir, noise: float, seed: int = 0, scale_head: float = 1.0):
    """`model_dir`'s model with Gaussian noise of std `noise` added to every weight (and its head scaled): a
    draft that agrees with the target often but not always. Saved to `out_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=gen) * noise)
        model.get_output_embeddings().weight.mul_(scale_head)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    """arch -> a noisy copy of the tiny model of that arch (a draft sharing its vocabulary)."""
    return {
        arch: noisy_copy(tiny_model_dir(arch), tmp_path_factory.mktemp(f"draft-{arch}"), 0.03)
        for arch in ("llama", "qwen3")
    }


def make(model_dir, draft, k: int | None = None, batch_limit: int = 64, **kwargs) -> LLM:
    spec = (
        None
        if draft is None
        else {"model": str(draft), "num_speculative_tokens": k, "disable_by_batch_size": batch_limit}
    )
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES, speculative_config=spec, **kwargs
    )
    if llm.engine.speculator is not None:
        llm.engine.speculator.speculate_always()  # always the full k: the most drafts to verify
    return llm


def check_greedy(model_dir, draft, k, prompts, new_tokens=24, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    want, _ = run(make(model_dir, None, **kwargs), prompts, params)
    llm = make(model_dir, draft, k, **kwargs)
    got, stats = run(llm, prompts, params)
    assert got == want
    assert stats.num_drafts > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks or bm.enable_prefix_caching
    assert not any(bm.ref_counts)
    return stats


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_batched_equals_no_speculation(arch, k, tiny_model_dir, drafts):
    stats = check_greedy(tiny_model_dir(arch), drafts[arch], k, repetitive_prompts(6))
    # Both paths of the rule ran: some draft tokens accepted, some rejected.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_target_as_its_own_draft_is_always_accepted(arch, tiny_model_dir):
    stats = check_greedy(tiny_model_dir(arch), tiny_model_dir(arch), 4, repetitive_prompts(4, seed=3))
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_a_draft_of_another_architecture(tiny_model_dir):
    """Qwen3 drafting for Llama (the same vocabulary size, nothing else alike): whatever it proposes, the
    output is Llama's."""
    check_greedy(tiny_model_dir("llama"), tiny_model_dir("qwen3"), 3, repetitive_prompts(3, seed=4))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_equals_no_speculation_when_chunked_or_preempted(mode, tiny_model_dir, drafts):
    model_dir, prompts = tiny_model_dir("llama"), repetitive_prompts(6, length=40, seed=1)
    stats = check_greedy(model_dir, drafts["llama"], 3, prompts, 32, **MODES[mode])
    assert stats.num_accepted_tokens > 0
    # The target as its own draft: every draft token is accepted only if the draft's K/V stayed right
    # through the chunks, the swaps (both caches move) and the recomputations.
    stats = check_greedy(model_dir, model_dir, 3, prompts, 32, **MODES[mode])
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_preemption_really_happens_in_both_modes(tiny_model_dir, drafts):
    for mode, key in (("preempt", "recompute"), ("swap", "swap")):
        llm = make(tiny_model_dir("llama"), drafts["llama"], 3, **MODES[mode])
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
        run(llm, repetitive_prompts(6, length=40, seed=1), params)
        assert llm.engine.scheduler.num_preemptions[key] > 0


def test_greedy_with_prefix_hits_and_n_above_one(tiny_model_dir):
    """The target as its own draft, so every draft token must be accepted: the draft's K/V are right in
    blocks from the prefix cache and in the blocks n > 1 children share."""
    model_dir = tiny_model_dir("qwen3")
    shared = repetitive_prompts(1, length=48, seed=2)[0]
    prompts = [shared + [7, 8], shared + [9]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
    want, _ = run(make(model_dir, None), prompts, params)
    spec = make(model_dir, model_dir, 3)
    got, stats = run(spec, prompts, params)
    again, again_stats = run(spec, prompts, params)  # served from the prefix cache
    assert got == want == again
    for s in (stats, again_stats):
        assert s.num_accepted_tokens == s.num_draft_tokens > 0
    assert spec.engine.block_manager.prefix_hit_tokens >= 2 * 48 // 16 * 16


def test_no_block_leaks_after_many_random_rejections(tiny_model_dir, drafts):
    """Sampled outputs with a draft unlike the target: drafts are accepted and rejected at random points,
    blocks trimmed and re-taken, sequences preempted; at the end every block is free."""
    llm = make(tiny_model_dir("llama"), drafts["llama"], 4, num_gpu_blocks_override=24, max_model_len=192)
    prompts = repetitive_prompts(16, length=32, seed=5)
    params = [SamplingParams(temperature=0.7, max_tokens=60 + i, seed=i, ignore_eos=True) for i in range(16)]
    outs, stats = run(llm, prompts, params)
    assert all(len(o[0]) == 60 + i for i, o in enumerate(outs))
    assert stats.num_drafts > 150 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    assert_no_leaks_and_nothing_unverified_named(llm, prompts, outs)


def test_seeded_sampling_is_reproducible(tiny_model_dir, drafts):
    llm = make(tiny_model_dir("qwen3"), drafts["qwen3"], 3)
    prompts = repetitive_prompts(4, seed=6)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=11, ignore_eos=True)
    first, stats = run(llm, prompts, params)
    second, _ = run(llm, prompts, params)
    assert first == second and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_penalties_beside_plain_rows_see_each_draft_positions_history(tiny_model_dir):
    """The target as its own draft, penalized rows beside plain ones: the draft processes its position i with
    its draft tokens 0..i-1 counted (read on the host as they are drawn), as the target does, so every draft
    token is accepted, and the output is that of no speculation."""
    model_dir = tiny_model_dir("qwen3")
    prompts = repetitive_prompts(4, seed=10)
    params = penalized_params(prompts) + [SamplingParams(temperature=0.0, max_tokens=17)]
    prompts.append(repetitive_prompts(1, seed=15)[0])
    want, _ = run(make(model_dir, None), prompts, params)
    got, stats = run(make(model_dir, model_dir, 4), prompts, params)
    assert got == want
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_drafted_rows_are_checked_with_their_own_parameters_in_a_mixed_batch():
    """The acceptance rule takes the drafted rows' parameters from the batch's own upload: in a batch that
    mixes greedy rows, random rows without a draft and drafted rows (each with its temperature, filters,
    seed and output index), every row's token is the one it gets sampled or checked without the others."""
    from engine.sampler import DraftedRows, SamplerRow

    sampler = Sampler(8, frozenset(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    n = 90
    params = [
        SamplingParams(temperature=0.0)
        if i % 3 == 0
        else SamplingParams(temperature=0.5 + 0.02 * i, top_p=0.9 if i % 2 else 1.0, top_k=5 if i % 5 == 1 else 0)
        for i in range(n)
    ]
    rows = [SamplerRow(p, 100 + i, [1], [], 3 + i % 7) for i, p in enumerate(params)]
    logits = torch.randn(n, 8, generator=gen) * 2
    drafted = [i for i in range(n) if i % 3 == 2]
    alone = [rows[i] for i in drafted]
    tokens, q = sampler.propose(torch.randn(len(drafted), 8, generator=gen) * 2, alone)  # a draft unlike p
    tokens = tokens.tolist()
    mixed = sampler(logits, rows, drafted=DraftedRows(drafted, tokens, q)).token_ids
    checked = sampler(logits[drafted], alone, drafted=DraftedRows(list(range(len(drafted))), tokens, q)).token_ids
    assert mixed[drafted].tolist() == checked.tolist()
    assert checked.tolist() != tokens  # some drafts were rejected: the residual draws ran too
    others = [i for i in range(n) if i not in drafted]
    assert mixed[others].tolist() == sampler(logits, rows).token_ids[others].tolist()


def test_the_memory_profile_runs_the_drafts_largest_forward_and_proposal(tiny_model_dir, drafts):
    """The profiling forward that sizes the pool runs the draft model over max_num_batched_tokens tokens
    before the model's own forward, and holds the distributions of k draft tokens for as many sequences as
    may speculate through it (the CUDA test below measures the memory itself)."""
    llm = make(tiny_model_dir("llama"), drafts["llama"], 3, batch_limit=5, max_num_batched_tokens=96, max_num_seqs=8)
    runner = llm.engine.runner
    calls: list[tuple[str, int]] = []
    hooks = [
        model.register_forward_hook(lambda _m, args, _out, name=name: calls.append((name, len(args[0]))))
        for name, model in (("draft", runner.draft.model), ("model", runner.model))
    ]
    held = []
    propose = runner.draft.sampler.propose

    def recording(logits, rows):
        held.append(len(rows))
        return propose(logits, rows)

    runner.draft.sampler.propose = recording
    try:
        runner.profile_forward()
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [("draft", 96), ("model", 96)]
    assert held == [5] * 3  # k proposals for batch_limit rows
    q = runner.draft.profile_forward(96, 8)
    assert q.shape == (5 * 3, runner.draft.vocab_size)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "device, backend",
    [("cpu", "auto"), pytest.param("cuda", "triton", marks=CUDA), pytest.param("cuda", "torch", marks=CUDA)],
)
def test_greedy_equals_no_speculation_with_async_steps_and_graphs(device, backend, tiny_model_dir, drafts):
    """As tests/test_spec_decode.py's test of that name, with a draft model: 6 sequences under a limit of 4
    start without drafts, their steps overlapped, and speculate synchronously once fewer are left; on the GPU,
    verify steps (verify graphs with the triton backend) and the draft's forwards (eager catch-up, decode graphs
    with the triton backend) come between the model's decode-graph steps."""
    model_dir = tiny_model_dir("llama")
    prompts = repetitive_prompts(6, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(6)]
    pool = {"cpu_kv_cache_bytes": KV_BYTES} if device == "cpu" else {"num_gpu_blocks_override": 256}
    kwargs = dict(dtype="float32", device=device, attention_backend=backend, async_scheduling=True, **pool)
    want, _ = run(LLM(str(model_dir), **kwargs), prompts, params)
    spec = {"model": str(drafts["llama"]), "num_speculative_tokens": 3, "disable_by_batch_size": 4}
    llm = LLM(str(model_dir), speculative_config=spec, **kwargs)
    llm.engine.speculator.speculate_always()
    got, stats = run(llm, prompts, params)
    assert got == want and stats.num_accepted_tokens > 0
    assert not any(llm.engine.block_manager.ref_counts)


def cuda_greedy_case(model_dir, seed: int):
    """Six repetitive prompts with max_tokens of 10 to 35 (so drafts are cut short near the end and batches
    shrink), the engine kwargs of the CUDA graph tests, and the greedy output without speculation."""
    prompts = repetitive_prompts(6, seed=seed)
    params = [SamplingParams(temperature=0.0, max_tokens=10 + 5 * i, ignore_eos=True) for i in range(6)]
    kwargs = dict(
        dtype="float32", device="cuda", attention_backend="triton", num_gpu_blocks_override=256, max_num_seqs=8
    )
    want, _ = run(LLM(str(model_dir), **kwargs), prompts, params)
    return prompts, params, kwargs, want


@CUDA
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_draft_decode_graphs_equal_eager_and_no_speculation(arch, tiny_model_dir, drafts, monkeypatch):
    """On the GPU the draft model's decode forwards replay CUDA graphs captured at start-up, and no graph is
    captured while serving; greedy output with them equals the eager draft's (--enforce-eager) and no
    speculation's. The target as its own draft has every draft token accepted under the graphs: the replays
    store the draft's K/V where its next forwards read them. Drafts of 3 tokens cut short near max_tokens
    make the later replays run for fewer sequences than the first."""
    model_dir = tiny_model_dir(arch)
    prompts, params, kwargs, want = cuda_greedy_case(model_dir, seed=12)
    captures = []
    begin = torch.cuda.CUDAGraph.capture_begin
    for draft, eager in ((drafts[arch], True), (drafts[arch], False), (model_dir, False)):
        spec = {"model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": 8}
        llm = LLM(str(model_dir), speculative_config=spec, enforce_eager=eager, **kwargs)
        llm.engine.speculator.speculate_always()
        graphs = llm.engine.runner.draft.graphs
        assert (graphs is None) == eager
        monkeypatch.setattr(
            torch.cuda.CUDAGraph, "capture_begin", lambda *a, **kw: captures.append(1) or begin(*a, **kw)
        )
        got, stats = run(llm, prompts, params)
        monkeypatch.undo()
        assert got == want, (draft, eager)
        assert stats.num_accepted_tokens > 0
        if draft == model_dir:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        if not eager:
            assert graphs.replays > 0 and graphs.sizes[-1] == 8
        assert not any(llm.engine.block_manager.ref_counts)
        del llm
    assert captures == []


_NO_COMPILE_DRAFT_SCRIPT = """
import json, sys, torch
from bench.compiles import count_compiles
from engine import LLM, SamplingParams
spec = {"model": sys.argv[2], "num_speculative_tokens": 3, "disable_by_batch_size": 8}
llm = LLM(sys.argv[1], dtype="bfloat16", device="cuda", num_gpu_blocks_override=256, max_model_len=256,
          max_num_batched_tokens=128, max_prefill_graph_tokens=64, enforce_eager=sys.argv[3] == "eager",
          speculative_config=spec)
llm.engine.speculator.speculate_always()
prompts = json.loads(sys.argv[4])
with count_compiles() as compiled:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[:1], SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True, seed=1), use_tqdm=False)
verify = llm.engine.runner.verify_graphs
print(json.dumps({"backend": llm.engine.runner.draft.backend.name, "compiled": dict(compiled),
                  "graphs": llm.engine.runner.draft.graphs is not None,
                  "verify_replays": None if verify is None else verify.replays}))
"""


@CUDA
@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_cuda_no_triton_kernel_compiles_after_start_up_with_a_draft_model(mode, tiny_model_dir, drafts):
    """As tests/test_cuda.py's test of that name, with a draft model: its catch-up forwards (prompts of
    21 to 174 tokens, chunked at 128), its decode steps (graphs, or eager), the model's verify steps (its verify
    graphs, or eager) and the sampled path compile nothing after start-up; eager decode kernels excepted, as
    there. A fresh process."""
    import subprocess
    import sys

    prompts = [p * 6 for p in repetitive_prompts(4, seed=13)] + [repetitive_prompts(1, length=17)[0]]
    root = Path(__file__).resolve().parents[1]
    args = [str(tiny_model_dir("llama")), str(drafts["llama"]), mode, json.dumps(prompts)]
    result = subprocess.run(
        [sys.executable, "-c", _NO_COMPILE_DRAFT_SCRIPT, *args], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    compiled = report["compiled"]
    assert report["backend"] == "triton" and report["graphs"] == (mode == "graphs")
    # With graphs, the model's verify steps replay its verify graphs (compiled at their capture).
    if mode == "graphs":
        assert report["verify_replays"] > 0
    else:
        assert report["verify_replays"] is None
    if mode == "eager":
        compiled = {k: n for k, n in compiled.items() if not k.endswith(("._decode_kernel", "._decode_reduce_kernel"))}
    assert compiled == {}


def wide_draft(out_dir: Path) -> Path:
    """A random Llama of the tiny models' vocabulary whose layers are far wider than theirs: a draft whose
    activations outweigh the model's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.conftest import TINY

    config = LlamaConfig(**{**TINY, "hidden_size": 512, "intermediate_size": 4096, "num_attention_heads": 8})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


@CUDA
def test_cuda_memory_profile_leaves_room_for_the_drafts_activations(tiny_model_dir, tmp_path):
    """The profiling forward that sizes the KV pool peaks at least as high as the draft model's largest
    catch-up forward and proposal (a draft with wider layers than the model, whose activations the model's
    forward alone would under-count), and an engine sized from it (with both models' graphs measured) serves
    greedy output equal to no speculation's."""
    import gc

    gc.collect()  # engines of earlier tests hold GPU memory until collected
    torch.cuda.empty_cache()
    model_dir, draft = tiny_model_dir("llama"), wide_draft(tmp_path / "wide")
    kwargs = dict(dtype="float32", device="cuda", max_model_len=256, max_num_batched_tokens=8192, max_num_seqs=64)
    spec = {"model": str(draft), "num_speculative_tokens": 4, "disable_by_batch_size": 16}
    prompts = repetitive_prompts(4, seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want, _ = run(LLM(str(model_dir), num_gpu_blocks_override=64, **kwargs), prompts, params)
    sized = LLM(str(model_dir), speculative_config=spec, gpu_memory_utilization=0.5, **kwargs)
    sized.engine.speculator.speculate_always()
    assert sized.engine.runner.draft.graphs is not None
    got, stats = run(sized, prompts, params)
    assert got == want and stats.num_draft_tokens > 0
    del sized
    gc.collect()
    torch.cuda.empty_cache()

    runner = LLM(str(model_dir), speculative_config=spec, num_gpu_blocks_override=64, **kwargs).engine.runner

    def peak(fn) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    # After these forwards the runner's caches are unbound: it serves nothing more.
    model_alone = peak(lambda: runner.dummy_forward([128] * 64))
    draft_alone = peak(lambda: runner.draft.profile_forward(8192, 64))
    whole = peak(runner.profile_forward)
    assert draft_alone > 2 * model_alone  # the premise: the draft's activations dominate
    assert whole >= draft_alone


# ----- sampling: the distribution is the target's (chi-square) -----


def rule_samples(broken_draft: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The rule alone, on 8 tokens: 40,000 seeded rows draw a draft token from q (Sampler.propose) and check
    it against p (Sampler with DraftedRows) at T = 0.8, top-p 0.9; the tokens kept, and p as filtered."""
    from engine.sampler import DraftedRows, SamplerRow

    sampler = Sampler(8, frozenset(), torch.device("cpu"))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    n = 40_000
    rows = [SamplerRow(params, seed, [1], [], 5) for seed in range(n)]
    target = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    draft = torch.tensor([0.0, 2.5, 0.5, 1.5, -1.0, 0.0, -2.0, 1.0])  # likes tokens 1 and 3 far more
    tokens, q = sampler.propose(draft.expand(n, 8), rows)
    tokens_list = tokens.tolist()
    if broken_draft:  # a draft model whose logits were NaN
        q.fill_(float("nan"))
    out = sampler(target.expand(n, 8), rows, drafted=DraftedRows(list(range(n)), tokens_list, q)).token_ids
    p = (target / 0.8).softmax(-1).double().numpy()
    order = np.argsort(-p)
    kept = order[: int((np.cumsum(p[order]) - p[order] < 0.9).sum())]
    filtered = np.zeros(8)
    filtered[kept] = p[kept]
    return np.bincount(out.numpy(), minlength=8), filtered / filtered.sum()


def goodness_of_fit(counts: np.ndarray, p: np.ndarray) -> float:
    observed, expected = counts[p > 0], p[p > 0] * counts.sum()
    assert counts[p == 0].sum() == 0  # nothing outside the filtered distribution
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def test_the_rule_draws_from_p_whatever_q(monkeypatch):
    counts, p = rule_samples()
    assert goodness_of_fit(counts, p) > 1e-3
    counts, p = rule_samples(broken_draft=True)  # every draft rejected, the token drawn from p
    assert goodness_of_fit(counts, p) > 1e-3
    monkeypatch.setattr(Sampler, "residual", staticmethod(lambda p, q: p))  # the mutation
    counts, p = rule_samples()
    assert goodness_of_fit(counts, p) < 1e-6


@pytest.fixture(scope="module")
def sharp(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with its head scaled up 4x (else top-p 0.9 keeps hundreds of tokens) as the target, a
    draft unlike it (the same model with its head scaled 12x: it proposes the target's likeliest token nearly
    always, far more often than the target draws it, so drafts are accepted often and rejected often, and a
    wrong rule's bias towards the draft shows), the target's samples
    without speculation, and its exact distribution of the second token after PROMPT + its likeliest first
    token under STAT_PARAMS (the first token is sampled by the prompt step, never speculated; the second is
    the first that a draft can propose)."""
    from transformers import AutoModelForCausalLM

    target = noisy_copy(tiny_model_dir("llama"), tmp_path_factory.mktemp("sharp"), 0.0, scale_head=4.0)
    draft = noisy_copy(tiny_model_dir("llama"), tmp_path_factory.mktemp("sharp-draft"), 0.0, scale_head=12.0)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    first = int(filtered_next_token_probs(model, PROMPT).argmax())
    p = filtered_next_token_probs(model, PROMPT + [first])
    want, _ = continuations(make(target, None, max_num_seqs=512), PROMPT, seed=0)
    return target, draft, first, p, want


def continuations(llm: LLM, prompt: list[int], seed: int):
    """SAMPLES three-token continuations of `prompt`, each under its own seed (seed + i)."""
    params = [SamplingParams(**STAT_PARAMS, seed=seed + i) for i in range(SAMPLES)]
    outs, stats = run(llm, [prompt] * SAMPLES, params)
    return Counter(tuple(o[0]) for o in outs), stats


def fit_p(counts: Counter, first: int, p: np.ndarray) -> float:
    """p-value of the chi-square goodness-of-fit test of the second tokens of the continuations that begin
    with `first` against their exact distribution p (tokens expected fewer than 10 times are pooled)."""
    second = Counter()
    for tokens, n in counts.items():
        if tokens[0] == first:
            second[tokens[1]] += n
    total = sum(second.values())
    big = [t for t in np.flatnonzero(p) if p[t] * total >= 10]
    observed = [second[t] for t in big] + [total - sum(second[t] for t in big)]
    expected = [p[t] * total for t in big] + [total * (1 - p[big].sum())]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    dof = len(big) - (expected[-1] <= 0)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


PROMPT = [11, 42, 7, 300, 12, 99, 5]


def sampled_with_draft(sharp):
    target, draft = sharp[:2]
    # Seeds unlike the plain run's: the two samples must be independent for the chi-square test.
    return continuations(make(target, draft, 3, batch_limit=512, max_num_seqs=512), PROMPT, seed=SAMPLES)


def test_sampled_continuations_have_the_targets_distribution(sharp):
    _, _, first, p, want = sharp
    got, stats = sampled_with_draft(sharp)
    assert stats.num_drafts >= SAMPLES // 2
    assert 0.1 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.9
    assert fit_p(want, first, p) > 1e-3  # the check itself: the target's own samples fit
    assert fit_p(got, first, p) > 1e-3
    assert chi_square_p(want, got) > 1e-3  # whole continuations


def test_the_check_rejects_a_wrong_acceptance_rule(sharp, monkeypatch):
    """The same check with the rule mutated (on a rejection, resample from p itself instead of
    norm(max(0, p - q)), which over-weights the tokens the draft likes) must fail."""
    _, _, first, p, want = sharp
    monkeypatch.setattr(Sampler, "residual", staticmethod(lambda p, q: p))
    got, stats = sampled_with_draft(sharp)
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert fit_p(got, first, p) < 1e-3


# ----- bad drafts; the default model -----


def with_tokenizer(model_dir, tokenizer_dir, out_dir):
    """A copy of `model_dir` with the tokenizer files of `tokenizer_dir`."""
    model_dir, tokenizer_dir, out_dir = Path(model_dir), Path(tokenizer_dir), Path(out_dir)
    if out_dir != model_dir:
        shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="module")
def smol_vocab_llama(default_model_dir, tmp_path_factory):
    """A random-weight Llama with SmolLM2's vocabulary and tokenizer, with more layers and heads than the tiny
    ones (a target the default model can draft for)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("smol-vocab-llama")
    model.save_pretrained(out, safe_serialization=True)
    return with_tokenizer(out, default_model_dir, out)


def test_the_default_model_drafts_for_a_random_llama_of_its_vocabulary(smol_vocab_llama, default_model_dir):
    prompts = [REPEAT]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want, _ = run(make(smol_vocab_llama, None, max_model_len=512), prompts, params)
    got, stats = run(make(smol_vocab_llama, default_model_dir, 3, max_model_len=512), prompts, params)
    assert got == want and stats.num_drafts > 0


@pytest.mark.slow  # 18 s on the CPU; the tiny models drafting for themselves check the same in the default tier
def test_the_default_model_drafting_for_itself_is_always_accepted_in_greedy(default_model_dir):
    prompts = [REPEAT, "Write a haiku about autumn."]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want, _ = run(make(default_model_dir, None, max_model_len=512), prompts, params)
    got, stats = run(make(default_model_dir, default_model_dir, 4, max_model_len=512), prompts, params)
    assert got == want
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens


def test_a_draft_as_costly_as_the_model_never_runs_and_steps_stay_pipelined(tiny_model_dir, caplog):
    """The model drafting for itself (c >= 1: no draft length can pay): speculation is off for good. Under async
    scheduling every step is pipelined as without speculation (after each step() the next one is already in
    flight exactly as often), the draft model runs no forward at all, and the greedy output is the model's."""
    model_dir = tiny_model_dir("llama")
    prompts = repetitive_prompts(4, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def pipelining(llm: LLM) -> tuple[list[list[int]], list[bool]]:
        engine = llm.engine
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        final, in_flight = {}, []
        while engine.has_unfinished_requests():
            final |= {out.request_id: out for out in engine.step() if out.finished}
            in_flight.append(engine.in_flight is not None)
        return [list(final[f"r{i}"].outputs[0].token_ids) for i in range(len(prompts))], in_flight

    kwargs = dict(dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES, async_scheduling=True)
    want, plain_in_flight = pipelining(LLM(str(model_dir), **kwargs))
    with caplog.at_level("INFO", logger="pagoda.engine"):
        spec = {"model": str(model_dir), "num_speculative_tokens": 4}
        llm = LLM(str(model_dir), speculative_config=spec, **kwargs)
    assert "speculative decoding is off" in caplog.text
    forwards = []
    llm.engine.runner.draft.model.register_forward_hook(lambda *args: forwards.append(1))
    got, spec_in_flight = pipelining(llm)
    assert got == want
    assert spec_in_flight == plain_in_flight and sum(spec_in_flight) > 10
    assert not forwards
    assert llm.engine.last_step.num_drafts == 0 and not llm.engine.speculator.speculates(llm.engine.scheduler.running)


def test_bad_drafts_are_refused_in_one_line(tiny_model_dir, default_model_dir, smol_vocab_llama, tmp_path):
    # Another vocabulary size: the tiny Llama (512 tokens) for the default model (49,152).
    with pytest.raises(ValueError) as info:
        make(default_model_dir, tiny_model_dir("llama"), 3)
    message = str(info.value)
    assert "vocab_size 512" in message and "49152" in message and "\n" not in message
    # The same size, another tokenizer: two tokens' ids swapped.
    other = with_tokenizer(smol_vocab_llama, default_model_dir, tmp_path / "other")
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (next(w for w, i in vocab.items() if i == n) for n in (1000, 1001))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        make(default_model_dir, other, 3)
    assert "another tokenizer" in str(info.value) and "\n" not in str(info.value)
    # Not a model directory.
    with pytest.raises(Exception) as info:
        make(default_model_dir, tmp_path / "missing", 3)
    assert "missing" in str(info.value) and "\n" not in str(info.value).strip()


def test_server_speculates_with_a_draft_model_through_the_openai_sdk(tmp_path, default_server, smol_vocab_llama):
    """The default model served with a small random-weight draft of its vocabulary (about 5% of its
    parameters, so the cost model lets it draft until its drafts keep failing): greedy text equal to the
    plain server's, sampled requests served, the speculation counters exported."""
    from tests.test_server import MODEL, SERVER_FLAGS, scrape, start_server

    spec = json.dumps({"model": str(smol_vocab_llama), "num_speculative_tokens": 3})
    server = start_server(tmp_path, *SERVER_FLAGS, "--speculative-config", spec)
    try:
        texts = []
        for url in (server.url, default_server.url):
            stream = client_for(url).completions.create(
                model=MODEL, prompt=REPEAT, max_tokens=24, temperature=0.0, stream=True
            )
            texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
        assert texts[0] == texts[1]
        # Sampled requests are served too (their tokens checked against the draft's q).
        out = client_for(server.url).completions.create(
            model=MODEL, prompt=REPEAT, max_tokens=16, temperature=0.8, seed=3
        )
        assert out.usage.completion_tokens > 0 and out.choices[0].finish_reason in ("length", "stop")
        metrics = scrape(server.url)
        drafts = metrics[("pagoda:spec_decode_num_drafts_total", ())]
        assert drafts > 0
        accepted = metrics[("pagoda:spec_decode_num_accepted_tokens_total", ())]
        assert accepted <= metrics[("pagoda:spec_decode_num_draft_tokens_total", ())]
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def client_for(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
