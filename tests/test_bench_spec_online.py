"""bench/spec_online.py: the online speculative-decoding comparison. Its table from rows, its configurations'
server commands, and (slow tier) a real run of its pagoda half against `pagoda serve` of the default model on
the CPU, swept by the real online client."""

from __future__ import annotations

import json

import pytest

from bench import spec_online


def row(server: str, spec: str, c: int, tok_s: float, acc: float | None = None) -> dict:
    return {"config": f"{server}-{spec}", "server": server, "speculation": spec, "concurrency": c,
            "output_tok_s": tok_s, "acceptance_rate": acc}  # fmt: skip


def test_summary_ratios_speedups_and_crossover():
    rows = [
        row("pagoda", "none", 1, 100.0),
        row("vllm", "none", 1, 80.0),
        row("pagoda", "ngram", 1, 250.0, 0.7),
        row("vllm", "ngram", 1, 200.0, 0.6),
        row("pagoda", "none", 32, 2000.0),
        row("vllm", "none", 32, 2500.0),
        row("pagoda", "ngram", 32, 1800.0, 0.7),
        row("vllm", "ngram", 32, 2600.0, 0.6),
        {"config": "vllm-draft", "error": "server did not come up (exit 1)"},
    ]
    table = spec_online.summarize(rows)
    lines = table.splitlines()
    assert "| 1 | ngram | 250.0 | 200.0 | 1.25 | 2.50 | 2.50 | 0.700 | 0.600 | 1, 1 |" in lines
    assert "| 32 | none | 2000.0 | 2500.0 | 0.80 | 1.00 | 1.00 | - | - | 1, 1 |" in lines
    assert "- pagoda ngram: concurrency 32 (c1 2.50x, c32 0.90x)" in lines
    assert "- vllm ngram: none up to concurrency 32 (c1 2.50x, c32 1.04x)" in lines
    assert "- vllm-draft: server did not come up (exit 1)" in lines
    # A later row of the same configuration and concurrency replaces the earlier one; one that ran clears an error.
    later = spec_online.summarize([*rows, row("pagoda", "none", 1, 50.0), row("vllm", "draft", 1, 90.0, 1.0)])
    assert "| 1 | none | 50.0 | 80.0 | 0.62 |" in later and "did not run" not in later


def test_rounds_medians_spreads_and_per_round_ratios():
    """Interleaved rounds: each configuration's tok/s over the rounds, and the speedup taken round by round (the
    median of the per-round ratios, not the ratio of the medians); a round whose `none` failed has no ratio."""
    tok_s = {"none": [1000.0, 1400.0, 900.0], "ngram": [1300.0, 1200.0, 990.0, 2000.0]}
    rows = [
        {**row("pagoda", spec, 8, v, 0.5), "date": "d", "round": i + 1}
        for spec, values in tok_s.items()
        for i, v in enumerate(values)
    ]
    rows.append({"config": "pagoda-none", "date": "d", "round": 4, "error": "server did not come up (exit 1)"})
    stats = {a["config"]: a for a in spec_online.aggregate(rows)}
    assert stats["pagoda-none"]["output_tok_s"] == {"median": 1000.0, "min": 900.0, "max": 1400.0, "n": 3}
    assert "speedup_vs_none" not in stats["pagoda-none"]
    assert stats["pagoda-ngram"]["output_tok_s"] == {"median": 1250.0, "min": 990.0, "max": 2000.0, "n": 4}
    ratios = stats["pagoda-ngram"]["speedup_vs_none"]
    assert ratios["n"] == 3 and ratios["median"] == pytest.approx(1.1) and ratios["min"] == pytest.approx(1200 / 1400)
    assert ratios["max"] == pytest.approx(1.3)
    lines = spec_online.summarize(rows).splitlines()
    assert "| 8 | none | 1000.0 (900.0-1400.0) | - | - | 1.00 | - | 0.500 | - | 3, 0 |" in lines
    assert "| 8 | ngram | 1250.0 (990.0-2000.0) | - | - | 1.10 (0.86-1.30) | - | 0.500 | - | 4, 0 |" in lines
    assert "- pagoda ngram: none up to concurrency 8 (c8 1.10x)" in lines
    assert "- pagoda-none: server did not come up (exit 1)" in lines
    # Two run files: rounds of different runs are told apart by the run's date, not merged by round number.
    again = [{**r, "date": "e"} for r in rows if r.get("round") == 1]
    assert spec_online.aggregate(rows + again)[0]["output_tok_s"]["n"] == 4


