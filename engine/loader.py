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
from engine.quant import QuantScheme, detect_scheme, quantize_linears, replace_linear, replaced_at_load

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


class _DeferredParameters(torch.overrides.TorchFunctionMode):
    """Modules built inside it get their torch.empty tensors (nn.Linear's and nn.Embedding's parameters; not
    size-0 ones) on the meta device, and none of torch.nn.init's random fills: load_model overwrites every
    parameter afterwards, from the checkpoint (a tensor it lacks is an error) or by _init_dummy, so neither
    their memory's contents nor the fills (a fifth of the default model's start-up on the CPU) mattered.
    `_materialize` then gives each deferred parameter its memory on the device, except the weights of the
    linears a quantized checkpoint replaces, which never get a full-precision copy. Buffers (the rotary
    tables) and tensors made by other factories (torch.ones, torch.arange) are computed as usual. A
    TorchFunctionMode is scoped to this thread and this block."""

    _FILLS = {torch.Tensor.uniform_, torch.Tensor.normal_}
    # torch.nn.init's random initializers (its constant ones, ones_ / zeros_ / constant_, still run).
    _RANDOM_INITS = {"uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                     "xavier_normal_", "orthogonal_", "sparse_"}  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # The initializers come here whole (torch.nn.init's functions dispatch to the mode themselves, and
        # what they call inside this handler does not come back to it), or as the bare in-place fills.
        init = getattr(func, "__module__", None) == "torch.nn.init" and func.__name__ in self._RANDOM_INITS
        if init or func in self._FILLS:
            return args[0] if args else kwargs["tensor"]
        if func is torch.empty:  # uninitialized memory: nothing is lost if it is allocated later, or never
            deferred = func(*args, **{**kwargs, "device": "meta"})
            if deferred.numel():  # a size-0 placeholder (an Attention's unbound K/V cache) stays as asked
                return deferred
        return func(*args, **kwargs)


def _materialize(model: nn.Module, device: torch.device, keep: set[str]) -> None:
    """Give every parameter still on the meta device uninitialized memory on `device`, except the weights of
    the modules named in `keep` (their quantized replacement comes later). A parameter shared by two modules
    (the LM head tied to the embedding) stays shared."""
    made: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                if name == "weight" and module_name in keep:
                    continue
                made[id(param)] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
            module._parameters[name] = made[id(param)]
    for module_name, module in model.named_modules():
        # A buffer or tensor attribute made from a deferred torch.empty would have lost what was written into it.
        tensors = [*module._buffers.values(), *(t for t in vars(module).values() if isinstance(t, torch.Tensor))]
        if any(t is not None and t.is_meta for t in tensors):
            raise RuntimeError(f"{module_name or type(model).__name__} holds a tensor built from torch.empty")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    backend: AttentionBackend | None = None,
    quantization: str | None = None,
    fragment_copies: bool = True,
) -> tuple[nn.Module, dict]:
    """The model on `device` in `dtype`, its layers calling `backend` (default: the torch reference),
    and its HF config.

    The modules are built with their parameters deferred (`_DeferredParameters`), then given memory on the
    device, and each checkpoint tensor is read from its memory-mapped file straight to the device and copied
    in, so the host never holds the model. A quantized checkpoint (or `quantization`, EngineConfig's) swaps
    its linears for the scheme's modules (engine/quant) once the tensors are read; the linears whose packed
    tensors the checkpoint holds never get a full-precision weight, a dummy load's quantized linears are made
    from their random weights one at a time, and a load-time scheme (fp8, int8) quantizes each linear as soon as
    the checkpoint has filled it, so the load peaks near the quantized model's size. `fragment_copies`
    (EngineConfig.quant_fragment_copies): whether 4-bit weight-only linears on CUDA keep their fragment-layout
    copies (engine/layers/linear.py WeightOnlyLinear).
    """
    hf_config = read_hf_config(model_dir)
    scheme = detect_scheme(hf_config, model_dir, quantization)
    if scheme is not None:
        log.info("quantization: %s", scheme.describe())
        scheme.fragment_copies = fragment_copies
    try:
        cls = model_class(hf_config)
        with _default_dtype(dtype), torch.device(device), _DeferredParameters():
            model = cls(hf_config, backend)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # values the model code cannot build from
        raise ModelLoadError(Path(model_dir) / "config.json", f"cannot build the model: {exc}") from None
    at_load = set() if scheme is None else {n for n, m in model.named_modules() if replaced_at_load(n, m)}
    if load_format == "dummy":
        _materialize(model, device, at_load)
        deferred = _init_dummy(model, seed)
        if scheme is not None:

            def dummy_weight(name: str) -> torch.Tensor:  # made as its layer is quantized, dropped after
                like = model.get_submodule(name).weight
                return _random(torch.empty_like(like, device=device), deferred[f"{name}.weight"])

            quantize_linears(model, scheme, {}, dummy_weight=dummy_weight)
    else:
        files = checkpoint_files(Path(model_dir))
        marked = _marked_modules(files, scheme)
        # A load-time scheme's linears get their full-precision weight one at a time, as the checkpoint fills them.
        later = at_load if scheme is not None and scheme.marker is None else {_model_name(model, m) for m in marked}
        _materialize(model, device, later)
        _load_safetensors(model, Path(model_dir), files, marked, device, scheme)
    return model.eval(), hf_config


