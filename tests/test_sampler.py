"""The sampler: exact distributions (chi-square), logit processing, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

import engine.sampler as sampler_module
from engine.sampler import Sampler, SamplerRow, uniforms
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 9


def make_row(
    params: SamplingParams, seed: int = 0, prompt: list[int] | None = None, output: list[int] | None = None
) -> SamplerRow:
    return SamplerRow(params, seed, prompt if prompt is not None else [0], output if output is not None else [])


# ----- exact distributions -----

# Small vocabulary, distinct logits (no ties), spread enough that every filter cuts somewhere.
SMALL_LOGITS = torch.tensor([2.1, 1.7, 1.2, 0.9, 0.6, 0.2, -0.1, -0.5, -0.8, -1.3, -1.9, -2.6])
DRAWS = 20_000


def expected_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    """The target distribution straight from the definitions, in float64 numpy."""
    z = logits.double().numpy() / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_k > 0:
        p[np.argsort(-p)[top_k:]] = 0.0
        p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p)
        mass = 0.0
        for i, v in enumerate(order):
            mass += p[v]
            if mass >= top_p:
                p[order[i + 1 :]] = 0.0
                break
        p /= p.sum()
    if min_p > 0.0:
        p[p < min_p * p.max()] = 0.0
        p /= p.sum()
    return p


def draw_counts(params: SamplingParams, logits: torch.Tensor = SMALL_LOGITS, n: int = DRAWS) -> np.ndarray:
    """One big batch of the same logits, seed i on row i: n independent draws."""
    sampler = Sampler(len(logits), frozenset({EOS}), CPU)
    rows = [make_row(params, seed=i) for i in range(n)]
    tokens = sampler(logits.expand(n, -1), rows).token_ids
    return np.bincount(tokens.numpy(), minlength=len(logits))


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of `counts` under `probs`; a token drawn outside the support fails outright."""
    support = probs > 0
    if counts[~support].any():
        return 0.0
    return stats.chisquare(counts[support], probs[support] * counts.sum()).pvalue