def test_rounds_interleave_the_configurations(tmp_path, monkeypatch):
    """The run loop itself, with servers that exit at once: round after round of the configurations in order,
    each row with its round, one log per configuration and round, and no aggregate of rounds that never ran."""
    monkeypatch.setenv("VLLM_PYTHON", "/bin/false")
    out = tmp_path / "rows.jsonl"
    argv = ["run", "/m", "--configs", "vllm-none,vllm-ngram", "--rounds", "2", "--out", str(out)]
    assert spec_online.main([*argv, "--logs", str(tmp_path)]) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["config"], r["round"]) for r in rows] == [
        ("vllm-none", 1),
        ("vllm-ngram", 1),
        ("vllm-none", 2),
        ("vllm-ngram", 2),
    ]
    assert all(r["error"] == "server did not come up (exit 1)" and r["rounds"] == 2 for r in rows)
    assert (tmp_path / "vllm-none.log").exists() and (tmp_path / "vllm-ngram.round2.log").exists()
    with pytest.raises(SystemExit, match="--rounds"):
        spec_online.main([*argv[:-4], "--rounds", "0"])


def test_both_servers_get_the_same_speculative_config():
    class Args:
        model, device, dtype, max_model_len = "/m", "cuda", "bfloat16", 2048

    for spec in spec_online.SPECS:
        config = spec_online.speculative_config(spec, "/m", 4)
        cmds = [spec_online.server_command(server, Args, 8000, config) for server in spec_online.SERVERS]
        tails = [cmd[cmd.index("--port") :] for cmd in cmds]
        assert tails[0] == tails[1]
        if config is None:
            assert "--speculative-config" not in tails[0]
        else:
            assert json.loads(tails[0][tails[0].index("--speculative-config") + 1])["num_speculative_tokens"] == 4
    with pytest.raises(ValueError, match="unknown speculation"):
        spec_online.speculative_config("eagle", "/m", 4)
    with pytest.raises(SystemExit, match="unknown configuration"):
        spec_online.main(["run", "/m", "--configs", "pagoda-none,sglang-none"])


@pytest.mark.slow
def test_pagoda_half_on_the_cpu(default_model_dir, tmp_path):
    out = tmp_path / "rows.jsonl"
    argv = ["run", str(default_model_dir), "--configs", "pagoda-none,pagoda-ngram", "--concurrency", "1,2"]
    argv += ["--output-len", "16", "--num-prompts", "2", "--prompts-per-concurrency", "1", "--num-warmups", "1"]
    argv += ["--device", "cpu", "--out", str(out), "--logs", str(tmp_path), "--rounds", "2"]
    assert spec_online.main(argv) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    rows = [r for r in lines if not r.get("aggregate")]
    # Interleaved: none, ngram, none, ngram, each over both concurrencies.
    assert [(r["config"], r["concurrency"], r["round"]) for r in rows] == [
        (config, c, round_) for round_ in (1, 2) for config in ("pagoda-none", "pagoda-ngram") for c in (1, 2)
    ]
    # After the rounds, one aggregate per configuration and concurrency, the n-gram one with its per-round ratios.
    aggregates = {(a["config"], a["concurrency"]): a for a in lines[len(rows) :]}
    assert len(aggregates) == 4 and all(a["aggregate"] and a["output_tok_s"]["n"] == 2 for a in aggregates.values())
    for c in (1, 2):
        tok_s = [r["output_tok_s"] for r in rows if r["config"] == "pagoda-ngram" and r["concurrency"] == c]
        assert aggregates[("pagoda-ngram", c)]["output_tok_s"]["min"] == min(tok_s)
        assert aggregates[("pagoda-ngram", c)]["speedup_vs_none"]["n"] == 2
    assert "| 2 | ngram |" in spec_online.summarize(lines)
    rows = rows[:4]
    for r in rows:
        assert r["completed"] == 2 and r["failed"] == 0 and r["output_tokens"] == 32 and r["output_tok_s"] > 0
    # The draft counts come from the server's /metrics, between the scrapes around each run: none without
    # speculation, a count with it. How many drafts a run this short makes is the engine's choice (it
    # speculates only once its measured step times say it pays), so it may be 0 here; the acceptance is
    # reported only where there were drafts.
    assert rows[0]["acceptance_rate"] is None and rows[0]["drafts"] is None
    for r in rows[2:]:
        assert isinstance(r["drafts"], int) and r["drafts"] >= 0
        assert (r["acceptance_rate"] is None) if r["drafts"] == 0 else 0 <= r["acceptance_rate"] <= 1
    assert (tmp_path / "pagoda-ngram.log").read_text()
