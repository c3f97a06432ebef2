"""`pagoda serve` of quantized checkpoints through the openai SDK, and the start-up error for one it cannot serve."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import quant_checkpoints
from engine.default_model import cache_dir
from tests.test_server import start_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gptq_default_model(default_model_dir) -> Path:
    """The default model as a 4-bit GPTQ checkpoint (groups of 128, auto-gptq's format), cached."""
    path = cache_dir() / "quant-checkpoints" / Path(default_model_dir).name / "gptq-w4g128"
    if not (path / "model.safetensors").is_file():
        quant_checkpoints.write(default_model_dir, path, quant_checkpoints.RECIPES["gptq-w4g128"])
    return path


def test_server_serves_a_gptq_checkpoint_through_the_openai_sdk(gptq_default_model, tmp_path):
    """The chat answer is transformers' greedy answer on the weights the checkpoint dequantizes to."""
    from openai import OpenAI
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_dir = gptq_default_model / "reference"
    tok = AutoTokenizer.from_pretrained(ref_dir)
    ids = tok(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True), return_tensors="pt")
    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    expected = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)

    server = start_server(tmp_path, "--model", str(gptq_default_model), "--max-model-len", "512")
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=QUESTION, max_tokens=20, temperature=0.0
        )
        assert reply.choices[0].message.content == expected
        assert "quantization: gptq (gptq format, 4-bit, group 128" in server.log()
    finally:
        assert server.stop() == 0


def test_server_refuses_an_unsupported_quantization_at_start(default_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(default_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 3, "group_size": 128}
    (model / "config.json").write_text(json.dumps(config))
    pagoda = Path(sys.executable).with_name("pagoda")
    done = subprocess.run(
        [str(pagoda), "serve", "--model", str(model), "--port", "0", "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "bits=3" in line]
    assert lines and "supported: bits 4/8" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


# Checkpoint recipe (written from the default model by bench/quant_checkpoints.py) or a --quantization at load, and
# the scheme the start-up log names.
SERVED = {
    "awq-w4g128": ("awq (gemm layout, 4-bit, group 128)", []),
    "ct-w4a16-g128": ("compressed-tensors W4A16 (group 128)", []),
    "ct-w8a16-channel": ("compressed-tensors W8A16 (channel)", []),
    "ct-w8a8-int8": ("compressed-tensors W8A8 int8 (dynamic per-token activations)", []),
    "ct-w8a8-fp8-static": ("compressed-tensors W8A8 fp8 (static activations)", []),
    "fp8 at load": ("fp8 (E4M3 per-channel weights made at load", ["--quantization", "fp8"]),
    "int8 at load": ("int8 (weight-only, per-channel, made at load)", ["-q", "int8"]),
}


@pytest.mark.parametrize("case", list(SERVED))
def test_server_serves_every_scheme_through_the_openai_sdk(case, default_model_dir, tmp_path):
    """Each of the other checkpoint schemes and both load-time ones: `pagoda serve` names the scheme at start and
    answers the chat question, streamed and not, with the greedy tokens the offline engine gives on the same
    checkpoint (whose agreement with transformers the checkpoint tests check)."""
    from openai import OpenAI

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    describes, flags = SERVED[case]
    path = Path(default_model_dir)
    if case in quant_checkpoints.RECIPES:
        path = cache_dir() / "quant-checkpoints" / path.name / case
        if not (path / "model.safetensors").is_file():
            quant_checkpoints.write(default_model_dir, path, quant_checkpoints.RECIPES[case])
    quantization = flags[1] if flags else None
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=512, quantization=quantization)
    expected = llm.chat([QUESTION], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)[0].outputs[0].text
    del llm
    server = start_server(tmp_path, "--model", str(path), "--max-model-len", "512", *flags)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0.0)
        assert reply.choices[0].message.content == expected and expected.strip()
        stream = client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=12, temperature=0.0, stream=True
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == expected
        assert f"quantization: {describes}" in server.log()
    finally:
        assert server.stop() == 0