FILTERS = {
    "temperature 0.7": dict(temperature=0.7),
    "temperature 1.5": dict(temperature=1.5),
    "top_k": dict(top_k=4),
    "top_p": dict(top_p=0.7),
    "min_p": dict(min_p=0.12),
    # Pairs chosen so that the other order (top-p before temperature, or top-p ignoring top-k) keeps a
    # different number of tokens: these catch an order mistake.
    "temperature then top_p": dict(temperature=0.6, top_p=0.8),
    "top_k then top_p": dict(top_k=4, top_p=0.85),
    "temperature then min_p": dict(temperature=2.0, min_p=0.25),
    "all": dict(temperature=0.8, top_k=7, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("knobs", FILTERS.values(), ids=FILTERS.keys())
def test_sampled_distribution_matches_definition(knobs):
    probs = expected_probs(SMALL_LOGITS, **knobs)
    counts = draw_counts(SamplingParams(**knobs))
    assert chi_square_p(counts, probs) > 1e-3


def test_filter_cuts_are_not_on_a_rounding_edge():
    # The chi-square tests above mean something only if no cut is within rounding of a token.
    for knobs in FILTERS.values():
        before_top_p = expected_probs(SMALL_LOGITS, knobs.get("temperature", 1.0), knobs.get("top_k", 0))
        if "top_p" in knobs:
            assert np.abs(np.cumsum(np.sort(before_top_p)[::-1]) - knobs["top_p"]).min() > 1e-3
        if "min_p" in knobs:
            assert np.abs(before_top_p / before_top_p.max() - knobs["min_p"]).min() > 1e-3


def test_chi_square_rejects_a_wrong_distribution():
    """The goodness-of-fit check has power: near-miss distributions are rejected."""
    counts = draw_counts(SamplingParams(temperature=0.7))
    assert chi_square_p(counts, expected_probs(SMALL_LOGITS, temperature=0.7)) > 1e-3
    assert chi_square_p(counts, expected_probs(SMALL_LOGITS, temperature=0.8)) < 1e-6
    counts = draw_counts(SamplingParams(top_p=0.7))
    # One more or one fewer token in the nucleus.
    assert chi_square_p(counts, expected_probs(SMALL_LOGITS, top_p=0.8)) < 1e-6
    assert chi_square_p(counts, expected_probs(SMALL_LOGITS, top_p=0.55)) < 1e-6


def test_one_sequence_over_many_steps_follows_the_distribution():
    # Same seed, the step varying: the draws of one stream over time are i.i.d. too.
    n = 3000
    history = [1] * n
    sampler = Sampler(len(SMALL_LOGITS), frozenset({EOS}), CPU)
    params = SamplingParams(temperature=1.2, top_k=8)
    rows = [make_row(params, seed=1234, output=history[:s]) for s in range(n)]
    tokens = sampler(SMALL_LOGITS.expand(n, -1), rows).token_ids
    counts = np.bincount(tokens.numpy(), minlength=len(SMALL_LOGITS))
    assert chi_square_p(counts, expected_probs(SMALL_LOGITS, temperature=1.2, top_k=8)) > 1e-3


def test_filters_keep_at_least_one_token_and_keep_ties():
    assert set(draw_counts(SamplingParams(top_p=0.01), n=500).nonzero()[0]) == {0}
    assert set(draw_counts(SamplingParams(min_p=1.0), n=500).nonzero()[0]) == {0}
    # top_k = 2 with the 2nd and 3rd logits tied keeps both: which one a sort puts first must not matter.
    tied = torch.tensor([2.0, 1.0, 1.0, 0.0])
    assert set(draw_counts(SamplingParams(top_k=2), tied, n=2000).nonzero()[0]) == {0, 1, 2}


# ----- the noise -----

MASK64 = (1 << 64) - 1


def reference_mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def reference_uniform(seed: int, step: int, token: int) -> float:
    """Two-level SplitMix64 on Python's unbounded ints, masked to 64 bits by hand."""
    gamma = 0x9E3779B97F4A7C15
    key = reference_mix64((seed + gamma) & MASK64)
    key = reference_mix64((key + (step + 1) * gamma) & MASK64)
    z = reference_mix64((key + (token + 1) * gamma) & MASK64)
    return ((z >> 12) + 0.5) * 2.0**-52


def test_uniforms_match_a_uint64_reference():
    # The torch version runs on int64 (wrapping multiplies, arithmetic shifts); it must agree bit for bit.
    seeds = [0, 1, 12345, 2**62 + 7, -1, -(2**63)]
    steps = [0, 1, 7, 1000, 3, 2**20]
    u = uniforms(torch.tensor(seeds), torch.tensor(steps), 50)
    for r, (seed, step) in enumerate(zip(seeds, steps)):
        for v in (0, 1, 17, 49):
            assert u[r, v].item() == reference_uniform(seed & MASK64, step, v)


def grid_uniforms(num_seeds: int, num_steps: int, vocab: int) -> torch.Tensor:
    """[num_seeds, num_steps, vocab] uniforms for seeds 0.., steps 0.., tokens 0.."""
    seeds = torch.arange(num_seeds).repeat_interleave(num_steps)
    steps = torch.arange(num_steps).repeat(num_seeds)
    return uniforms(seeds, steps, vocab).reshape(num_seeds, num_steps, vocab)


def pair_independence_p(a: torch.Tensor, b: torch.Tensor, bins: int = 16) -> float:
    """Chi-square p-value that (a, b) is uniform on the unit square, i.e. a, b independent uniforms."""
    cells = (a * bins).long() * bins + (b * bins).long()
    counts = np.bincount(cells.flatten().numpy(), minlength=bins * bins)
    return stats.chisquare(counts).pvalue


def test_uniforms_are_uniform_and_independent():
    u = grid_uniforms(100, 40, 250)  # 1M values, consecutive small seeds, steps and tokens
    assert 0.0 < u.min() and u.max() < 1.0
    assert stats.kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    # Neighbouring tokens, steps and seeds (seed + i is how the engine seeds the children of n > 1).
    assert pair_independence_p(u[:, :, :-1], u[:, :, 1:]) > 1e-3
    assert pair_independence_p(u[:, :-1, :], u[:, 1:, :]) > 1e-3
    assert pair_independence_p(u[:-1], u[1:]) > 1e-3
    # (step s + 1, token v) vs (step s, token v + 1): a scheme that merely added step and token
    # offsets to one counter would make these equal.
    assert pair_independence_p(u[:, 1:, :-1], u[:, :-1, 1:]) > 1e-3
    # Every one of the 52 bits is a fair coin.
    bits = (u * 2.0**52 - 0.5).long()[:20, :20].flatten()
    ones = torch.stack([(bits >> i) & 1 for i in range(52)]).double().mean(dim=1)
    assert (ones - 0.5).abs().max() < 4 * 0.5 / math.sqrt(bits.numel())


def test_independence_check_has_power():
    u = grid_uniforms(20, 20, 500)
    assert pair_independence_p(u, u) < 1e-6
    assert pair_independence_p(u, (u + 0.01) % 1.0) < 1e-6


# ----- greedy and logit processing -----


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(64, 1000)
    sampler = Sampler(1000, frozenset({EOS}), CPU)
    out = sampler(logits, [make_row(SamplingParams(temperature=0.0), seed=i) for i in range(64)])
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(1)
    logits = torch.randn(8, 300)
    sampler = Sampler(300, frozenset({EOS}), CPU)
    params = [SamplingParams(temperature=0.0 if i % 2 else 5.0, top_p=0.95) for i in range(8)]
    out = sampler(logits, [make_row(p, seed=i) for i, p in enumerate(params)])
    assert torch.equal(out.token_ids[1::2], logits[1::2].argmax(dim=-1))
    # At temperature 5 over 300 tokens, four argmax draws in a row would be a (deterministic) miracle.
    assert not torch.equal(out.token_ids[0::2], logits[0::2].argmax(dim=-1))


def processed(
    params: SamplingParams,
    logits: torch.Tensor,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    vocab: int | None = None,
) -> torch.Tensor:
    sampler = Sampler(vocab or logits.shape[-1], frozenset({EOS}), CPU)
    return sampler.process_logits(logits[None], [make_row(params, prompt=prompt, output=output)])[0]


def test_logit_bias_adds_exactly_where_asked():
    logits = torch.linspace(-1, 1, 12)
    out = processed(SamplingParams(logit_bias={3: 5.0, 7: -100.0, 12: 1.0, 500: 2.0}), logits)
    expected = logits.clone()
    expected[3] += 5.0
    expected[7] -= 100.0  # ids 12 and 500 are outside the vocabulary: ignored, not an error
    assert torch.equal(out, expected)
    sampler = Sampler(12, frozenset({EOS}), CPU)
    row = make_row(SamplingParams(temperature=0.0, logit_bias={3: 5.0}))
    assert sampler(logits[None], [row]).token_ids.item() == 3


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0, 0.0, 1.5])
    # Token 0 in the prompt, 1 and 4 in the output, 0 seen twice (counted once).
    out = processed(SamplingParams(repetition_penalty=2.0), logits, prompt=[0, 3], output=[1, 0, 4])
    assert torch.equal(out, torch.tensor([1.0, -4.0, 3.0, -2.0, 0.0, 1.5]))
    # A penalty below 1 rewards repeats, with the same sign handling.
    out = processed(SamplingParams(repetition_penalty=0.5), logits, prompt=[0], output=[1])
    assert torch.equal(out, torch.tensor([4.0, -1.0, 3.0, -1.0, 0.0, 1.5]))


