"""schemathesis against a live `pagoda serve` of the default model: every operation of /openapi.json, every check
(`--checks all`: status codes, content types, response schemas, positive and negative data, auth, methods),
with a fixed seed and a bounded number of examples. Generation is cut to a few tokens per request by
tests/schemathesis_hooks.py, which also lets through the 400s that JSON Schema cannot express (see there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_server import start_server

KEY = "fuzz-key"
ROOT = Path(__file__).resolve().parents[1]
SEED, EXAMPLES = 1, 20


@pytest.mark.slow
def test_schemathesis_finds_nothing_with_every_check(tmp_path):
    srv = start_server(
        tmp_path,
        "--max-model-len",
        "2048",
        "--num-gpu-blocks-override",
        "128",
        "--api-key",
        KEY,
        "--disable-log-requests",
        "--disable-uvicorn-access-log",
    )
    try:
        schemathesis = Path(sys.executable).with_name("schemathesis")
        command = [
            str(schemathesis),
            "run",
            f"{srv.url}/openapi.json",
            "--header",
            f"Authorization: Bearer {KEY}",
            "--checks",
            "all",
            "--seed",
            str(SEED),
            "--max-examples",
            str(EXAMPLES),
            "--workers",
            "1",
            # Generous for a shared CPU: a request of a few tokens may wait behind others for seconds.
            "--request-timeout",
            "60",
            "--max-response-time",
            "60",
        ]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "PYTHONPATH": str(ROOT)}
        out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
        report = out.stdout + out.stderr
        # The failures (each with its curl command to reproduce it), then the summary.
        assert out.returncode == 0, report[report.find("FAILURES") :][:12000] + report[-1500:]
        assert "13 selected / 13 total" in report, report[-3000:]
        print(report[report.find("SUMMARY") :])  # the figures WRITEUP.md quotes (pytest -s shows them)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    assert "Traceback" not in srv.log()
