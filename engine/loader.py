"""Find a model's Hugging Face directory, and build the model from it: safetensors weights or dummy (random) ones."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.attention import AttentionBackend
from engine.models import model_class
from engine.quant import QuantScheme, detect_scheme, quantize_linears

log = logging.getLogger("pagoda.loader")

# What config.json must give, each a positive integer, before any model code reads it.
_REQUIRED_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class ModelLoadError(Exception):
    """A model directory that cannot be served: a missing, unreadable or inconsistent file. The message is
    one line that names the file and the problem (`pagoda serve` prints it and exits 1)."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        super().__init__(f"{path}: {problem}")


def read_json(path: str | Path) -> dict:
    """A JSON object from `path`; ModelLoadError naming the file when it is unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(path, f"invalid JSON ({exc})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(path, f"cannot be read ({exc})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(path, f"should hold a JSON object, not {type(data).__name__}")
    return data


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
    config = read_json(path)
    for key in _REQUIRED_INTS:
        value = config.get(key)
        # bool is an int in Python, and never a size.
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(path, f"{key} should be a positive integer, not {value!r}")
    return config


def check_model_files(model_dir: str | Path) -> None:
    """Read the JSON files of a model directory that pagoda and its server read later (config.json,
    generation_config.json), so that a broken one fails start-up at once with its name."""
    read_hf_config(model_dir)
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.is_file():
        read_json(generation_config)


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


class _NoRandomInit(torch.overrides.TorchFunctionMode):
    """Parameters built inside it keep whatever memory they were given: the random fills of torch.nn.init
    (nn.Linear's kaiming_uniform_, nn.Embedding's normal_) are skipped. load_model overwrites every parameter
    afterwards, from the checkpoint (a tensor it lacks is an error) or by _init_dummy, so the fills were
    wasted: on the CPU they were a fifth of the default model's start-up. A TorchFunctionMode is scoped to
    this thread and this block; buffers (the rotary tables) are computed, not filled, and stay as built."""

    _FILLS = {torch.Tensor.uniform_, torch.Tensor.normal_}
    # torch.nn.init's random initializers (its constant ones, ones_ / zeros_ / constant_, still run).
    _RANDOM_INITS = {"uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                     "xavier_normal_", "orthogonal_", "sparse_"}  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # The initializers come here whole (torch.nn.init's functions dispatch to the mode themselves, and
        # what they call inside this handler does not come back to it), or as the bare in-place fills.
        init = getattr(func, "__module__", None) == "torch.nn.init" and func.__name__ in self._RANDOM_INITS
        if init or func in self._FILLS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


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
    scheme = detect_scheme(hf_config, model_dir, quantization)
    if scheme is not None:
        log.info("quantization: %s", scheme.describe())
    try:
        cls = model_class(hf_config)
        with _default_dtype(dtype), torch.device(device), _NoRandomInit():
            model = cls(hf_config, backend)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # values the model code cannot build from
        raise ModelLoadError(Path(model_dir) / "config.json", f"cannot build the model: {exc}") from None
    if load_format == "dummy":
        _init_dummy(model, seed)
        if scheme is not None:
            quantize_linears(model, scheme, {}, dummy=True)
    else:
        _load_safetensors(model, Path(model_dir), device, scheme)
    # load_weight's name -> parameter map still holds the 16-bit weights of every linear quantize_linears
    # replaced (12 GiB of a W4A16 Llama-3-8B): drop it with the load.
    vars(model).pop("_params", None)
    return model.eval(), hf_config


# A checkpoint's fp8 KV-cache scales (compressed-tensors' kv_cache_scheme, as llm-compressor writes them).
_KV_SCALE = re.compile(r"(?:model\.)?layers\.(\d+)\.self_attn\.([kv])_scale")


def _load_kv_scale(model: nn.Module, name: str, f, file: Path) -> bool:
    """Copy a layer's k_scale / v_scale tensor into its Attention's scale (used with an fp8 KV cache);
    False when `name` is not one."""
    match = _KV_SCALE.fullmatch(name)
    if match is None:
        return False
    layers = model.attention_layers()
    if int(match[1]) >= len(layers):
        raise ModelLoadError(file, f"{name}: config.json describes {len(layers)} layers")
    scale = f.get_tensor(name)
    if scale.numel() != 1:
        raise ModelLoadError(file, f"{name} holds {scale.numel()} values; a K/V scale is one per layer")
    getattr(layers[int(match[1])], f"{match[2]}_scale").copy_(scale.float().reshape(1))
    return True


def _load_safetensors(model: nn.Module, model_dir: Path, device: torch.device, scheme: QuantScheme | None) -> None:
    files = checkpoint_files(model_dir)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    # Checkpoint module name -> its quantized tensors, for the layers the scheme's marker tensor marks.
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    marked: set[str] = set()
    if scheme is not None and scheme.marker is not None:
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    suffix = f".{scheme.marker}"
                    marked.update(n.removesuffix(suffix) for n in f.keys() if n.endswith(suffix))
            except Exception as exc:  # a truncated file, a garbage header
                raise ModelLoadError(file, f"not a readable safetensors file ({first_line(exc)})") from None
    with torch.no_grad():
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device=str(device)) as f:
                    for name in f.keys():
                        if _load_kv_scale(model, name, f, file):
                            loaded.add(name)
                            continue
                        module, _, suffix = name.rpartition(".")
                        if module in marked and suffix != "bias":  # a bias loads into its (fused) nn.Linear
                            quantized.setdefault(module.removeprefix("model."), {})[suffix] = f.get_tensor(name)
                            loaded.add(name)
                            continue
                        tensor = f.get_tensor(name)
                        _check_dtype(file, name, tensor, model, params)
                        if model.load_weight(name, tensor):
                            loaded.add(name)
            except ModelLoadError:
                raise
            except KeyError as exc:  # load_weight: a tensor the architecture has no place for
                raise ModelLoadError(file, f"{exc.args[0]} (does config.json describe this checkpoint?)") from None
            except ValueError as exc:  # load_weight: a shape that contradicts config.json
                raise ModelLoadError(file, str(exc)) from None
            except torch.OutOfMemoryError:  # the device is full, the file is fine
                raise
            except Exception as exc:  # safetensors' own errors: a truncated file, a garbage header
                raise ModelLoadError(file, f"not a readable safetensors file ({first_line(exc)})") from None
        # A quantized layer's weight is its packed tensors (whatever module replaces it).
        in_place_of_weights = {f"{module}.weight" for module in quantized}
        if scheme is not None:
            quantize_linears(model, scheme, quantized)
    expected = _expected_checkpoint_names(model) - in_place_of_weights
    missing = expected - {n.removeprefix("model.") for n in loaded}
    if missing:
        raise ModelLoadError(
            model_dir, f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. {sorted(missing)[:3]}"
        )


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names (each must exist), else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(index, "has no weight_map of tensor names to files")
        names = sorted(set(weight_map.values()))
        for name in names:
            if not isinstance(name, str) or not (model_dir / name).is_file():
                raise ModelLoadError(model_dir / str(name), f"missing: {index.name} names it as a checkpoint shard")
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(model_dir, "no *.safetensors files (use load_format='dummy' for random weights)")
    return files


def _check_dtype(
    file: Path, name: str, tensor: torch.Tensor, model: nn.Module, params: dict[str, nn.Parameter]
) -> None:
    """A float parameter needs float weights: an integer or bool tensor in its place is a corrupt checkpoint.
    (Only kinds are compared: a checkpoint in another float width is cast on copy.)"""
    short = name.removeprefix("model.")
    for part, (fused, _) in model.packed.items():
        if f".{part}." in short:
            short = short.replace(part, fused)
    param = params.get(short)
    if param is not None and param.is_floating_point() and not tensor.is_floating_point():
        raise ModelLoadError(file, f"tensor {name!r} is {tensor.dtype}, but the model's weights are floats")


def first_line(exc: BaseException) -> str:
    """An exception's message's first line (the one a one-line report has room for)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


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