def test_presence_counts_once_frequency_counts_every_time_output_only():
    logits = torch.zeros(8)
    prompt, output = [7, 7, 2], [3, 3, 3, 5, 2]
    out = processed(SamplingParams(presence_penalty=0.5), logits, prompt, output)
    assert torch.equal(out, torch.tensor([0, 0, -0.5, -0.5, 0, -0.5, 0, 0]))
    out = processed(SamplingParams(frequency_penalty=0.25), logits, prompt, output)
    assert torch.equal(out, torch.tensor([0, 0, -0.25, -0.75, 0, -0.25, 0, 0]))
    out = processed(SamplingParams(presence_penalty=-1.0, frequency_penalty=0.5), logits, prompt, output)
    # -(presence + frequency * count): token 2 (once) +0.5, token 3 (three times) -0.5.
    assert torch.equal(out, torch.tensor([0, 0, 0.5, -0.5, 0, 0.5, 0, 0]))


def test_processing_order_bias_then_repetition_then_frequency():
    # 1.0 + bias 1.0 = 2.0; / repetition 2.0 = 1.0; - frequency 0.5 * 2 = 0.0. Any other order differs.
    logits = torch.ones(4)
    params = SamplingParams(logit_bias={1: 1.0}, repetition_penalty=2.0, frequency_penalty=0.5)
    assert processed(params, logits, prompt=[0], output=[1, 1])[1].item() == 0.0


