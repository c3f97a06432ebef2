"""bench/gpu_check.py load-memory: the random bf16 checkpoint it writes loads as the architecture's own (every
tensor named and shaped as transformers names them), and the mode runs end to end on the CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_random_checkpoint_is_a_complete_llama(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from bench.gpu_check import write_random_checkpoint
    from engine.loader import load_model

    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    write_random_checkpoint(config, tmp_path / "ckpt", "cpu")
    model, _ = load_model(tmp_path / "ckpt", torch.float32, torch.device("cpu"))  # a missing tensor would raise
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    assert torch.equal(model.layers[1].mlp.down_proj.weight, reference.model.layers[1].mlp.down_proj.weight)
    assert 0.015 < model.layers[0].self_attn.qkv_proj.weight.std() < 0.025


@pytest.mark.parametrize("checkpoint", ["its own", "random"])
def test_load_memory_mode_runs_on_the_cpu(tiny_model_dir, tmp_path, checkpoint):
    """The mode end to end on the CPU: the peaks counted by bench/live_bytes.py, a directory's own checkpoint read
    when it has one, a random one written for a config alone."""
    model = tiny_model_dir("llama")
    if checkpoint == "random":
        (tmp_path / "config").mkdir()
        shutil.copy(model / "config.json", tmp_path / "config" / "config.json")
        model = tmp_path / "config"
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "bench/gpu_check.py", "load-memory", "--load-model", str(model),
           "--load-device", "cpu", "--load-layers", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    read = "random checkpoint" if checkpoint == "random" else "checkpoint"
    assert [(r["load"], r["kind"]) for r in rows] == [
        *(("dummy", k) for k in ["bf16", "w8a16", "w4a16-g128", "fp8", "w8a8-int8"]),
        *((read, k) for k in ["bf16", "fp8", "int8"]),
    ]
    kept = {(r["load"], r["kind"]): r["kept_bytes"] for r in rows}
    assert kept[read, "fp8"] < kept[read, "bf16"]  # fp8 weights are smaller than bf16 ones
    assert all(r["kept_bytes"] > 0 and r["peak_bytes"] >= r["kept_bytes"] for r in rows)
    layers = json.loads((tiny_model_dir("llama") / "config.json").read_text())["num_hidden_layers"]
    assert {r["layers"] for r in rows if r["load"] == read} == {1 if checkpoint == "random" else layers}
