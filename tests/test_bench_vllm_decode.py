"""bench/vllm_decode.py, the W4A16 decode comparison with vLLM, on the CPU: its measure (the difference of two
generate() lengths) over a real pagoda engine, and the `all` driver's rows for engines whose process fails (the
GPU runs themselves need an H100 and vLLM's staged site)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import vllm_decode
from engine import LLM, SamplingParams
from tests.conftest import KV_BYTES


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES)


def test_difference_step_times_over_a_real_engine(llama):
    calls = []

    def generate(prompts, n):
        calls.append(n)
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return sum(len(r.outputs[0].token_ids) for r in llama.generate(prompts, params, use_tqdm=False))

    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5]
    steps = vllm_decode.difference_step_times(generate, prompts, 4, 84, 3)
    assert calls == [4, 4, 84, 4, 84, 4, 84]  # a warm-up, then the pairs interleaved
    # Eighty more decode steps take longer than none: each repeat's difference is a step time (under a second),
    # and their median positive (one repeat alone can come out below zero on a busy 2-core host, where a tiny
    # model's step is a fraction of a millisecond).
    assert len(steps) == 3 and all(abs(s) < 1 for s in steps) and sorted(steps)[1] > 0

    def stops_early(prompts, n):
        params = SamplingParams(temperature=0.0, max_tokens=min(n, 8), ignore_eos=True)
        return sum(len(r.outputs[0].token_ids) for r in llama.generate(prompts, params, use_tqdm=False))

    with pytest.raises(RuntimeError, match="16 tokens produced, not 2 x 20"):
        vllm_decode.difference_step_times(stops_early, prompts, 4, 20, 1)


def test_all_records_a_failed_engine_process(tmp_path, monkeypatch):
    """vLLM is not installed here: each of its runs fails in its own process at `import vllm` and leaves a row
    with its error and the end of its output; the W4A16 runs were given the GPTQ g128 copy of the config."""
    monkeypatch.setenv("VB_SITE", str(tmp_path / "no-site"))
    out = tmp_path / "rows.jsonl"
    argv = ["all", "--engines", "vllm", "--out", str(out), "--repeats", "1", "--timeout", "120"]
    assert vllm_decode.main(argv) == 1
    every = [json.loads(line) for line in out.read_text().splitlines()]
    rows = [r for r in every if r["mode"] == "vllm-decode"]
    assert [r["kind"] for r in rows] == ["bf16", "w4a16-g128", "w4a16-g128-marlin"]
    # beside each run, what its output said about loading (nothing here: it failed at the import)
    logs = [r for r in every if r["mode"] == "vllm-decode-log"]
    assert [(r["engine"], r["kind"]) for r in logs] == [("vllm", r["kind"]) for r in rows]
    assert all(isinstance(r["lines"], list) for r in logs)
    for r in rows:
        assert r["engine"] == "vllm" and r["error"] == "exit 1" and r["commit"]
        assert "No module named 'vllm'" in r["tail"]
    assert "/bench/configs/llama3-8b " in rows[0]["command"]
    models = {r["command"].split("--model ")[1].split()[0] for r in rows[1:]}
    assert len(models) == 1 and "llama3-8b-gptq-w4g128-" in models.pop()  # one copy for both W4A16 kernels
    assert not any(Path(r["command"].split("--model ")[1].split()[0]).exists() for r in rows[1:])  # removed
    model = vllm_decode.model_dirs()["w4a16-g128"]
    q = json.loads((Path(model) / "config.json").read_text())["quantization_config"]
    shutil.rmtree(model)
    assert (q["quant_method"], q["bits"], q["group_size"], q["sym"], q["desc_act"]) == ("gptq", 4, 128, True, False)
    # A run past --timeout is killed (with its process group) and says so.
    argv = ["all", "--engines", "vllm", "--kinds", "bf16", "--out", str(out), "--timeout", "0.2"]
    assert vllm_decode.main(argv) == 1
    assert json.loads(out.read_text().splitlines()[-1])["error"] == "past --timeout 0.2 s"
    with pytest.raises(SystemExit, match="--long must exceed --short"):
        vllm_decode.main(["one", "--short", "8", "--long", "8"])
    with pytest.raises(SystemExit, match="vLLM kernel choice"):
        vllm_decode.main(["one", "--engine", "pagoda", "--kind", "w4a16-g128-marlin", "--model", "/m"])


def test_summary_table():
    def row(engine, kind, batch, tok_s):
        return {"mode": "vllm-decode", "engine": engine, "kind": kind, "batch": batch, "tok_s": tok_s}

    rows = [row("pagoda", "w4a16-g128", 1, 300.0), row("vllm", "w4a16-g128", 1, 250.0)]
    rows += [row("vllm", "w4a16-g128-marlin", 1, 200.0), row("pagoda", "bf16", 16, 1600.0)]
    rows += [{"mode": "vllm-decode", "engine": "vllm", "kind": "bf16", "error": "exit 1"}]
    lines = vllm_decode.summarize(rows).splitlines()
    assert "| 1 | w4a16-g128 | 300.0 | 250.0 | 200.0 | 1.200 | 1.500 |" in lines
    assert "| 16 | bf16 | 1600.0 | - | - | - | - |" in lines
    assert "- vllm bf16: exit 1" in lines