def test_greedy_choice_follows_penalties():
    # Token 0 leads raw, but it repeats: only a correct repetition penalty hands the win to token 1.
    logits = torch.tensor([[3.0, 2.0, -5.0, -5.0]])
    sampler = Sampler(4, frozenset({EOS}), CPU)
    row = make_row(SamplingParams(temperature=0.0, repetition_penalty=1.6), output=[0])
    assert sampler(logits, [row]).token_ids.item() == 1
    row = make_row(SamplingParams(temperature=0.0, repetition_penalty=1.4), output=[0])
    assert sampler(logits, [row]).token_ids.item() == 0


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = torch.zeros(12)
    params = SamplingParams(min_tokens=3, stop_token_ids=[4, 40])
    banned = processed(params, logits, output=[1, 1])
    assert torch.isinf(banned[[4, EOS]]).all() and (banned[[4, EOS]] < 0).all()
    assert torch.isfinite(banned[[i for i in range(12) if i not in (4, EOS)]]).all()
    assert torch.equal(processed(params, logits, output=[1, 1, 1]), logits)
    ignoring = processed(SamplingParams(min_tokens=3, stop_token_ids=[4], ignore_eos=True), logits, output=[])
    assert ignoring[EOS] == 0.0 and ignoring[4] == float("-inf")
    # Greedy with eos the favourite picks the runner-up until min_tokens is reached, then eos.
    favour_eos = torch.zeros(1, 12)
    favour_eos[0, EOS], favour_eos[0, EOS + 1] = 5.0, 4.0
    sampler = Sampler(12, frozenset({EOS}), CPU)
    greedy = SamplingParams(temperature=0.0, min_tokens=2)
    picks = [sampler(favour_eos, [make_row(greedy, output=[0] * s)]).token_ids.item() for s in range(3)]
    assert picks == [EOS + 1, EOS + 1, EOS]


def test_process_logits_leaves_its_input_alone():
    logits = torch.zeros(1, 12)
    Sampler(12, frozenset({EOS}), CPU)(logits, [make_row(SamplingParams(logit_bias={1: 3.0}, top_p=0.5))])
    assert not logits.any()


# ----- seeded reproducibility -----

VOCAB = 1000
TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(7)) * 3


def run_streams(
    rows: list[tuple[SamplingParams, int]], steps: int = 40, sampler_vocab: int = VOCAB, device: torch.device = CPU
) -> list[list[int]]:
    """Autoregressive loop on a fake model whose next logits are a row of TABLE picked by the last token."""
    sampler = Sampler(sampler_vocab, frozenset({EOS}), device)
    # One prompt for all, so streams differ only through their seeds.
    prompts = [[1] for _ in rows]
    outputs: list[list[int]] = [[] for _ in rows]
    table = TABLE.to(device)
    for _ in range(steps):
        last = torch.tensor([(out or prompt)[-1] for prompt, out in zip(prompts, outputs)], device=device)
        batch = [SamplerRow(p, seed, prompt, out) for (p, seed), prompt, out in zip(rows, prompts, outputs)]
        tokens = sampler(table[last], batch).token_ids.tolist()
        for out, t in zip(outputs, tokens):
            out.append(t)
    return outputs


TARGET = (SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=42), 42)
OTHERS = [
    (SamplingParams(temperature=0.0, repetition_penalty=1.2), 1),
    (SamplingParams(temperature=1.3, presence_penalty=0.5, frequency_penalty=0.3), 2),
    (SamplingParams(temperature=0.7, min_p=0.1, logit_bias={5: 3.0}), 3),
    (SamplingParams(temperature=1.0), 4),
    (SamplingParams(temperature=0.5, top_k=5), 5),
]


