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
    assert "| 1 | ngram | 250.0 | 200.0 | 1.25 | 2.50 | 2.50 | 0.700 | 0.600 |" in lines
    assert "| 32 | none | 2000.0 | 2500.0 | 0.80 | 1.00 | 1.00 | - | - |" in lines
    assert "- pagoda ngram: concurrency 32 (c1 2.50x, c32 0.90x)" in lines
    assert "- vllm ngram: none up to concurrency 32 (c1 2.50x, c32 1.04x)" in lines
    assert "- vllm-draft: server did not come up (exit 1)" in lines
    # A later row of the same configuration and concurrency replaces the earlier one; one that ran clears an error.
    later = spec_online.summarize([*rows, row("pagoda", "none", 1, 50.0), row("vllm", "draft", 1, 90.0, 1.0)])
    assert "| 1 | none | 50.0 | 80.0 | 0.62 |" in later and "did not run" not in later


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
    argv += ["--device", "cpu", "--out", str(out), "--logs", str(tmp_path)]
    assert spec_online.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["config"], r["concurrency"]) for r in rows] == [
        ("pagoda-none", 1),
        ("pagoda-none", 2),
        ("pagoda-ngram", 1),
        ("pagoda-ngram", 2),
    ]
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
