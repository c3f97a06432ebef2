"""Find a model's Hugging Face directory, and build the model from it: safetensors weights or dummy (random) ones."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.attention import AttentionBackend
from engine.models import model_class
from engine.quant import QuantScheme, detect_scheme, quantize_linears

log = logging.getLogger("pagoda.loader")


def resolve_model_dir(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """A directory as given; anything else is looked up as a model id in the local Hugging Face cache."""
    if Path(model).is_dir():
        return model
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except Exception:  # not a valid id, or not downloaded: both mean the same to the user
        where = f" ({cache_dir})" if cache_dir else ""
        at = f" at revision {revision}" if revision else ""
        raise FileNotFoundError(
            f"{model} is neither a model directory nor a model in the local Hugging Face cache{where}{at} "
            "(pagoda does not download models)"
        ) from None


def read_hf_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


def head_dim_of(hf_config: dict) -> int:
    """The attention head size a HF config.json gives, or implies."""
    return hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    backend: AttentionBackend | None = None,
    quantization: str | None = None,
) -> tuple[nn.Module, dict]:
    """The model on `device` in `dtype`, its layers calling `backend` (default: the torch reference),
    and its HF config.

    Parameters are allocated on the device first, then each checkpoint tensor is read from its
    memory-mapped file straight to the device and copied in, so the host never holds the model.
    A quantized checkpoint (or `quantization`, EngineConfig's) swaps its linears for the scheme's
    modules (engine/quant) once the tensors are read.
    """
    hf_config = read_hf_config(model_dir)
    cls = model_class(hf_config)
    scheme = detect_scheme(hf_config, model_dir, quantization)
    if scheme is not None:
        log.info("quantization: %s", scheme.describe())
        if load_format == "dummy" and scheme.marker is not None:
            raise ValueError(f"dummy weights cannot stand for a {scheme.name} checkpoint's packed tensors")
    with _default_dtype(dtype), torch.device(device):
        model = cls(hf_config, backend)
    if load_format == "dummy":
        _init_dummy(model, seed)
        if scheme is not None:
            quantize_linears(model, scheme, {})
    else:
        _load_safetensors(model, Path(model_dir), device, scheme)
    return model.eval(), hf_config


def _load_safetensors(model: nn.Module, model_dir: Path, device: torch.device, scheme: QuantScheme | None) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir} (use load_format='dummy' for random weights)")
    loaded: set[str] = set()
    # Checkpoint module name -> its quantized tensors, for the layers the scheme's marker tensor marks.
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    marked: set[str] = set()
    if scheme is not None and scheme.marker is not None:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                marked.update(n.removesuffix(f".{scheme.marker}") for n in f.keys() if n.endswith(f".{scheme.marker}"))
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    module, _, suffix = name.rpartition(".")
                    if module in marked and suffix != "bias":  # a bias loads into its (fused) nn.Linear
                        quantized.setdefault(module.removeprefix("model."), {})[suffix] = f.get_tensor(name)
                        loaded.add(name)
                    elif model.load_weight(name, f.get_tensor(name)):
                        loaded.add(name)
        # A quantized layer's weight is its packed tensors (whatever module replaces it).
        in_place_of_weights = {f"{module}.weight" for module in quantized}
        if scheme is not None:
            quantize_linears(model, scheme, quantized)
    expected = _expected_checkpoint_names(model) - in_place_of_weights
    missing = expected - {n.removeprefix("model.") for n in loaded}
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def _expected_checkpoint_names(model: nn.Module) -> set[str]:
    """Parameter names as a HF checkpoint spells them (fused projections split back)."""
    names = set()
    for name, _ in model.named_parameters():
        parts = [name.replace(fused, part) for part, (fused, _) in model.packed.items() if f".{fused}." in name]
        names.update(parts or [name])
    return names


def _init_dummy(model: nn.Module, seed: int) -> None:
    """Random weights with sane scales (norms at 1), the same for a given seed on a given device."""
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            gen = torch.Generator(device=param.device).manual_seed(seed)
            seed += 1
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
