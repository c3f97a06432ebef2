"""Checkpoints the quantizing tools themselves wrote from the default model, served by pagoda and checked against
the tool's own reading of them: llm-compressor (compressed-tensors), GPTQModel (GPTQ) and AutoAWQ (AWQ).

Each tool pins a torch or transformers that pagoda's environment does not take, so bench/tool_checkpoints.sh runs
each in a venv of its own and caches what it writes under $PAGODA_CACHE (minutes the first time, mostly the
tools' installs and GPTQ's calibration; nothing the second). The slow tier: the first run needs PyPI.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from engine.default_model import cache_dir

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
OTHER = list(range(100, 160))
GPTQMODEL = ["gptq-w4g64", "gptq-w4g32-actorder-asym", "gptq-w8g-1"]
AUTOAWQ = ["awq-w4g64"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def tool_checkpoints(default_model_dir) -> Path:
    """$PAGODA_CACHE, where bench/tool_checkpoints.sh has left every tool's checkpoints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tools' own Triton, untouched
    log = cache_dir() / "tool-checkpoints.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        done = subprocess.run(
            ["bash", str(ROOT / "bench" / "tool_checkpoints.sh"), str(default_model_dir)],
            stdout=out, stderr=subprocess.STDOUT, env=env, timeout=3600,
        )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(
            f"bench/tool_checkpoints.sh exited with {done.returncode}; its log, {log}:\n{log.read_text()[-4000:]}"
        )
    return cache_dir()


def _chat_prompt(path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok(tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True))["input_ids"]


def _llm(path):
    from engine.llm import LLM

    return LLM(model=str(path), device="cpu", dtype="float32", max_model_len=256, cpu_kv_cache_bytes=32 << 20)


def _hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("name", ["w4a16-g64-rtn", "w8a16"])
def test_llmcompressor_weight_only_matches_transformers_on_the_same_checkpoint(name, tool_checkpoints):
    """Logits within float32 rounding of transformers' (compressed-tensors decompressing the packed weights)
    and the same greedy tokens."""
    from bench.quant_ppl import prompt_logits
    from tests.test_greedy_equality import hf_greedy, pagoda_greedy

    path = tool_checkpoints / "llmcompressor" / name
    ours = prompt_logits(_llm(path), OTHER)
    ref = _hf_logits(path, OTHER)
    assert (ours - ref).norm() / ref.norm() < 1e-4
    prompts = [_chat_prompt(path), OTHER]
    expected = hf_greedy(path, prompts, 16)
    got, _ = pagoda_greedy(path, prompts, 16, {"max_model_len": 256}, alone=False)
    assert got == expected


@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-fp8", "w8a8-int8-sq"])
def test_llmcompressor_w8a8_stays_close_to_full_precision(name, default_model_dir, tool_checkpoints):
    """W8A8 (weights and per-token activations in 8 bits) logits on real text stay near the float32 model's."""
    from transformers import AutoTokenizer

    from bench.quant_ppl import TEXT, prompt_logits

    ids = AutoTokenizer.from_pretrained(default_model_dir)(TEXT.read_text()[:2000])["input_ids"][:128]
    ours = prompt_logits(_llm(tool_checkpoints / "llmcompressor" / name), ids)
    full = prompt_logits(_llm(default_model_dir), ids)
    assert (ours - full).norm() / full.norm() < 0.1
    assert (ours.argmax(-1) == full.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize(("tool", "name"), [("gptqmodel", n) for n in GPTQMODEL] + [("autoawq", n) for n in AUTOAWQ])
def test_tool_checkpoint_matches_the_tools_own_reading(tool, name, tool_checkpoints):
    """Logits within float32 rounding of the float32 weights the tool itself dequantizes its packed tensors to
    (its own unpacking: bit order, zero points, act-order groups), and the greedy tokens the tool's kernels give
    through transformers."""
    from bench.quant_ppl import prompt_logits
    from tests.test_greedy_equality import pagoda_greedy

    path = tool_checkpoints / tool / name
    record = json.loads((tool_checkpoints / tool / f"{name}.tool.json").read_text())
    ours = prompt_logits(_llm(path), OTHER)
    ref = _hf_logits(tool_checkpoints / tool / f"{name}-dequantized", OTHER)
    assert (ours - ref).norm() / ref.norm() < 1e-4
    got, _ = pagoda_greedy(path, record["prompts"], len(record["greedy"][0]), {"max_model_len": 256}, alone=False)
    assert got == record["greedy"], f"pagoda's greedy tokens differ from {record['tool']}'s"


@pytest.mark.parametrize(("tool", "name", "describes"), [
    ("gptqmodel", "gptq-w4g32-actorder-asym", "gptq (gptq format, 4-bit, group 32, sym=False, desc_act=True)"),
    ("autoawq", "awq-w4g64", "awq (gemm layout, 4-bit, group 64)"),
])  # fmt: skip
def test_server_serves_a_tool_checkpoint_through_the_openai_sdk(tool, name, describes, tool_checkpoints, tmp_path):
    """`pagoda serve` of the tool's checkpoint answers the chat question with the tool's greedy tokens, and names
    the scheme it read from the checkpoint at start."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    from tests.test_server import start_server

    path = tool_checkpoints / tool / name
    record = json.loads((tool_checkpoints / tool / f"{name}.tool.json").read_text())
    tok = AutoTokenizer.from_pretrained(path)
    assert record["prompts"][0] == _chat_prompt(path)
    answer = record["greedy"][0][:12]
    if tok.eos_token_id in answer:
        answer = answer[: answer.index(tok.eos_token_id)]
    server = start_server(tmp_path, "--model", str(path), "--max-model-len", "512")
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=QUESTION, max_tokens=12, temperature=0.0
        )
        assert reply.choices[0].message.content == tok.decode(answer)
        assert f"quantization: {describes}" in server.log()
    finally:
        assert server.stop() == 0