def _marked_modules(files: list[Path], scheme: QuantScheme | None) -> set[str]:
    """The checkpoint names of the modules that carry the scheme's marker tensor (their tensors are the
    scheme's packed ones, not a full-precision weight); read from the files' headers only."""
    marked: set[str] = set()
    if scheme is None or scheme.marker is None:
        return marked
    suffix = f".{scheme.marker}"
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                marked.update(n.removesuffix(suffix) for n in f.keys() if n.endswith(suffix))
        except Exception as exc:  # a truncated file, a garbage header
            raise ModelLoadError(file, f"not a readable safetensors file ({first_line(exc)})") from None
    return marked


def _model_name(model: nn.Module, checkpoint_name: str) -> str:
    """A checkpoint tensor's or module's name as the model names it: without "model.", and a fused layer's for
    its shards (layers.0.self_attn.q_proj -> layers.0.self_attn.qkv_proj)."""
    name = checkpoint_name.removeprefix("model.")
    shard = model.fused_name(name)
    return shard[0] if shard is not None else name


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


def _load_safetensors(
    model: nn.Module,
    model_dir: Path,
    files: list[Path],
    marked: set[str],
    device: torch.device,
    scheme: QuantScheme | None,
) -> None:
    """Read `files` into the model; the tensors of the `marked` modules (checkpoint names) go to the scheme."""
    params = dict(model.named_parameters())
    expected = _expected_checkpoint_names(model)  # before any linear is replaced (a quantized one has no weight)
    at_load = _QuantizeAsLoaded(model, scheme, params, device) if scheme is not None and scheme.marker is None else None
    loaded: set[str] = set()
    # Checkpoint module name -> its quantized tensors, for the layers the scheme's marker tensor marks.
    quantized: dict[str, dict[str, torch.Tensor]] = {}
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
                        if at_load is not None:
                            at_load.allocate(name)
                        if model.load_weight(name, tensor, params):
                            loaded.add(name)
                            if at_load is not None:
                                at_load.filled(name)
                        # Copied in: freed now, not when the next tensor's read rebinds the name (two of the
                        # largest tensors, an 8B model's embedding and LM head, 2 GiB, were held at once).
                        del tensor
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
        if scheme is not None and scheme.marker is not None:
            try:
                quantize_linears(model, scheme, quantized)
            except ValueError as exc:  # names the layer: a missing shard, a tensor of the wrong shape or kind
                raise ModelLoadError(model_dir, str(exc)) from None
    missing = expected - in_place_of_weights - {n.removeprefix("model.") for n in loaded}
    if missing:
        raise ModelLoadError(
            model_dir, f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. {sorted(missing)[:3]}"
        )


