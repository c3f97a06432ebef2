"""bench/throughput.py at toy sizes on the CPU: the sweep's CSV and plots, vLLM's absence, the single-point mode."""

from __future__ import annotations

import csv
import json
import sys

import pytest
import torch

from bench import naming, throughput

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sweep(tiny_model_dir, tmp_path_factory):
    """One tiny sweep for pagoda and transformers, vLLM listed but not importable."""
    out = tmp_path_factory.mktemp("sweep")
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, whether or not it is installed
    try:
        rc = throughput.main(
            [
                "--model",
                str(tiny_model_dir("llama")),
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--load-format",
                "dummy",
                "--engines",
                "pagoda,transformers,vllm",
                "--batch-sizes",
                "1,2",
                "--input-lens",
                "8",
                "--output-lens",
                "4,300",
                "--csv",
                str(out / "sweep.csv"),
                "--plot-dir",
                str(out / "plots"),
            ]
        )
    finally:
        mp.undo()
    return rc, out


def test_sweep_writes_one_csv_row_per_engine_and_point(sweep, capsys):
    rc, out = sweep
    assert rc == 0
    with open(out / "sweep.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == throughput.CSV_COLUMNS
        rows = list(reader)
    # output 300 is past the tiny model's 256 positions: skipped, so batch {1, 2} x in 8 x out 4 per engine.
    assert sorted((r["engine"], int(r["batch_size"])) for r in rows) == [
        ("pagoda", 1),
        ("pagoda", 2),
        ("transformers", 1),
        ("transformers", 2),
    ]
    for r in rows:
        assert (int(r["input_len"]), int(r["output_len"]), r["dtype"], r["device"]) == (8, 4, "float32", "cpu")
        assert int(r["output_tokens"]) == int(r["batch_size"]) * 4  # EOS ignored: every engine does all the work
        for column in ("elapsed_s", "output_tok_s", "total_tok_s"):
            assert float(r[column]) > 0
        assert float(r["total_tok_s"]) > float(r["output_tok_s"])
        assert r["engine_version"] and r["model"] and r["date"] and r["command"]


def test_sweep_writes_throughput_and_ratio_plots(sweep):
    _, out = sweep
    names = sorted(p.name for p in (out / "plots").iterdir())
    assert names == ["ratio.png", "throughput-out4.png"]
    for name in names:
        data = (out / "plots" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_missing_vllm_is_reported_and_skipped(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)
    rc = throughput.main(
        [
            "--model",
            str(tiny_model_dir("llama")),
            "--device",
            "cpu",
            "--engines",
            "vllm",
            "--batch-sizes",
            "1",
            "--input-lens",
            "8",
            "--output-lens",
            "4",
            "--csv",
            str(tmp_path / "v.csv"),
            "--plot-dir",
            str(tmp_path / "plots"),
        ]
    )
    assert rc == 0
    assert "vllm: skipped, cannot import vllm" in capsys.readouterr().out
    assert (tmp_path / "v.csv").read_text().strip() == ",".join(throughput.CSV_COLUMNS)  # header only
    assert not (tmp_path / "plots").exists()


def test_single_point_mode_appends_json_lines(tiny_model_dir, tmp_path):
    out = tmp_path / "point.jsonl"
    argv = [
        "--model",
        str(tiny_model_dir("llama")),
        "--device",
        "cpu",
        "--engines",
        "pagoda,transformers",
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--out",
        str(out),
    ]
    assert throughput.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["pagoda", "transformers"]
    assert all(r["output_tokens"] == 8 and r["output_tok_s"] > 0 and r["num_prompts"] == 2 for r in rows)


def test_single_point_len_range_runs_pagoda_only(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))  # no --out: the default file goes into $OUT
    argv = [
        "--model",
        str(tiny_model_dir("llama")),
        "--device",
        "cpu",
        "--engines",
        "pagoda,transformers",
        "--num-prompts",
        "3",
        "--len-range",
        "2,6",
    ]
    assert throughput.main(argv) == 0
    assert "transformers: skipped" in capsys.readouterr().out
    (out,) = tmp_path.glob(f"*-cpu-{naming.short_commit()}-throughput.jsonl")
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    _, output_lens = throughput.ranged_workload(3, 2, 6, 512, 0)
    assert row["engine"] == "pagoda" and row["output_tokens"] == sum(output_lens)


def test_results_go_outside_the_repository_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    path = naming.results_path("throughput", "cpu")
    assert path.startswith("bench-results/") and path.endswith(f"-cpu-{naming.short_commit()}-throughput.jsonl")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert naming.results_path("sweep-x", "cpu", "csv").startswith(str(tmp_path / "out") + "/")


def test_single_point_and_sweep_flags_do_not_mix():
    with pytest.raises(SystemExit):
        throughput.main(["--num-prompts", "2", "--batch-sizes", "1"])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_transformers_dummy_weights_are_pagodas(tiny_model_dir, arch):
    """The transformers model gets exactly the values pagoda's dummy loader draws (fused q/k/v, gate/up split)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.loader import load_model

    model_dir = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    throughput.copy_pagoda_dummy_weights(hf, str(model_dir), torch.float32, "cpu", seed=7)
    expected, _ = load_model(model_dir, torch.float32, torch.device("cpu"), "dummy", seed=7)
    # Load the transformers tensors through pagoda's own checkpoint path into a model drawn with another seed.
    loaded, _ = load_model(model_dir, torch.float32, torch.device("cpu"), "dummy", seed=99)
    params = dict(loaded.named_parameters())
    for name, tensor in hf.state_dict().items():
        loaded.load_weight(name, tensor, params)
    for name, param in expected.named_parameters():
        assert torch.equal(param, dict(loaded.named_parameters())[name]), name
