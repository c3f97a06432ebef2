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
    chi_square_p,
    filtered_next_token_probs,
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
        llm.engine.speculator.cost_ratio = 0.0  # always the full k: the most drafts to verify
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
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)


def test_seeded_sampling_is_reproducible(tiny_model_dir, drafts):
    llm = make(tiny_model_dir("qwen3"), drafts["qwen3"], 3)
    prompts = repetitive_prompts(4, seed=6)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=11, ignore_eos=True)
    first, stats = run(llm, prompts, params)
    second, _ = run(llm, prompts, params)
    assert first == second and 0 < stats.num_accepted_tokens < stats.num_draft_tokens


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "device, backend",
    [("cpu", "auto"), pytest.param("cuda", "triton", marks=CUDA), pytest.param("cuda", "torch", marks=CUDA)],
)
def test_greedy_equals_no_speculation_with_async_steps_and_graphs(device, backend, tiny_model_dir, drafts):
    """As tests/test_spec_decode.py's test of that name, with a draft model: 6 sequences under a limit of 4
    start without drafts, their steps overlapped, and speculate synchronously once fewer are left; on the GPU,
    verify steps and the draft's eager forwards come between decode-graph steps."""
    model_dir = tiny_model_dir("llama")
    prompts = repetitive_prompts(6, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(6)]
    pool = {"cpu_kv_cache_bytes": KV_BYTES} if device == "cpu" else {"num_gpu_blocks_override": 256}
    kwargs = dict(dtype="float32", device=device, attention_backend=backend, async_scheduling=True, **pool)
    want, _ = run(LLM(str(model_dir), **kwargs), prompts, params)
    spec = {"model": str(drafts["llama"]), "num_speculative_tokens": 3, "disable_by_batch_size": 4}
    llm = LLM(str(model_dir), speculative_config=spec, **kwargs)
    llm.engine.speculator.cost_ratio = 0.0
    got, stats = run(llm, prompts, params)
    assert got == want and stats.num_accepted_tokens > 0
    assert not any(llm.engine.block_manager.ref_counts)


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
