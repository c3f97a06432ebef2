"""bench/spec_steps.py --paired's bookkeeping: two real engines (the tiny random Llama, one with n-gram
speculation) alive together, one closed-loop workload through both in ABBA chunks."""

from __future__ import annotations

import random

import pytest

from bench.spec_steps import _T975, Trace, make_llm, paired
from tests.conftest import KV_BYTES

CONC, OUT_LEN = 2, 8


def test_paired_runs_each_chunk_through_both_engines_in_abba_order_and_sums_the_chunks(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    traces = {
        name: Trace(make_llm(model, "cpu", CONC, spec, dtype="float32", cpu_kv_cache_bytes=KV_BYTES), CONC, OUT_LEN)
        for name, spec in (("none", False), ("ngram", True))
    }
    loops, added = [], {"none": [], "ngram": []}
    for name, trace in traces.items():
        loop, add = trace.closed_loop, trace.eng.add_request

        def logged_loop(prompts, _name=name, _loop=loop):
            loops.append((_name, [tuple(p) for p in prompts]))
            return _loop(prompts)

        def logged_add(request_id, prompt, params, _name=name, _add=add):
            added[_name].append(tuple(prompt))
            return _add(request_id, prompt, params)

        trace.closed_loop, trace.eng.add_request = logged_loop, logged_add
    # Token ids (the tiny model has no tokenizer), each prompt a phrase said three times: n-gram lookups find drafts.
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 512) for _ in range(6)] * 3 for _ in range(13)]
    result = paired(traces["none"], traces["ngram"], prompts, chunks=4)

    # 4 chunks of 3 consecutive prompts (the 13th is left out), each through both engines: none first in chunks 0
    # and 2, ngram first in 1 and 3 (the runs go none, ngram, ngram, none, none, ngram, ngram, none).
    chunks = [[tuple(p) for p in prompts[3 * i : 3 * i + 3]] for i in range(4)]
    order = ["none", "ngram", "ngram", "none", "none", "ngram", "ngram", "none"]
    assert loops == [(name, chunks[i // 2]) for i, name in enumerate(order)]
    assert [c["order"] for c in result["chunks"]] == ["none,ngram", "ngram,none"] * 2
    for name in ("none", "ngram"):  # every request of every chunk, once, on each engine
        assert added[name] == [p for chunk in chunks for p in chunk]
        assert traces[name].done == 12 and traces[name].loops == 4

    # Each chunk's ratio is its own pair's; the verdict is the ratio of the summed seconds, which are the engines'.
    none_s = [c["none_s"] for c in result["chunks"]]
    ngram_s = [c["ngram_s"] for c in result["chunks"]]
    assert all(s > 0 for s in none_s + ngram_s)
    assert [c["ratio"] for c in result["chunks"]] == [a / b for a, b in zip(none_s, ngram_s)]
    assert result["ratio_of_sums"] == pytest.approx(sum(none_s) / sum(ngram_s), rel=1e-12)
    assert traces["none"].elapsed == pytest.approx(sum(none_s))
    assert traces["ngram"].elapsed == pytest.approx(sum(ngram_s))
    assert result["none"]["elapsed"] == round(sum(none_s), 3) and result["ngram"]["elapsed"] == round(sum(ngram_s), 3)
    assert result["ngram"]["ratio_vs_none"] == round(sum(none_s) / sum(ngram_s), 3)
    assert result["none"]["tok_s"] == round(12 * OUT_LEN / sum(none_s), 1)

    # The spread: the chunks' ratios around their mean, with Student's t interval for 3 degrees of freedom.
    ratios = [c["ratio"] for c in result["chunks"]]
    mean = sum(ratios) / 4
    sd = (sum((r - mean) ** 2 for r in ratios) / 3) ** 0.5
    assert result["ratio_mean"] == pytest.approx(mean) and result["ratio_sd"] == pytest.approx(sd)
    assert (result["ratio_min"], result["ratio_max"]) == (min(ratios), max(ratios))
    half = _T975[2] * sd / 2
    assert result["ratio_ci95"] == pytest.approx([mean - half, mean + half])

    # The n-gram engine's step trace covers the timed chunks only (the warm-up is not in paired()).
    ngram_row = result["ngram"]
    assert ngram_row["steps"] == len(traces["ngram"].pattern) > 0
    assert sum(p["n"] for p in ngram_row["periods_ms"].values()) <= ngram_row["steps"]


def test_paired_needs_a_prompt_per_chunk(tiny_model_dir):
    with pytest.raises(ValueError, match="3 prompts cannot make 4 chunks"):
        paired(None, None, [[1]] * 3, chunks=4)
