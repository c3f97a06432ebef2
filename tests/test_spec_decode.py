"""Speculative decoding (engine/spec_decode/): the config, the n-gram proposer, and the engine with n-gram
drafts, whose output must be the target model's own: token for token under greedy, in distribution under
sampling (chi-square), with no KV block leaked and nothing unverified in the prefix cache. A draft model's
drafts: tests/test_spec_draft.py."""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter

import numpy as np
import pytest
import torch

from bench import latency
from engine.config import EngineConfig, SpeculativeConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine, StepStats
from engine.sampling_params import SamplingParams
from engine.sequence import Request, Sequence
from engine.spec_decode import accepted_lengths
from engine.spec_decode.ngram import NgramProposer, ngram_draft
from engine.spec_decode.speculator import best_num_tokens
from tests.conftest import KV_BYTES
from tests.test_structured import random_model_dir  # noqa: F401 (a fixture, for the test that asks for it)

NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ----- config -----


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 3}, "unknown method 'medusa'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min (4) must not exceed prompt_lookup_max (2)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
        ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "unknown key(s) lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs the draft "model"'),
        ({"num_speculative_tokens": 3}, 'needs a "method"'),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_configs_fail_with_one_line(value, message):
    with pytest.raises(ValueError) as info:
        EngineConfig(device="cpu", speculative_config=value)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_draft_model_config_is_parsed():
    config = SpeculativeConfig.parse({"model": "/models/draft", "num_speculative_tokens": 4})
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/models/draft", 4)
    flag = json.dumps({"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4})
    assert EngineConfig(device="cpu", speculative_config=flag).speculative_config == config


def test_ngram_config_defaults_follow_vllm():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    only_max = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)


def test_cli_flag_takes_json_and_refuses_bad_ones_in_one_line(capsys):
    from server.cli import _engine_config, build_parser

    parser = build_parser()
    flag = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    args = parser.parse_args(["serve", "--speculative-config", flag])
    config = _engine_config(args, None)
    assert config.speculative_config == SpeculativeConfig("ngram", 3, 4, 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--speculative-config" in err and "unknown method 'eagle'" in err


# ----- the proposer and the rule -----


def test_ngram_drafts_take_the_longest_then_latest_match():
    seqs = [
        [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 2, 3],  # "2 3" twice, "1 2 3"... the suffix is "5 2 3"
        [4, 5, 6, 7, 4, 5, 6, 8, 1, 5, 6],  # "5 6" at 1 and 5: the latest (5) is followed by 8
        [1, 2, 3, 4],  # no earlier match
        [7, 7, 7, 7, 7],  # the latest "7 7 7" ends at 4: one token follows it
        [3],
    ]
    drafts = [ngram_draft(seq, k, 2, 3) for seq, k in zip(seqs, [3, 2, 3, 3, 3])]
    assert drafts == [[7, 6, 5], [8, 1], [], [7], []]
    # min_n = 1 finds the single-token match "4"? None: 4 occurs once. k caps the length.
    assert ngram_draft([5, 1, 2, 5], 1, 1, 3) == [1]
    assert ngram_draft([5, 1, 2, 5], 3, 2, 3) == []
    # The int32 bytes of 65536, 256, 0 hold those of the suffix "256 1" one byte in (00 01 00 | 00 01 00 00 | 00):
    # a match straddling tokens is none; the search goes on to the real one before it.
    assert ngram_draft([256, 1, 4, 65536, 256, 0, 256, 1], 2, 2, 2) == [4, 65536]
    assert ngram_draft([65536, 256, 0, 256, 1], 2, 2, 2) == []


def _reference_draft(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule spelled out: over every earlier end e (before the last token), the match length is how many
    tokens before e equal those before the end (at most max_n); the longest of at least min_n, then the latest."""
    best = None
    for e in range(1, len(tokens)):
        n = 0
        while n < max_n and e - 1 - n >= 0 and tokens[e - 1 - n] == tokens[-1 - n]:
            n += 1
        if n >= min_n and (best is None or n >= best[0]):
            best = (n, e)
    return [] if best is None else tokens[best[1] : best[1] + k]


def test_ngram_proposer_matches_the_rule_as_sequences_grow():
    """The proposer's kept buffers, extended step by step, give what the rule gives on the whole sequence, on
    random sequences over few token ids (many matches, overlapping ones) including ids whose bytes can straddle."""
    rng = np.random.default_rng(0)
    values = np.array([1, 2, 3, 256, 65536, 65537, 0])
    proposer = NgramProposer(2, 4)
    seqs = []
    for i in range(6):
        tokens = rng.choice(values, 5).tolist()
        seqs.append(Sequence(i, Request(f"r{i}", None, tokens, SamplingParams()), 0, 0, list(tokens)))
    for _ in range(60):
        k = rng.integers(1, 6, len(seqs)).tolist()
        got = proposer.propose(seqs, k)
        for seq, n in zip(seqs, k):
            want = _reference_draft(seq.token_ids, n, 2, 4)
            assert got.get(seq.seq_id, []) == want == ngram_draft(seq.token_ids, n, 2, 4)
        for seq in seqs:  # a few more tokens each, like accepted drafts
            seq.token_ids += rng.choice(values, int(rng.integers(1, 4))).tolist()
    proposer.retain({0, 1})
    assert set(proposer._buffers) == {0, 1}


def test_accepted_lengths_is_the_matching_prefix():
    drafts = [[5, 6, 7], [], [1, 2], [9]]
    sampled = [5, 6, 0, 4] + [3] + [1, 2, 8] + [2, 9]
    assert accepted_lengths(drafts, sampled) == [2, 0, 2, 0]


def test_cost_model_drafts_more_when_acceptance_is_high():
    k = best_num_tokens(np.array([0.0, 0.2, 0.6, 0.95]), 5, 0.1)
    assert k[0] == 0 and k[1] <= 1 and 1 <= k[2] < 5 and k[3] == 5


def test_speculation_turns_off_for_a_low_acceptance_sequence_and_probes_again():
    """The cost model: a sequence whose drafts keep failing stops drafting (k' = 0), and drafts one token
    again after 16 steps without; another, whose drafts hold, keeps the full k."""
    from engine.spec_decode.speculator import _PROBE_EVERY, Speculator

    config = SpeculativeConfig.parse({**NGRAM, "num_speculative_tokens": 4})
    speculator = Speculator(config, max_model_len=1024)
    speculator.adaptive = False  # every step speculates: the per-sequence choice alone
    seqs = decoding_sequences(2)
    failing, holding = seqs
    first = speculator.drafts(seqs)
    assert first[0] == first[1] == [5, 6]  # the prior (a = 0.5) with c = 0.15: k' = 2
    for _ in range(5):
        speculator.observe(failing, 2, 0)  # rejected at their first token
        speculator.observe(holding, 2, 2)  # accepted whole
    drafts = [speculator.drafts(seqs) for _ in range(_PROBE_EVERY)]
    assert all(d[1] == [5, 6, 7, 8] for d in drafts)
    assert [d.get(0) for d in drafts[:-1]] == [None] * (_PROBE_EVERY - 1) and drafts[-1][0] == [5]


def decoding_sequences(count: int) -> list:
    """`count` running sequences of a repetitive prompt, each decoding (its last token is the one to compute)."""
    from engine.sequence import Request, Sequence, SequenceStatus

    seqs = []
    for seq_id in range(count):
        tokens = [5, 6, 7, 8, 9, 10, 11] * 3
        request = Request(f"r{seq_id}", None, tokens, SamplingParams(max_tokens=100))
        seq = Sequence(seq_id, request, 0, 0, list(tokens), status=SequenceStatus.RUNNING)
        seq.num_computed_tokens = len(tokens) - 1
        seqs.append(seq)
    return seqs


def timed_speculator(decode_s: float | None, spec_s: float | None, num_seqs: int = 2, drafted: int = 4):
    """A real Speculator (n-gram, k = 4) whose engine measured these periods of a decode step and of a
    speculative step of `drafted` tokens over `num_seqs` sequences (None: not measured)."""
    from engine.spec_decode.speculator import _MIN_MEASURED, Speculator

    speculator = Speculator(SpeculativeConfig.parse({**NGRAM, "num_speculative_tokens": 4}), max_model_len=1024)
    for _ in range(_MIN_MEASURED):
        if decode_s is not None:
            speculator.times.add_decode(num_seqs, decode_s)
        if spec_s is not None:
            speculator.times.add_spec(num_seqs, drafted, spec_s)
    return speculator


def test_a_speculative_step_slower_per_token_than_decode_only_runs_as_a_bounded_probe():
    """Two sequences at the prior acceptance (k' = 2 each: 3.5 tokens expected) in a measured 30 ms speculative
    step: 117 tok/s, against 200 tok/s of 10 ms decode steps. Only one step in _PROBE_STEPS speculates, and
    that probe drafts for every sequence."""
    from engine.spec_decode.speculator import _PROBE_STEPS

    speculator = timed_speculator(decode_s=0.010, spec_s=0.030)
    seqs = decoding_sequences(2)
    steps = [speculator.drafts(seqs) for _ in range(3 * _PROBE_STEPS)]
    probes = [i for i, d in enumerate(steps) if d is not None]
    assert probes == [_PROBE_STEPS - 1, 2 * _PROBE_STEPS - 1, 3 * _PROBE_STEPS - 1]
    assert all(len(steps[i]) == 2 for i in probes)


def test_a_speculative_step_faster_per_token_than_decode_speculates_every_step():
    speculator = timed_speculator(decode_s=0.010, spec_s=0.015)  # 3.5 tokens in 15 ms: 233 tok/s > 200
    seqs = decoding_sequences(2)
    assert all(speculator.drafts(seqs) == {0: [5, 6], 1: [5, 6]} for _ in range(100))
    # The same step time no longer pays once the drafts keep failing: the sequences fall back to k' = 0.
    for _ in range(10):
        for seq in seqs:
            speculator.observe(seq, 2, 0)
    assert speculator.drafts(seqs) is None


def test_speculation_waits_for_a_measured_decode_step_then_tries_the_modelled_one():
    """No decode step measured: no speculation (nothing to compare with). A decode step measured but no
    speculative one: the cost model's time, which pays at the prior acceptance, so the step speculates."""
    from engine.spec_decode.speculator import _MIN_MEASURED

    seqs = decoding_sequences(2)
    assert timed_speculator(decode_s=None, spec_s=None).drafts(seqs) is None
    assert timed_speculator(decode_s=None, spec_s=0.001).drafts(seqs) is None
    assert timed_speculator(decode_s=0.010, spec_s=None).drafts(seqs) == {0: [5, 6], 1: [5, 6]}
    # One slow speculative step is not enough to go by: the model's time until _MIN_MEASURED are measured.
    speculator = timed_speculator(decode_s=0.010, spec_s=None)
    for measured in range(1, _MIN_MEASURED + 1):
        speculator.times.add_spec(2, 4, 0.030)
        assert (speculator.drafts(seqs) is None) == (measured == _MIN_MEASURED)
    # Timings of another batch size bucket (8) say nothing about a step of 2 sequences.
    assert timed_speculator(decode_s=0.010, spec_s=0.001, num_seqs=8).drafts(seqs) is None


def test_a_new_sequence_starts_from_the_workloads_recent_acceptance():
    """At the first prior (a = 0.5) a 30 ms speculative step against 10 ms decode steps does not pay for one
    sequence; after another sequence's drafts were all accepted, a new one starts near its rate and drafts k."""
    speculator = timed_speculator(decode_s=0.010, spec_s=0.030, num_seqs=1)
    old, new = decoding_sequences(2)
    assert speculator.drafts([new]) is None
    speculator.stats[old.seq_id] = speculator._prior()  # as drafts() makes it for a sequence that speculates
    for _ in range(10):
        speculator.observe(old, 4, 4)
    assert speculator.drafts([new]) == {new.seq_id: [5, 6, 7, 8]}


def test_the_decision_counts_decoding_sequences_up_to_one_past_the_limit():
    from engine.spec_decode.speculator import Speculator

    config = SpeculativeConfig.parse({**NGRAM, "num_speculative_tokens": 4, "disable_by_batch_size": 4})
    speculator = Speculator(config, max_model_len=1024)
    seqs = decoding_sequences(8)
    prefilling = seqs[:3]
    for s in prefilling:
        s.num_computed_tokens -= 5  # a prompt chunk still to compute
    assert speculator.num_decoding(seqs[:5]) == 2  # exact at or below the limit
    assert speculator.num_decoding(seqs) == 5  # 5 decoding of 8: one past the limit, the count stops there
    assert speculator.num_decoding(seqs[3:7]) == 4


def test_the_step_decision_is_made_once_per_step():
    """speculates() (asked when the engine decides whether to overlap the next step) and the next drafts() are
    one decision: the probe counter moves once."""
    speculator = timed_speculator(decode_s=0.010, spec_s=0.030)
    seqs = decoding_sequences(2)
    assert not speculator.speculates(seqs) and not speculator.speculates(seqs)
    assert speculator.drafts(seqs) is None and speculator.declined == 1


def test_no_draft_length_pays_at_a_cost_ratio_of_one_so_no_step_speculates():
    from engine.spec_decode.speculator import _PROBE_STEPS, Speculator

    speculator = Speculator(SpeculativeConfig.parse({**NGRAM, "num_speculative_tokens": 4}), 1024, cost_ratio=1.05)
    for _ in range(5):
        speculator.times.add_decode(2, 0.010)
        speculator.times.add_spec(2, 4, 0.001)  # even a measured speculative step that seems free: c says no
    seqs = decoding_sequences(2)
    assert not speculator.can_pay
    assert all(speculator.drafts(seqs) is None for _ in range(2 * _PROBE_STEPS))


def guarded_steps(speculator, seqs, steps: int, realized) -> list[bool]:
    """`steps` steps of `seqs` decided by `speculator`, each counted for its guard mode as `realized(mode)`
    (tokens, seconds) says, as the engine counts a step at the next launch; whether each speculated."""
    went = []
    for _ in range(steps):
        went.append(speculator.drafts(seqs) is not None)
        speculator.count_step(speculator.step_mode, *realized(speculator.step_mode[1]))
    return went


def test_the_guard_holds_off_speculation_that_emits_fewer_tokens_a_second_than_none():
    """The cost model says every step pays (3.5 tokens in 15 ms against 2 in 10 ms), but the steps it runs
    emit 2 tokens in 12 ms: once both modes are measured, speculation runs only _GUARD_EXPLORE steps a
    cycle. When what speculation emits turns better than none (4 tokens in 12 ms), the next run of the mode
    behind sees it and speculation runs the rest of each cycle."""
    from engine.spec_decode.speculator import _GUARD_CYCLE, _GUARD_EXPLORE

    speculator = timed_speculator(decode_s=0.010, spec_s=0.015)
    seqs = decoding_sequences(2)
    losing = {True: (2, 0.012), False: (2, 0.010)}
    went = guarded_steps(speculator, seqs, 2 * _GUARD_EXPLORE, losing.get)
    assert went == [True] * _GUARD_EXPLORE + [False] * _GUARD_EXPLORE  # each mode measured in turn
    for _ in range(3):
        assert sum(guarded_steps(speculator, seqs, _GUARD_CYCLE, losing.get)) == _GUARD_EXPLORE
    paying = {True: (4, 0.012), False: (2, 0.010)}
    went = guarded_steps(speculator, seqs, 2 * _GUARD_CYCLE, paying.get)
    assert sum(went[_GUARD_CYCLE:]) == _GUARD_CYCLE - _GUARD_EXPLORE


def test_the_guard_is_kept_per_batch_size_bucket():
    from engine.spec_decode.speculator import _GUARD_EXPLORE

    speculator = timed_speculator(decode_s=0.010, spec_s=0.015)
    for _ in range(3):
        speculator.times.add_decode(1, 0.010)
    seqs = decoding_sequences(2)
    guarded_steps(speculator, seqs, 2 * _GUARD_EXPLORE, {True: (2, 0.012), False: (2, 0.010)}.get)
    assert not any(guarded_steps(speculator, seqs, 20, lambda mode: (2, 0.010)))
    # One sequence (bucket 1): nothing measured there yet, so its first steps run with speculation on.
    assert speculator.drafts(seqs[:1]) is not None and speculator.step_mode[1] is True


def test_the_engine_counts_each_steps_tokens_for_its_guard_and_mode(tiny_model_dir, monkeypatch):
    """A real engine (n-gram, adaptive) with undecayed sums and a short cycle: each guard's sums of a mode hold
    exactly the tokens of the steps it ran in that mode (accepted drafts and steps with prompt tokens included),
    every one but the last, which ends before a next launch times it."""
    from engine.spec_decode import speculator as module

    monkeypatch.setattr(module, "_GUARD_DECAY", 1.0)
    monkeypatch.setattr(module, "_GUARD_EXPLORE", 3)
    monkeypatch.setattr(module, "_GUARD_CYCLE", 8)
    llm = make(tiny_model_dir("llama"), 3)
    engine = llm.engine
    speculator = engine.speculator
    speculator.adaptive = True
    for _ in range(module._MIN_MEASURED):  # the cost model lets every step of these buckets speculate
        for num_seqs in (1, 2):
            speculator.times.add_decode(num_seqs, 1.0)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = repetitive_prompts(3, seed=11)
    for rid, prompt in enumerate(prompts[:2]):
        engine.add_request(str(rid), prompt, params)
    steps = []  # (guard, mode, tokens, prompt tokens) of each step a guard decided
    while engine.has_unfinished_requests():
        if len(steps) == 10:  # a request that arrives while the others decode: a step with prompt tokens
            engine.add_request("2", prompts[2], params)
        engine.step()
        if speculator.step_mode is not None:
            stats = engine.last_step
            steps.append((*speculator.step_mode, stats.num_generated_tokens, stats.num_prefill_tokens))
    steps.pop()  # the last step: no launch after it timed it
    assert {mode for _, mode, _, _ in steps} == {True, False}
    assert any(prompt > 0 for *_, prompt in steps)
    assert any(tokens > 3 for _, mode, tokens, _ in steps if mode)  # accepted drafts were counted
    for guard in speculator.guards.values():
        for mode, sums in ((True, guard.on), (False, guard.off)):
            counted = [tokens for g, m, tokens, _ in steps if g is guard and m is mode]
            assert (sums.count, sums.tokens) == (len(counted), sum(counted))


def test_the_engine_times_its_decode_and_speculative_steps_but_not_its_idle_time(tiny_model_dir):
    """A real engine measures plain decode steps and speculative ones (with their drafts) per batch size
    bucket, and the wait between two requests (the engine idle) counts as no step's time."""
    import time

    llm = make(tiny_model_dir("llama"), 3)
    engine = llm.engine
    engine.speculator.adaptive = True  # make() speculates always; times are measured either way
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    run(llm, repetitive_prompts(2, seed=4), params)
    times = engine.speculator.times
    assert 2 in times.decode and 2 in times.spec  # two decoding sequences: bucket 2
    assert times.spec[2].count > 0 and times.spec[2].drafted > 0 and times.decode[2].count > 0
    time.sleep(3.0)  # idle: the next step's period must not include this
    run(llm, repetitive_prompts(2, seed=5), params)
    assert max(t.seconds for t in (*times.decode.values(), *times.spec.values())) < 0.5


def test_no_drafts_in_a_step_with_more_decoding_sequences_than_the_limit(tiny_model_dir):
    prompts = repetitive_prompts(6, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want, _ = run(make(tiny_model_dir("llama"), None), prompts, params)
    got, stats = run(make(tiny_model_dir("llama"), 3, batch_limit=5), prompts, params)
    assert got == want and stats.num_drafts == 0
    _, stats = run(make(tiny_model_dir("llama"), 3, batch_limit=5), prompts[:5], params)
    assert stats.num_drafts > 0


# ----- the engine: greedy output identical to no speculation -----


def run(llm: LLM, prompts, params) -> tuple[list[list[int]], StepStats]:
    """Generate by stepping the engine; the outputs' token ids and the speculation summed over the steps."""
    engine: LLMEngine = llm.engine
    ids = [f"r{i}" for i in range(len(prompts))]
    params = params if isinstance(params, list) else [params] * len(prompts)
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    final, total = {}, StepStats()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step = engine.last_step
        total.num_drafts += step.num_drafts
        total.num_draft_tokens += step.num_draft_tokens
        total.num_accepted_tokens += step.num_accepted_tokens
    return [[list(c.token_ids) for c in final[rid].outputs] for rid in ids], total


def make(model_dir, k: int | None, batch_limit: int = 64, **kwargs) -> LLM:
    spec = None if k is None else {**NGRAM, "num_speculative_tokens": k, "disable_by_batch_size": batch_limit}
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES, speculative_config=spec, **kwargs
    )
    if llm.engine.speculator is not None:
        llm.engine.speculator.speculate_always()  # always the full k: the most drafts to verify
    return llm


def repetitive_prompts(count: int, length: int = 24, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase, so the proposer finds matches from the first step."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        phrase = rng.integers(3, 500, size=rng.integers(5, 9)).tolist()
        prompts.append((phrase * (length // len(phrase) + 2))[: length + rng.integers(0, 6)])
    return prompts


def check_greedy(model_dir, k, prompts, new_tokens=24, **kwargs) -> StepStats:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    want, _ = run(make(model_dir, None, **kwargs), prompts, params)
    got, stats = run(make(model_dir, k, **kwargs), prompts, params)
    assert got == want
    assert stats.num_drafts > 0  # it did speculate
    return stats


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_batched_equals_no_speculation(arch, k, tiny_model_dir):
    stats = check_greedy(tiny_model_dir(arch), k, repetitive_prompts(6))
    # Both paths of the rule ran: some draft tokens accepted, some rejected.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


MODES = {
    # Long prompts chunked over several steps while others decode (and speculate) beside them.
    "chunked": {"max_num_batched_tokens": 32},
    # A pool of 12 blocks of 16 tokens for 6 sequences of ~60 tokens: preempted and recomputed.
    "preempt": {"num_gpu_blocks_override": 12, "max_model_len": 192},
    "swap": {"num_gpu_blocks_override": 12, "max_model_len": 192, "preemption_mode": "swap", "swap_space": 0.01},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_equals_no_speculation_when_chunked_or_preempted(mode, tiny_model_dir):
    check_greedy(tiny_model_dir("llama"), 3, repetitive_prompts(6, length=40, seed=1), new_tokens=32, **MODES[mode])


def test_greedy_with_prefix_hits_and_n_above_one(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    shared = repetitive_prompts(1, length=48, seed=2)[0]
    prompts = [shared + [7, 8], shared + [9]]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
    want, _ = run(make(model_dir, None), prompts, params)
    spec = make(model_dir, 3)
    got, stats = run(spec, prompts, params)
    again, _ = run(spec, prompts, params)  # the same prompts again: served from the prefix cache
    assert got == want == again and stats.num_drafts > 0
    assert all(a == b for a, b in want)  # n = 2 greedy: both choices alike
    assert spec.engine.block_manager.prefix_hit_tokens >= 2 * 48 // 16 * 16


def test_stop_tokens_and_max_tokens_cut_the_accepted_tail(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = repetitive_prompts(4, seed=3)
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full, _ = run(make(model_dir, None), prompts, base)
    # Stop at a token each output has in its middle; and max_tokens that end inside a draft.
    stops = [SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[out[0][10]]) for out in full]
    short = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (1, 2, 7, 13)]
    for params in (stops, short):
        want, _ = run(make(model_dir, None), prompts, params)
        got, _ = run(make(model_dir, 5), prompts, params)
        assert got == want
    assert [len(o[0]) for o in got] == [1, 2, 7, 13]


def penalized_params(prompts: list[list[int]]) -> list[SamplingParams]:
    """Greedy params for 4 prompts: a repetition penalty, presence + frequency penalties, a logit bias, and
    min_tokens with stop tokens from the prompt."""
    return [
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=24, presence_penalty=0.8, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=24, logit_bias={prompts[2][1]: 5.0, prompts[2][3]: -5.0}),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=12, stop_token_ids=prompts[3][:4]),
    ]


def test_penalties_bias_and_min_tokens_see_each_positions_history(tiny_model_dir):
    """Each verified position is processed with its own history (the draft tokens before it count for the
    penalties, and min_tokens for its output index): greedy with them equals no speculation."""
    model_dir = tiny_model_dir("qwen3")
    prompts = repetitive_prompts(4, seed=10)
    params = penalized_params(prompts)
    want, _ = run(make(model_dir, None), prompts, params)
    got, stats = run(make(model_dir, 4), prompts, params)
    assert got == want and stats.num_drafts > 0
    assert len(got[3][0]) >= 12


def test_constrained_requests_decode_beside_speculating_ones(random_model_dir):  # noqa: F811 (the fixture)
    """Structured outputs in a speculative step: constrained rows do not speculate, and their masks land on
    their rows among the verify rows; every output equals the one without speculation."""
    from tests.test_structured import PERSON, json_constraint, prefix_ok

    constraint = json_constraint(PERSON)
    prompts = repetitive_prompts(3, seed=11) + ["name someone", "repeat repeat repeat repeat"]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.0, max_tokens=40, constraint=constraint)
    ] * 2
    want, _ = run(make(random_model_dir, None), prompts, params)
    spec = make(random_model_dir, 3)
    got, stats = run(spec, prompts, params)
    assert got == want and stats.num_drafts > 0
    assert all(prefix_ok(spec, constraint, out[0]) for out in got[3:])


def test_a_refused_constrained_row_ends_beside_speculating_ones(random_model_dir):  # noqa: F811 (the fixture)
    """A constrained row whose grammar is complete while min_tokens bans the end of sequence gets no allowed
    token: its sequence ends without it. In a speculative step its row sits after other sequences' verify
    rows, and only it ends so; the outputs and finish reasons equal those without speculation."""
    from tests.test_structured import json_constraint

    prompts = repetitive_prompts(3, seed=16) + ["true or false?"]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 3 + [
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, constraint=json_constraint({"type": "boolean"}))
    ]
    outs = [make(random_model_dir, k).generate(prompts, params, use_tqdm=False) for k in (None, 3)]
    for want, got in zip(*outs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].finish_reason == want.outputs[0].finish_reason
    got = outs[1]
    assert [o.outputs[0].finish_reason for o in got] == ["length"] * 3 + ["stop"]
    assert got[3].outputs[0].text.strip() in ("true", "false") and len(got[0].outputs[0].token_ids) == 24


def test_logprobs_are_the_targets(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = repetitive_prompts(3, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    outs = [make(model_dir, k).generate(prompts, params, use_tqdm=False) for k in (None, 4)]
    for want, got in zip(*outs):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(want.outputs[0].logprobs, got.outputs[0].logprobs):
            assert a.token_id == b.token_id and math.isclose(a.logprob, b.logprob, abs_tol=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_no_block_leaks_after_many_random_rejections(tiny_model_dir):
    """Sampled (not greedy) outputs: drafts are accepted and rejected at random points, blocks are trimmed
    and re-taken, sequences preempted; at the end every block is free and nothing is held twice."""
    llm = make(tiny_model_dir("llama"), 4, num_gpu_blocks_override=24, max_model_len=192)
    prompts = repetitive_prompts(24, length=32, seed=5)
    params = [SamplingParams(temperature=0.5, max_tokens=80 + i, seed=i, ignore_eos=True) for i in range(24)]
    outs, stats = run(llm, prompts, params)
    assert all(len(o[0]) == 80 + i for i, o in enumerate(outs))
    assert stats.num_drafts > 300 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0
    assert_no_leaks_and_nothing_unverified_named(llm, prompts, outs)


def assert_no_leaks_and_nothing_unverified_named(llm, prompts, outs) -> None:
    """Every block is free and held by nobody, and every name in the prefix cache is that of a block of some
    sequence's final tokens (a block holding a rejected draft token would have a name of tokens no output has)."""
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    names = set()
    for prompt, out in zip(prompts, outs):
        tokens, name = np.asarray(prompt + out[0], dtype=np.int64), b""
        for start in range(0, len(tokens) - bm.block_size + 1, bm.block_size):
            digest = hashlib.sha256(name)
            digest.update(tokens[start : start + bm.block_size].tobytes())
            name = digest.digest()
            names.add(name)
    assert bm.cache and set(bm.cache) <= names


def test_seeded_sampling_is_reproducible(tiny_model_dir):
    llm = make(tiny_model_dir("qwen3"), 3)
    prompts = repetitive_prompts(4, seed=6)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=11, ignore_eos=True)
    first, stats = run(llm, prompts, params)
    second, _ = run(llm, prompts, params)
    assert first == second and stats.num_drafts > 0


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "device, backend",
    [("cpu", "auto"), pytest.param("cuda", "triton", marks=CUDA), pytest.param("cuda", "torch", marks=CUDA)],
)
def test_greedy_equals_no_speculation_with_async_steps_and_graphs(device, backend, tiny_model_dir):
    """Async scheduling around speculation: 6 sequences under a limit of 4 start without drafts, their steps
    overlapped (tokens still on the device get no draft), and speculate synchronously once fewer are left
    (their max_tokens differ). On the GPU with the triton backend, verify-graph steps come between decode-graph
    steps (tests/test_verify_graphs.py); the torch backend runs both eagerly."""
    model_dir = tiny_model_dir("llama")
    prompts = repetitive_prompts(6, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(6)]
    pool = {"cpu_kv_cache_bytes": KV_BYTES} if device == "cpu" else {"num_gpu_blocks_override": 256}  # two engines
    kwargs = dict(dtype="float32", device=device, attention_backend=backend, async_scheduling=True, **pool)
    want, _ = run(LLM(str(model_dir), **kwargs), prompts, params)
    spec = {**NGRAM, "num_speculative_tokens": 3, "disable_by_batch_size": 4}
    llm = LLM(str(model_dir), speculative_config=spec, **kwargs)
    llm.engine.speculator.speculate_always()
    got, stats = run(llm, prompts, params)
    assert got == want and stats.num_drafts > 0
    bm = llm.engine.block_manager
    assert not any(bm.ref_counts)


# ----- sampling: the distribution is the target's (chi-square) -----


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of the chi-square test that two samples come from one distribution (outcomes with fewer than
    10 draws in all are pooled into one cell)."""
    keys = sorted(set(a) | set(b), key=lambda x: -(a[x] + b[x]))
    big = [x for x in keys if a[x] + b[x] >= 10]
    rows = [[a[x], b[x]] for x in big]
    rest = [sum(a[x] for x in keys if x not in big), sum(b[x] for x in keys if x not in big)]
    if sum(rest):
        rows.append(rest)
    table = np.array(rows, dtype=np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


SAMPLES = 1200
STAT_PARAMS = dict(temperature=0.8, top_p=0.9, max_tokens=3, ignore_eos=True)


def continuations(llm: LLM, prompt: list[int]) -> tuple[Counter, StepStats]:
    """SAMPLES three-token continuations of `prompt`, each under its own seed."""
    params = [SamplingParams(**STAT_PARAMS, seed=1000 + i) for i in range(SAMPLES)]
    outs, stats = run(llm, [prompt] * SAMPLES, params)
    return Counter(tuple(o[0]) for o in outs), stats


def filtered_next_token_probs(model, prompt: list[int]) -> np.ndarray:
    """The target's exact next-token distribution after `prompt` as the sampler draws from it under
    STAT_PARAMS: temperature, then top-p keeps the smallest prefix of the sorted distribution reaching p."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double() / STAT_PARAMS["temperature"]
    p = logits.softmax(-1).numpy()
    order = np.argsort(-p, kind="stable")
    num_kept = int((np.cumsum(p[order]) - p[order] < STAT_PARAMS["top_p"]).sum())
    kept = np.zeros_like(p)
    kept[order[:num_kept]] = p[order[:num_kept]]
    return kept / kept.sum()


@pytest.fixture(scope="module")
def stat_setup(tiny_model_dir, tmp_path_factory):
    """The tiny Llama with its head's weights scaled up 4x (its next-token distributions are nearly flat
    otherwise, top-p 0.9 keeping hundreds of tokens), a prompt A + B + A whose n-gram draft B (what followed A
    before) is the model's own likely continuation but not a sure one, so drafts are accepted often and
    rejected often, and the target's filtered next-token distribution after it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model_dir = tmp_path_factory.mktemp("sharp-llama")
    model.save_pretrained(model_dir, safe_serialization=True)
    rng = np.random.default_rng(7)
    for _ in range(50):
        a, b = rng.integers(3, 500, size=4).tolist(), rng.integers(3, 500, size=3).tolist()
        for _ in range(5):  # B <- the model's greedy continuation of A + B + A, towards a fixed point
            prompt, previous = a + b + a, b
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)
            b = out[0, len(prompt) :].tolist()
        prompt = a + b + a
        p = filtered_next_token_probs(model, prompt)
        if b == previous and 0.2 < p[b[0]] < 0.8:
            return model_dir, make(model_dir, None, max_num_seqs=512), prompt, p
    pytest.fail("no prompt with a likely but unsure n-gram draft among 50 tries")


def test_sampled_continuations_have_the_targets_distribution(stat_setup):
    model_dir, plain, prompt, _ = stat_setup
    want, _ = continuations(plain, prompt)
    got, stats = continuations(make(model_dir, 3, batch_limit=512, max_num_seqs=512), prompt)
    # Drafts in most sequences, many accepted and many rejected.
    assert stats.num_drafts >= SAMPLES // 4
    assert 0.1 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.9
    assert chi_square_p(want, got) > 1e-3
    # Stronger, by the rule's construction (engine/spec_decode/rejection.py): each position is sampled from
    # the sampler's stream for that seed and output index, so a seeded request draws the very tokens it
    # draws without speculation (but where the verify forward's rounding differs enough to flip a draw).
    assert sum(min(want[t], got[t]) for t in want) >= 0.99 * SAMPLES


def test_the_check_rejects_a_wrong_acceptance_rule(stat_setup):
    """The same check, on a deliberately wrong rule (on a rejection, resample from p itself instead of p with
    the draft token removed, which over-weights the draft token) against the target's own first tokens, must
    fail, while the right rule simulated the same way passes."""
    _, plain, prompt, p = stat_setup
    want, _ = continuations(plain, prompt)
    first = Counter()
    for tokens, count in want.items():
        first[tokens[:1]] += count
    draft = ngram_draft(list(prompt), 1, 1, 3)[0]
    without_draft = p.copy()
    without_draft[draft] = 0.0
    without_draft /= without_draft.sum()
    rng = np.random.default_rng(0)

    def first_token(rejected_from: np.ndarray) -> tuple[int]:
        if rng.random() < p[draft]:  # accept with probability p(x)
            return (draft,)
        return (int(rng.choice(len(p), p=rejected_from)),)

    right = Counter(first_token(without_draft) for _ in range(SAMPLES))
    wrong = Counter(first_token(p) for _ in range(SAMPLES))  # the mutation
    assert chi_square_p(first, right) > 1e-3
    assert chi_square_p(first, wrong) < 1e-3


# ----- the default model, and the server -----

REPEAT = (
    "Repeat the following text exactly.\n\nThe hacker ethic is the belief that information-sharing is a "
    "powerful positive good, and that it is an ethical duty of hackers to share their expertise.\n\nThe hacker"
)


def repeat_chat() -> list[dict]:
    """A chat the default model answers by repeating the text it was given: n-gram drafts are accepted, so
    speculation pays and the adaptive speculator keeps it on."""
    text = (
        "The hacker ethic is the belief that information-sharing is a powerful positive good, and that it is an "
        "ethical duty of hackers to share their expertise by writing open-source code and facilitating access to "
        "information and to computing resources wherever possible."
    )
    return [{"role": "user", "content": "Repeat the following text exactly:\n\n" + text}]


def test_default_model_greedy_equals_no_speculation(default_model_dir):
    prompts = [REPEAT, "List the numbers from 1 to 12, separated by commas: 1, 2, 3,"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    plain, spec = make(default_model_dir, None, max_model_len=512), make(default_model_dir, 5, max_model_len=512)
    want, _ = run(plain, prompts, params)
    got, stats = run(spec, prompts, params)
    assert got == want
    assert stats.num_accepted_tokens >= 5  # the text repeats: drafts hold
    # A stop string inside the output: the accepted tokens after it are dropped, as without speculation.
    text = plain.generate(prompts[0], params, use_tqdm=False)[0].outputs[0].text
    stop = SamplingParams(temperature=0.0, max_tokens=24, stop=[text.split()[len(text.split()) // 2]])
    outs = [llm.generate(prompts[0], stop, use_tqdm=False)[0].outputs[0] for llm in (plain, spec)]
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) < 24
    assert (outs[1].text, outs[1].token_ids, outs[1].finish_reason) == (
        outs[0].text,
        outs[0].token_ids,
        outs[0].finish_reason,
    )


def test_server_speculates_through_the_openai_sdk(tmp_path, default_server):
    import openai

    from tests.test_server import MODEL, SERVER_FLAGS, scrape, start_server

    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    server = start_server(tmp_path, *SERVER_FLAGS, "--speculative-config", spec)
    try:
        texts = []
        for url in (server.url, default_server.url):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            stream = client.chat.completions.create(
                model=MODEL, messages=repeat_chat(), max_tokens=32, temperature=0.0, stream=True
            )
            deltas = [
                chunk.choices[0].delta.content for chunk in stream if chunk.choices and chunk.choices[0].delta.content
            ]
            texts.append(("".join(deltas), len(deltas)))
        (spec_text, spec_chunks), (plain_text, plain_chunks) = texts
        assert spec_text == plain_text
        assert spec_chunks < plain_chunks  # accepted tokens arrive together, as one delta
        metrics = scrape(server.url)
        drafts = metrics[("pagoda:spec_decode_num_drafts_total", ())]
        accepted = metrics[("pagoda:spec_decode_num_accepted_tokens_total", ())]
        assert drafts > 0 and accepted > 0
        assert metrics[("pagoda:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] > 0
        assert accepted <= metrics[("pagoda:spec_decode_num_draft_tokens_total", ())]
        # `pagoda bench serve` reports what speculation did during a run from the same counters.
        before = latency.spec_decode_counters(server.url)
        client.base_url = f"{server.url}/v1"
        client.chat.completions.create(model=MODEL, messages=repeat_chat(), max_tokens=32, temperature=0.0)
        summary = latency.spec_decode_summary(before, latency.spec_decode_counters(server.url))
        assert summary["drafts"] > 0 and 0 < summary["accepted_tokens"] <= summary["draft_tokens"]
        assert summary["acceptance_rate"] == summary["accepted_tokens"] / summary["draft_tokens"]
        assert summary["acceptance_length"] == 1 + summary["accepted_tokens"] / summary["drafts"]
        assert len(summary["per_position_acceptance"]) == 4 and summary["per_position_acceptance"][0] > 0
        metrics = latency.compute_metrics([], 1.0, None, [50.0])
        run = {"max_concurrency": 1, "request_rate": 1.0, "burstiness": 1.0, "peak_concurrency": 1, "metrics": metrics}
        text = latency.format_summary(run | {"spec_decode": summary})
        assert "Speculative Decoding" in text and "Position 3 acceptance (%):" in text
        # A whole `pagoda bench serve` run against it carries the summary in its result.
        result_file = tmp_path / "bench.json"
        argv = ["--base-url", server.url, "--num-prompts", "2", "--random-input-len", "16", "--random-output-len", "8"]
        assert latency.main([*argv, "--disable-tqdm", "--result-file", str(result_file)]) == 0
        (run_,) = json.loads(result_file.read_text())["runs"]
        assert 0 <= run_["spec_decode"]["accepted_tokens"] <= run_["spec_decode"]["draft_tokens"]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert not any("spec_decode" in name for name, _ in scrape(default_server.url))
    assert latency.spec_decode_counters(default_server.url) is None
