"""What a quantized checkpoint must be for pagoda to serve it, and the one-line errors when it is not: a
quantization config pagoda lacks (UnsupportedQuantization), and a layer's tensors whose dtype or shape does not
fit a shard of k inputs and n outputs (config.json's sizes), which each scheme's `QuantScheme.check_shard` finds
before anything is unpacked, naming the tensor as it is and what the layer needs."""

from __future__ import annotations

from collections.abc import Callable

import torch


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization (or the one asked for) that pagoda cannot serve; the message names it."""


def config_int(qc: dict, *keys: str, default: int) -> int:
    """The integer a quantization config gives under the first of `keys` it has (else `default`);
    UnsupportedQuantization naming the key when it is not an integer."""
    for key in keys:
        if key in qc:
            value = qc[key]
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str) and value.strip().removeprefix("-").isdigit():
                return int(value)
            raise UnsupportedQuantization(f"quantization_config's {key} should be an integer, not {value!r}")
    return default


# Tensor kinds a scheme's checkpoint tensors come in, as check_tensor names them.
_KINDS: dict[str, Callable[[torch.Tensor], bool]] = {
    "int32": lambda t: t.dtype == torch.int32,  # packed words
    "integer": lambda t: not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool,
    "float": lambda t: t.dtype in (torch.float16, torch.bfloat16, torch.float32),
    "int8": lambda t: t.dtype == torch.int8,
    "float8_e4m3fn": lambda t: t.dtype == torch.float8_e4m3fn,
}


def check_tensor(t: dict[str, torch.Tensor], name: str, kind: str, shape: tuple[int, ...] | int, layer: str) -> None:
    """Raise ValueError unless t[name] is a tensor of `kind` (a _KINDS key) and `shape` (an int: that many
    elements, in any shape), saying what it is and what `layer` (e.g. "a 4-bit GPTQ layer of ...") needs."""
    tensor = t.get(name)
    if tensor is None:
        raise ValueError(f"{name} is missing; {layer} needs it")
    fits = tensor.numel() == shape if isinstance(shape, int) else tuple(tensor.shape) == shape
    if not fits or not _KINDS[kind](tensor):
        want = f"{shape} {kind} values" if isinstance(shape, int) else f"{kind} {list(shape)}"
        dtype = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"{name} is {dtype} {list(tensor.shape)}; {layer} needs {want}")


def check_groups(g_idx: torch.Tensor, name: str, groups: int, layer: str) -> None:
    """Raise ValueError unless every input row's group in g_idx is one of the layer's `groups`."""
    low, high = int(g_idx.min()), int(g_idx.max())
    if low < 0 or high >= groups:
        raise ValueError(f"{name} names group {low if low < 0 else high}; {layer} has groups 0 to {groups - 1}")


def group_count(k: int, group_size: int) -> int:
    """Groups of `group_size` inputs (-1: one group) that k inputs make, a shorter last group counted."""
    return 1 if group_size == -1 else -(-k // group_size)


def layer_words(fmt: str, k: int, n: int, bits: int, group_size: int | None) -> str:
    """A shard as check_tensor's messages name it: "a GPTQ layer of 64 inputs and 32 outputs (4-bit, 2 groups
    of 32)"; group_size -1 or None: per channel."""
    groups = group_count(k, -1 if group_size is None else group_size)
    plural = "s" if groups > 1 else ""
    spread = "per channel" if group_size in (-1, None) else f"{groups} group{plural} of {group_size}"
    return f"a {fmt} layer of {k} inputs and {n} outputs ({bits}-bit, {spread})"