class _QuantizeAsLoaded:
    """A load-time scheme (`--quantization fp8 / int8`) quantizes each linear as soon as the checkpoint has
    filled it: the linear's full-precision weight gets memory at its first tensor and is freed once the scheme's
    module replaces it, so the load never holds more than a few layers' full-precision linears (a 70B bf16
    checkpoint served in fp8 needs 70 GB, not 140). The weights stay deferred until then (`_materialize`)."""

    def __init__(self, model: nn.Module, scheme: QuantScheme, params: dict[str, nn.Parameter], device: torch.device):
        self.model, self.scheme, self.params, self.device = model, scheme, params, device
        # Module (model name) -> the checkpoint names of its tensors (weight and bias, a fused layer's shards)
        # not yet read.
        self.pending: dict[str, set[str]] = {}
        for name, module in model.named_modules():
            if replaced_at_load(name, module):
                for param in ("weight", "bias"):
                    if getattr(module, param) is not None:
                        self.pending.setdefault(name, set()).update(model.shard_names(f"{name}.{param}"))

    def allocate(self, name: str) -> None:
        """Give the deferred weight that checkpoint tensor `name` fills its memory (once)."""
        target = _model_name(self.model, name)
        param = self.params.get(target)
        if param is not None and param.is_meta:
            module_name, _, attr = target.rpartition(".")
            made = nn.Parameter(torch.empty_like(param, device=self.device), param.requires_grad)
            self.model.get_submodule(module_name)._parameters[attr] = made
            self.params[target] = made

    def filled(self, name: str) -> None:
        """Checkpoint tensor `name` has been copied in: quantize its linear once all of its tensors have."""
        module_name = _model_name(self.model, name).rpartition(".")[0]
        pending = self.pending.get(module_name)
        if pending is None:
            return
        pending.discard(name.removeprefix("model."))
        if pending:
            return
        del self.pending[module_name]
        parent_name, _, child_name = module_name.rpartition(".")
        parent = self.model.get_submodule(parent_name)
        weight = getattr(parent, child_name).weight.detach()
        replace_linear(parent, child_name, self.scheme, [self.scheme.tensors_of(weight)])  # a fused layer as one shard
        for param in ("weight", "bias"):  # the map must not keep the full-precision weight alive
            self.params.pop(f"{module_name}.{param}", None)


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
    param = params.get(_model_name(model, name))
    if param is not None and param.is_floating_point() and not tensor.is_floating_point():
        raise ModelLoadError(file, f"tensor {name!r} is {tensor.dtype}, but the model's weights are floats")


def first_line(exc: BaseException) -> str:
    """An exception's message's first line (the one a one-line report has room for)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _expected_checkpoint_names(model: nn.Module) -> set[str]:
    """Parameter names as a HF checkpoint spells them (fused projections split back), without "model."."""
    return {part for name, _ in model.named_parameters() for part in model.shard_names(name)}


def _init_dummy(model: nn.Module, seed: int) -> dict[str, int]:
    """Random weights with sane scales (norms at 1), the same for a given seed on a given device. Parameters
    still on the meta device (the linears a quantized config replaces) are left to quantize_linears, which
    makes each in turn from the seed returned for it by name: the values a full-precision load would hold."""
    deferred: dict[str, int] = {}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.is_meta:
                deferred[name] = seed
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                _random(param, seed)
            seed += 1
    return deferred


def _random(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    """`tensor` filled in place with a dummy weight's random values for `seed`."""
    with torch.no_grad():
        return tensor.normal_(0.0, 0.02, generator=torch.Generator(device=tensor.device).manual_seed(seed))
