"""Corrupted checkpoints: each corruption a user can cause ends start-up with ModelLoadError, one line that
names the file and the problem; `pagoda serve` prints that line and exits 1, with no traceback.

Each case corrupts a copy of a tiny random checkpoint (tests/conftest.py) that carries the default model's
tokenizer files, so the tokenizer's files can be broken too."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from engine.loader import ModelLoadError
from tests.conftest import KV_BYTES

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


@pytest.fixture
def model_copy(tmp_path, tiny_model_dir, default_model_dir):
    """A fresh copy of the tiny sharded llama checkpoint, with the default model's tokenizer files."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), path)
    for name in _TOKENIZER_FILES:
        if (Path(default_model_dir) / name).is_file():
            shutil.copy(Path(default_model_dir) / name, path / name)
    return path


def _load(path: Path, **kwargs) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES, **kwargs)


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def _shard_of(path: Path, tensor: str) -> Path:
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _rewrite(shard: Path, change) -> None:
    """Rewrite one shard with change(tensors) applied (a dict of name -> tensor, changed in place)."""
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _truncate(path: Path) -> Path:
    shard = _shards(path)[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard


def _garbage(path: Path) -> Path:
    shard = _shards(path)[-1]
    shard.write_bytes(b"\x93\x01garbage" * 1000)
    return shard


def _missing_shard(path: Path) -> Path:
    shard = _shards(path)[1]
    shard.unlink()
    return shard


def _broken_index(path: Path) -> Path:
    index = path / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    return index


def _index_without_map(path: Path) -> Path:
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    return index


def _no_weights(path: Path) -> Path:
    (path / "model.safetensors.index.json").unlink()
    for shard in _shards(path):
        shard.unlink()
    return path


def _wrong_shape(path: Path) -> Path:
    # [1, hidden] would broadcast into [vocab, hidden] if shapes were not compared.
    name = "model.embed_tokens.weight"
    shard = _shard_of(path, name)
    _rewrite(shard, lambda t: t.__setitem__(name, t[name][:1].clone()))
    return shard


def _wrong_fused_shape(path: Path) -> Path:
    name = "model.layers.0.self_attn.k_proj.weight"
    shard = _shard_of(path, name)
    _rewrite(shard, lambda t: t.__setitem__(name, t[name][:, :-8].clone()))
    return shard


def _wrong_dtype(path: Path) -> Path:
    name = "model.layers.1.mlp.down_proj.weight"
    shard = _shard_of(path, name)
    _rewrite(shard, lambda t: t.__setitem__(name, t[name].to(torch.int32)))
    return shard


def _missing(name: str):
    def corrupt(path: Path) -> Path:
        _rewrite(_shard_of(path, name), lambda t: t.pop(name))
        index = path / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        del data["weight_map"][name]
        index.write_text(json.dumps(data))
        return path

    return corrupt


def _config_contradicts(path: Path) -> Path:
    config = path / "config.json"
    data = json.loads(config.read_text())
    data["intermediate_size"] *= 2
    config.write_text(json.dumps(data))
    return _shard_of(path, "model.layers.0.mlp.down_proj.weight")


def _config_missing_key(path: Path) -> Path:
    config = path / "config.json"
    data = json.loads(config.read_text())
    del data["hidden_size"]
    config.write_text(json.dumps(data))
    return config


def _kv_scale_past_the_layers(path: Path) -> Path:
    name = "model.layers.0.self_attn.k_proj.weight"
    shard = _shard_of(path, name)
    _rewrite(shard, lambda t: t.__setitem__("model.layers.99.self_attn.k_scale", torch.tensor(1.0)))
    return shard


def _invalid_json(name: str):
    def corrupt(path: Path) -> Path:
        (path / name).write_text('{"oops": ')
        return path / name

    corrupt.__name__ = f"invalid {name}"
    return corrupt


def _missing_tokenizer_json(path: Path) -> Path:
    # tokenizer_config.json says there is a tokenizer; its vocabulary is gone.
    (path / "tokenizer.json").unlink()
    return path


CORRUPTIONS = {
    "truncated shard": (_truncate, "safetensors"),
    "garbage shard": (_garbage, "safetensors"),
    "missing shard": (_missing_shard, "missing"),
    "broken index": (_broken_index, "invalid JSON"),
    "index without weight_map": (_index_without_map, "weight_map"),
    "no weights": (_no_weights, "no *.safetensors"),
    "shape contradicts config": (_wrong_shape, "shape"),
    "fused shape contradicts config": (_wrong_fused_shape, "shape"),
    "config contradicts shapes": (_config_contradicts, "shape"),
    "integer weights": (_wrong_dtype, "int32"),
    "missing tensor": (_missing("model.layers.1.post_attention_layernorm.weight"), "lacks 1 tensors"),
    "missing shard of a fused linear": (_missing("model.layers.1.self_attn.k_proj.weight"), "k_proj.weight"),
    "config lacks a size": (_config_missing_key, "hidden_size"),
    "invalid config.json": (_invalid_json("config.json"), "invalid JSON"),
    "invalid generation_config.json": (_invalid_json("generation_config.json"), "invalid JSON"),
    "invalid tokenizer.json": (_invalid_json("tokenizer.json"), "invalid JSON"),
    "invalid tokenizer_config.json": (_invalid_json("tokenizer_config.json"), "invalid JSON"),
    "missing tokenizer.json": (_missing_tokenizer_json, "tokenizer"),
    "k_scale of a layer past config.json's": (_kv_scale_past_the_layers, "layers.99.self_attn.k_scale"),
    "invalid quantize_config.json": (_invalid_json("quantize_config.json"), "invalid JSON"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_is_one_line_naming_the_file(model_copy, case):
    corrupt, problem = CORRUPTIONS[case]
    culprit = corrupt(model_copy)
    with pytest.raises(ModelLoadError) as info:
        _load(model_copy)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(culprit)), message
    assert problem in message, message


def test_tokenizer_directory_without_tokenizer(model_copy, tiny_model_dir):
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        _load(model_copy, tokenizer=str(tiny_model_dir("qwen2")))


def test_intact_copy_loads(model_copy):
    # The copies above fail for their corruption, not for being copies.
    llm = _load(model_copy)
    assert llm.tokenizer is not None


def _serve(model: Path) -> subprocess.CompletedProcess:
    pagoda = Path(sys.executable).with_name("pagoda")
    cmd = [str(pagoda), "serve", str(model), "--port", "0", "--dtype", "float32", "--device", "cpu"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["truncated shard", "invalid tokenizer.json"])
def test_serve_prints_one_line_and_exits_1(model_copy, case):
    corrupt, problem = CORRUPTIONS[case]
    culprit = corrupt(model_copy)
    done = _serve(model_copy)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"pagoda serve: {culprit}"), done.stderr[-3000:]
    assert problem in last


def test_building_the_model_runs_no_random_initializer(tiny_model_dir):
    """load_model overwrites every parameter (from the checkpoint, or _init_dummy), so building the modules
    runs none of torch.nn.init's random fills (nn.Linear's kaiming_uniform_, nn.Embedding's normal_); what
    the model holds is the checkpoint's, and it still computes what transformers computes (test_correctness)."""
    from torch.overrides import TorchFunctionMode

    from engine.loader import load_model

    called: list[str] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            called.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    path = tiny_model_dir("llama")
    with Record():
        model, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert "Linear" in {type(m).__name__ for m in model.modules()}  # the modules that would have filled
    fills = {"uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "trunc_normal_"}
    assert not fills & set(called)
    checkpoint = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        checkpoint |= load_file(file)
    assert torch.equal(model.embed_tokens.weight, checkpoint["model.embed_tokens.weight"])
    assert torch.equal(model.norm.weight, checkpoint["model.norm.weight"])
    down = model.layers[1].mlp.down_proj.weight
    assert torch.equal(down, checkpoint["model.layers.1.mlp.down_proj.weight"])


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
@pytest.mark.parametrize(
    "case", ["missing tensor", "missing shard of a fused linear", "fused shape contradicts config", "integer weights"]
)
def test_corruption_under_load_time_quantization(model_copy, case, quantization):
    """`--quantization fp8 / int8` quantizes each linear as the checkpoint fills it: a tensor missing, of the
    wrong shape or of the wrong kind is still refused by name, never quantized from unfilled memory."""
    corrupt, problem = CORRUPTIONS[case]
    culprit = corrupt(model_copy)
    with pytest.raises(ModelLoadError) as info:
        _load(model_copy, quantization=quantization)
    message = str(info.value)
    assert message.startswith(str(culprit)) and problem in message, message


def test_fused_names_map_both_ways():
    """The one mapping between a checkpoint's per-projection names and the model's fused layers: every shard of a
    fused parameter maps back to it with its index, in order; other names map to themselves."""
    from engine.models.llama import LlamaForCausalLM
    from engine.models.qwen3 import Qwen3ForCausalLM

    for cls in (LlamaForCausalLM, Qwen3ForCausalLM):
        assert cls.shard_names("layers.3.self_attn.qkv_proj.weight") == [
            f"layers.3.self_attn.{p}_proj.weight" for p in "qkv"
        ]
        assert cls.shard_names("layers.3.mlp.gate_up_proj.bias") == [
            "layers.3.mlp.gate_proj.bias",
            "layers.3.mlp.up_proj.bias",
        ]
        assert cls.shard_names("layers.3.mlp.gate_up_proj") == ["layers.3.mlp.gate_proj", "layers.3.mlp.up_proj"]
        for fused in ("layers.0.self_attn.qkv_proj.weight", "layers.11.mlp.gate_up_proj.weight"):
            assert [cls.fused_name(n) for n in cls.shard_names(fused)] == [
                (fused, i) for i in range(len(cls.shard_names(fused)))
            ]
        for plain in (
            "layers.0.self_attn.o_proj.weight",
            "embed_tokens.weight",
            "layers.2.mlp.down_proj",
            "norm.weight",
        ):
            assert cls.fused_name(plain) is None and cls.shard_names(plain) == [plain]
        # A name that only contains a projection's name as a substring is not a shard of it.
        assert cls.fused_name("layers.0.self_attn.q_proj_extra.weight") is None


def test_a_checkpoint_load_holds_one_tensor_beyond_the_model(tmp_path):
    """Reading a bf16 checkpoint into a bf16 model on the CPU: the load peaks at the model plus the largest tensor
    being copied in, not two (the embedding and the LM head are the largest, and read one after the other)."""
    from bench.gpu_check import write_random_checkpoint
    from bench.live_bytes import LiveBytes
    from engine.loader import load_model

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }  # fmt: skip
    write_random_checkpoint(config, tmp_path, "cpu")
    with LiveBytes() as watch:
        model, _ = load_model(str(tmp_path), torch.bfloat16, torch.device("cpu"))
    largest = 8192 * 64 * 2  # the embedding's (and the LM head's) bytes in bf16
    kept = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert watch.live >= kept
    assert watch.peak - watch.live < 1.5 * largest, (watch.peak, watch.live)
