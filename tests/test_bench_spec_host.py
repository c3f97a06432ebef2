"""bench/spec_host.py end to end at a tiny step count: both engines run, the speculative steps verify drafts that
the target accepts, and the markdown it appends holds both kinds of step and the profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_spec_host_runs_end_to_end(tmp_path):
    out = tmp_path / "spec-host.md"
    # A process of its own: the bench sets OMP_NUM_THREADS before torch loads, which must not leak into this one.
    cmd = [sys.executable, "bench/spec_host.py", "--steps", "40", "--batch", "1", "3", "--profile-steps", "10"]
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["batch"]: r for r in map(json.loads, (line for line in proc.stdout.splitlines() if line.startswith("{")))}
    assert set(rows) == {1, 3}
    for batch, row in rows.items():
        assert row["plain"]["steps"] == row["spec"]["steps"] == 40
        for kind in ("plain", "spec"):
            r = row[kind]
            assert 0 < r["model_ms"] < r["step_ms"]
            assert r["non_model_ms"] > 0
        # The repeated prompts make the lookup match: every timed speculative step verified drafts, most accepted.
        assert 1 <= row["spec"]["draft_tokens_per_step"] <= 4 * batch
        assert row["spec"]["acceptance"] > 0.5
    text = out.read_text()
    assert "| 1 | plain | 40 |" in text and "| 3 | spec | 40 |" in text
    assert text.count("cProfile of 10 speculative steps") == 2
    assert "ngram.py" in text  # the proposer's own time is in the profile
