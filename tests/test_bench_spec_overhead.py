"""bench/spec_overhead.py: two real engines (the tiny Llama of bench/spec_host.py, one with an n-gram speculator
that never speculates at a batch above disable_by_batch_size) stepped in ABBA order over the same closed loop."""

from __future__ import annotations

import json

import pytest

from bench.spec_host import TINY_LLAMA
from bench.spec_overhead import Loop, interleaved, summary


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engines_run_the_same_steps_and_the_speculator_never_speculates(tmp_path, async_scheduling):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    none = Loop(str(tmp_path), 20, False, async_scheduling)
    ngram = Loop(str(tmp_path), 20, True, async_scheduling)
    assert ngram.eng.speculator is not None and none.eng.speculator is None
    none_s, ngram_s = interleaved(none, ngram, 40)
    assert len(none_s) == len(ngram_s) == 40 and min(none_s + ngram_s) > 0
    assert ngram.speculated == 0  # 20 decoding sequences, above the limit of 16
    # The same closed loop on both: the same requests added, the same tokens made.
    assert none.next == ngram.next
    assert none.eng.last_step.num_generated_tokens == ngram.eng.last_step.num_generated_tokens
    row = summary(none_s, ngram_s)
    diffs = sorted((b - a) * 1e6 for a, b in zip(none_s, ngram_s))
    low, high = row["diff_median_ci95_us"]
    assert row["steps"] == 40 and low <= row["diff_median_us"] <= high
    assert diffs[0] - 0.01 <= row["diff_median_us"] <= diffs[-1] + 0.01
    # The mean difference over none's mean step, in percent (the figure the 3% rule reads), inside its interval.
    assert row["diff_mean_pct"] == pytest.approx(row["diff_mean_us"] / row["none_mean_us"] * 100, abs=0.02)
    low_pct, high_pct = row["diff_mean_ci95_pct"]
    assert low_pct <= row["diff_mean_pct"] <= high_pct
