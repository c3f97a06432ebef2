"""Checkpoints llm-compressor itself wrote from the default model (bench/llmcompressor_checkpoints.py), served by
pagoda and checked against transformers loading the same files through compressed-tensors.

llm-compressor pins transformers<=5.17, so it runs in a venv of its own and leaves its checkpoints in
$PAGODA_CACHE/llmcompressor/; where they are not there the tests skip and say how to make them.
"""

from __future__ import annotations

import pytest
import torch

from engine.default_model import cache_dir

OTHER = list(range(100, 160))


def _chat_prompt(path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))["input_ids"]


def _tool_checkpoint(name: str):
    path = cache_dir() / "llmcompressor" / name
    if not (path / "model.safetensors").is_file():
        pytest.skip(
            f"no {path}: run bench/llmcompressor_checkpoints.py in llm-compressor's venv (its docstring says how)"
        )
    return path


def _llm(path):
    from engine.llm import LLM

    return LLM(model=str(path), device="cpu", dtype="float32", max_model_len=256, cpu_kv_cache_bytes=32 << 20)


@pytest.mark.parametrize("name", ["w4a16-g64-rtn", "w4a16-g64-gptq"])
def test_llmcompressor_w4a16_matches_transformers_on_the_same_checkpoint(name):
    """Logits within float32 rounding of transformers' (compressed-tensors decompressing the packed weights)
    and the same greedy tokens."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM

    from bench.quant_ppl import prompt_logits
    from tests.test_greedy_equality import hf_greedy, pagoda_greedy

    path = _tool_checkpoint(name)
    llm = _llm(path)
    ours = prompt_logits(llm, OTHER)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([OTHER])).logits[0]
    assert (ours - ref).norm() / ref.norm() < 1e-4
    prompts = [_chat_prompt(path), OTHER]
    expected = hf_greedy(path, prompts, 16)
    got, _ = pagoda_greedy(path, prompts, 16, {"max_model_len": 256}, alone=False)
    assert got == expected


@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-fp8", "w8a8-int8-sq"])
def test_llmcompressor_w8a8_stays_close_to_full_precision(name, default_model_dir):
    """W8A8 (weights and per-token activations in 8 bits) logits on real text stay near the float32 model's."""
    from transformers import AutoTokenizer

    from bench.quant_ppl import TEXT, prompt_logits

    ids = AutoTokenizer.from_pretrained(default_model_dir)(TEXT.read_text()[:2000])["input_ids"][:128]
    ours = prompt_logits(_llm(_tool_checkpoint(name)), ids)
    full = prompt_logits(_llm(default_model_dir), ids)
    assert (ours - full).norm() / full.norm() < 0.1
    assert (ours.argmax(-1) == full.argmax(-1)).float().mean() > 0.8