def test_seeded_stream_is_independent_of_batch_and_position():
    alone = run_streams([TARGET])[0]
    first = run_streams([TARGET] + OTHERS)[0]
    middle = run_streams(OTHERS[:3] + [TARGET] + OTHERS[3:])[3]
    twice = run_streams([OTHERS[1], TARGET, TARGET])
    assert alone == first == middle == twice[1] == twice[2]
    assert len(set(alone)) > 10  # a real stream, not a fixed point


def test_sampling_in_slices_draws_the_same_tokens(monkeypatch):
    # A big batch is filtered and raced a few rows at a time to bound memory; the tokens must not change.
    rows = [TARGET] + OTHERS + [(SamplingParams(temperature=1.1, top_p=0.9), s) for s in range(10, 20)]
    whole = run_streams(rows, steps=10)
    monkeypatch.setattr(sampler_module, "_SAMPLE_SLICE", 3 * VOCAB)
    assert run_streams(rows, steps=10) == whole


def test_different_seeds_give_different_streams():
    params = TARGET[0]
    streams = run_streams([(params, seed) for seed in (0, 1, 2, 43)] + [TARGET])
    assert len({tuple(s) for s in streams}) == len(streams)


def test_unseeded_requests_sample_with_any_drawn_seed():
    # The engine draws a seed for unseeded requests: any Python int must work, beyond int64 too.
    params = SamplingParams(temperature=1.0)
    seeds = [2**64 + 5, -(2**70) + 3, 2**63, -1, 0]
    streams = run_streams([(params, s) for s in seeds], steps=10)
    assert all(0 <= t < VOCAB for s in streams for t in s)
    assert len({tuple(s) for s in streams}) == len(streams)
    # A seed is taken mod 2^64, so 2^64 + 5 and 5 are the same stream.
    assert run_streams([(params, 5)], steps=10)[0] == streams[0]


# ----- logprobs -----


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(3)
    logits = torch.randn(4, 50, dtype=torch.bfloat16)
    sampler = Sampler(50, frozenset({EOS}), CPU)
    rows = [
        make_row(SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5, logit_bias={2: 9.0}), output=[2]),
        make_row(SamplingParams(temperature=0.0, logprobs=7)),
        make_row(SamplingParams(top_p=0.5)),
        make_row(SamplingParams(temperature=2.0, logprobs=0, presence_penalty=2.0), output=[1]),
    ]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (4, 7) and out.top_ids.dtype == torch.int64
    assert torch.equal(out.top_logprobs, raw.gather(1, out.top_ids))
    assert torch.equal(out.top_logprobs, raw.sort(dim=-1, descending=True).values[:, :7])
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


def test_logprobs_absent_unless_asked():
    sampler = Sampler(10, frozenset({EOS}), CPU)
    logits = torch.randn(2, 10)
    out = sampler(logits, [make_row(SamplingParams()), make_row(SamplingParams(temperature=0.0))])
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    out = sampler(logits, [make_row(SamplingParams()), make_row(SamplingParams(logprobs=0))])
    assert out.logprobs is not None and out.top_ids is None and out.top_logprobs is None


def test_padded_logit_columns_are_never_sampled():
    # A model whose lm_head is padded past the vocabulary: the extra columns are not tokens.
    logits = torch.zeros(200, 16)
    logits[:, 12:] = 50.0
    sampler = Sampler(12, frozenset({EOS}), CPU)
    out = sampler(logits, [make_row(SamplingParams(logprobs=2), seed=i) for i in range(200)])
    assert out.token_ids.max() < 12
    assert torch.allclose(out.logprobs, torch.full((200,), -math.log(12)))


# ----- CUDA -----


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    rows = [TARGET] + OTHERS + [(SamplingParams(temperature=1.1, top_p=0.8, min_p=0.02), s) for s in range(10, 20)]
    assert run_streams(rows, steps=30) == run_streams(rows, steps=30, device=torch.device("cuda"))
