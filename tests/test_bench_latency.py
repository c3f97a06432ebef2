"""bench/latency.py (`pagoda bench serve`): the streaming latency client against a real `pagoda serve` of the
real default model on a loopback port, its arrival process, its failure accounting, and the sweep plot.

Few, short requests: every generated token is a forward pass of the whole model on the CPU.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
from scipy import stats

from bench import latency
from tests.test_server import _free_port, start_server

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(default_server):
    # The suite's shared `pagoda serve` (tests/conftest.py); the client's requests all finish before a test returns.
    return default_server


def run(tmp_path, *argv: str, name: str = "result.json") -> tuple[int, dict]:
    """latency.main(argv) writing its JSON to tmp_path/name; (exit status, the JSON)."""
    path = tmp_path / name
    rc = latency.main([*argv, "--disable-tqdm", "--result-file", str(path)])
    return rc, json.loads(path.read_text())


def requests_of(result: dict) -> list[dict]:
    (run_,) = result["runs"]
    return run_["requests"]


# ----- against the live server -----


def test_fixed_concurrency_run_accounts_every_request(server, tmp_path, capsys):
    rc, result = run(
        tmp_path,
        "--base-url",
        f"{server.url}/v1",
        "--num-prompts",
        "6",
        "--max-concurrency",
        "3",
        "--random-input-len",
        "16",
        "--random-output-len",
        "8",
        "--num-warmups",
        "1",
        "--goodput",
        "ttft:600000",
        "tpot:600000",
        "--save-detailed",
    )
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert result["label"] == "pagoda" and result["model"] == "SmolLM2-135M-Instruct"
    (run_,) = result["runs"]
    m = run_["metrics"]
    assert m["completed"] + m["failed"] == 6 and m["failed"] == 0, run_["errors"]
    assert run_["peak_concurrency"] <= 3

    for r in run_["requests"]:
        assert r["success"], r["error"]
        assert 0 < r["ttft"] <= r["e2el"]
        # ignore_eos + max_tokens: the server's usage is exactly max_tokens, one streamed chunk per token.
        assert r["output_tokens"] == r["max_tokens"] == 8
        assert r["prompt_len"] == 16
        assert len(r["itl"]) == r["output_tokens"] - 1
        assert r["tokenizer_output_tokens"] == r["output_tokens"]
        assert r["ttft"] + sum(r["itl"]) <= r["e2el"] + 1e-9

    assert m["usage_vs_max_tokens_mismatches"] == 0 and m["tokenizer_count_mismatches"] == 0
    assert m["total_output_tokens"] == 48 and m["total_input_tokens"] == 96
    assert m["request_throughput"] == pytest.approx(6 / m["duration"])
    assert m["output_throughput"] == pytest.approx(48 / m["duration"])
    assert m["total_token_throughput"] == pytest.approx(144 / m["duration"])
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])  # SLOs no request can miss
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < m[f"median_{name}_ms"] <= m[f"p90_{name}_ms"] <= m[f"p95_{name}_ms"] <= m[f"p99_{name}_ms"]
        assert m[f"mean_{name}_ms"] > 0 and m[f"std_{name}_ms"] >= 0
    assert m["mean_ttft_ms"] < m["mean_e2el_ms"]
    # TPOT is per request, ITL per gap: the same gaps, so their means agree closely when every request has 8 tokens.
    itls = [gap for r in run_["requests"] for gap in r["itl"]]
    assert m["mean_itl_ms"] == pytest.approx(1000 * np.mean(itls))
    assert m["mean_tpot_ms"] == pytest.approx(1000 * np.mean(itls), rel=0.05)


def test_pagoda_bench_serve_logs_no_line_per_request(server):
    # `pagoda` sets up logging at INFO, where httpx would log every request the benchmark sends.
    cmd = [sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", server.url, "--num-prompts", "3"]
    cmd += ["--random-input-len", "8", "--random-output-len", "4", "--disable-tqdm"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Serving Benchmark Result" in done.stdout
    assert "HTTP Request" not in done.stdout + done.stderr


def test_num_prompts_default_is_in_the_help():
    assert "default 1000" in " ".join(latency.build_parser().format_help().split())


def test_chat_corpus_and_poisson_duration(server, tmp_path):
    # Chat endpoint + the corpus (text prompts cut with the server's tokenizer).
    rc, result = run(
        tmp_path,
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/chat/completions",
        "--dataset-name",
        "corpus",
        "--input-len",
        "32",
        "--output-len",
        "4",
        "--num-prompts",
        "3",
        "--save-detailed",
        name="chat.json",
    )
    assert rc == 0
    for r in requests_of(result):
        assert r["success"], r["error"]
        assert r["output_tokens"] == r["max_tokens"] == 4 and r["text"]
        assert 0 < r["ttft"] <= r["e2el"] and len(r["itl"]) <= 3
        assert r["prompt_len"] > 32  # the passage plus the chat template

    # --duration with Poisson arrivals: requests are issued only within the duration, and all accounted for.
    rc, result = run(
        tmp_path,
        "--base-url",
        server.url,
        "--duration",
        "1.0",
        "--request-rate",
        "4",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
        "--num-prompts",
        "50",
        "--save-detailed",
        name="duration.json",
    )
    assert rc == 0
    requests = requests_of(result)
    m = result["runs"][0]["metrics"]
    assert requests and m["completed"] + m["failed"] == len(requests) and m["failed"] == 0
    assert all(r["start"] < 1.0 for r in requests)
    assert m["duration"] >= max(r["start"] + r["e2el"] for r in requests)


def test_repeat_dataset_asks_to_repeat_corpus_passages(server, tmp_path):
    """--dataset-name repeat (the speculative-decoding workload): chat requests quoting a passage of the corpus; each
    run of a sweep asks about passages of its own; on /v1/completions it is refused before any request."""
    corpus = latency.DEFAULT_CORPUS.read_text(encoding="utf-8", errors="replace")
    prompts = latency.repeat_dataset(64, 8, None, seed=0) + latency.repeat_dataset(8, 8, None, seed=8)
    assert len({p.prompt for p in prompts}) == len(prompts) == 72
    for p in prompts:
        instruction, passage = p.prompt.split("\n\n", 1)
        assert instruction.startswith("Repeat the following text exactly") and p.output_len == 8
        assert len(passage) >= 600 and passage in corpus

    argv = ["--base-url", server.url, "--dataset-name", "repeat", "--output-len", "4", "--num-prompts", "2"]
    rc, result = run(tmp_path, *argv, "--endpoint", "/v1/chat/completions", "--save-detailed")
    assert rc == 0
    for r in requests_of(result):
        assert r["success"], r["error"]
        assert r["output_tokens"] == 4 and r["prompt_len"] > 150  # the passage plus the instruction and template
    assert latency.main([*argv, "--disable-tqdm"]) == 1  # /v1/completions


def test_sweep_then_plot_two_result_files(server, tmp_path):
    rc, result = run(
        tmp_path,
        "--base-url",
        server.url,
        "--sweep-concurrency",
        "1,2",
        "--num-prompts",
        "2",
        "--random-input-len",
        "8",
        "--random-output-len",
        "3",
        "--plot",
        str(tmp_path / "own.png"),
        name="pagoda.json",
    )
    assert rc == 0
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 2]
    assert all(r["metrics"]["completed"] == 2 for r in result["runs"])
    assert (tmp_path / "own.png").read_bytes().startswith(PNG_MAGIC)
    # A second server's sweep, as a separate run would have written it.
    other = {**result, "label": "vllm"}
    for r in other["runs"]:
        r["metrics"] = {**r["metrics"], "output_throughput": 2 * r["metrics"]["output_throughput"]}
    (tmp_path / "vllm.json").write_text(json.dumps(other))
    out = tmp_path / "plots" / "sweep.png"
    assert latency.main(["plot", str(tmp_path / "pagoda.json"), str(tmp_path / "vllm.json"), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


# ----- failures are failed requests, never a crash -----


def test_nothing_listening_reports_every_request_failed(tmp_path):
    rc, result = run(
        tmp_path,
        "--base-url",
        f"http://127.0.0.1:{_free_port()}",
        "--num-prompts",
        "5",
        "--max-concurrency",
        "2",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
    )
    assert rc == 1  # no request completed
    m = result["runs"][0]["metrics"]
    assert m["completed"] == 0 and m["failed"] == 5
    assert sum(result["runs"][0]["errors"].values()) == 5
    assert all("ConnectError" in error for error in result["runs"][0]["errors"])
    assert m["median_ttft_ms"] is None and m["output_throughput"] == 0


def test_server_killed_mid_run_counts_failed_requests(tmp_path):
    victim = start_server(
        tmp_path, "--max-model-len", "256", "--num-gpu-blocks-override", "64", "--disable-uvicorn-access-log"
    )
    outcome: dict = {}
    argv = [
        "--base-url",
        victim.url,
        "--num-prompts",
        "6",
        "--max-concurrency",
        "2",
        "--random-input-len",
        "8",
        "--random-output-len",
        "64",
        "--save-detailed",
        "--disable-tqdm",
        "--result-file",
        str(tmp_path / "killed.json"),
    ]
    client = threading.Thread(target=lambda: outcome.setdefault("rc", latency.main(argv)))
    try:
        client.start()
        # Kill once tokens are flowing, so some streams break mid-way and later requests find no server.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = httpx.get(f"{victim.url}/metrics", timeout=5).text
            if any(
                line.startswith("pagoda:generation_tokens_total") and float(line.split()[-1]) > 0
                for line in metrics.splitlines()
            ):
                break
            time.sleep(0.05)
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(30)
        client.join(120)
    finally:
        if victim.process.poll() is None:
            victim.process.kill()
    assert not client.is_alive()
    assert outcome["rc"] == 1  # nothing completed: each request needs 64 tokens, far more than had been made
    result = json.loads((tmp_path / "killed.json").read_text())
    m = result["runs"][0]["metrics"]
    assert m["completed"] + m["failed"] == 6 and m["failed"] == 6
    errors = [r["error"] for r in requests_of(result)]
    assert all(errors)
    assert any("ConnectError" in e for e in errors)  # issued after the kill
    assert any("ConnectError" not in e for e in errors)  # broken mid-stream


# ----- arrivals (no server) -----


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_inter_arrival_times_fit_their_distribution(burstiness):
    rate = 8.0
    gaps = np.fromiter(itertools.islice(latency.inter_arrival_times(rate, burstiness, seed=7), 20_000), float)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)  # the rate does not depend on burstiness
    if burstiness == 1.0:
        fit = stats.kstest(gaps, "expon", args=(0, 1 / rate))
    else:
        fit = stats.kstest(gaps, "gamma", args=(burstiness, 0, 1 / (rate * burstiness)))
        # ...and the test has the power to tell it from Poisson arrivals.
        assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue < 1e-6
    assert fit.pvalue > 0.01


def test_unbounded_rate_sends_everything_at_once():
    assert list(itertools.islice(latency.inter_arrival_times(float("inf"), 1.0), 5)) == [0.0] * 5


def test_metrics_follow_vllm_definitions():
    def result(ttft: float, e2el: float, tokens: int, itl: list[float]) -> latency.RequestResult:
        return latency.RequestResult(
            success=True,
            prompt_len=10,
            output_tokens=tokens,
            max_tokens=tokens,
            usage_reported=True,
            ttft=ttft,
            e2el=e2el,
            itl=itl,
        )

    results = [
        result(0.1, 1.1, 11, [0.1] * 10),
        result(0.3, 0.3, 1, []),
        result(0.2, 2.2, 5, [0.5] * 4),
        latency.RequestResult(error="ConnectError"),
    ]
    m = latency.compute_metrics(results, duration=4.0, goodput_slos={"ttft": 250, "tpot": 200})
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 17
    assert m["request_throughput"] == 0.75 and m["output_throughput"] == 17 / 4
    assert m["total_token_throughput"] == 47 / 4
    # TPOT only for requests of 2+ tokens: (1.1 - 0.1) / 10 and (2.2 - 0.2) / 4.
    assert m["mean_tpot_ms"] == pytest.approx(300) and m["median_tpot_ms"] == pytest.approx(300)
    assert m["mean_itl_ms"] == pytest.approx(1000 * (10 * 0.1 + 4 * 0.5) / 14)
    assert m["median_ttft_ms"] == pytest.approx(200) and m["p99_e2el_ms"] == pytest.approx(2178)
    # Goodput: the first (ttft 100, tpot 100) and the 1-token one (its TPOT counts as 0, ttft 300 > 250: no).
    assert m["good_requests"] == 1 and m["request_goodput"] == 0.25
