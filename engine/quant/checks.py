"""What a quantized checkpoint must be for pagoda to serve it, and the one-line errors when it is not: a
quantization config pagoda lacks (UnsupportedQuantization), and a layer's tensors whose dtype or shape does not
fit a shard of k inputs and n outputs (config.json's sizes), which each scheme's `QuantScheme.check_shard` finds
before anything is unpacked, naming the tensor as it is and what the layer needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


# Tensor kinds a scheme's checkpoint tensors come in, as Shard.expect names them.
_KINDS: dict[str, Callable[[torch.Tensor], bool]] = {
    "int32": lambda t: t.dtype == torch.int32,  # packed words
    "integer": lambda t: not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool,
    "float": lambda t: t.dtype in (torch.float16, torch.bfloat16, torch.float32),
    "int8": lambda t: t.dtype == torch.int8,
    "float8_e4m3fn": lambda t: t.dtype == torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class Shard:
    """One shard's checkpoint tensors `t` and what config.json makes of it: k inputs and n outputs, `bits`-bit values
    (None: W8A8, whose messages name no bits or groups) in groups of `group_size` inputs (-1 or None: one group, per
    channel). Its checks raise ValueError naming the tensor as it is and what the shard needs."""

    fmt: str
    t: dict[str, torch.Tensor]
    k: int
    n: int
    bits: int | None = None
    group_size: int | None = None

    @property
    def groups(self) -> int:
        """Groups of group_size inputs that k inputs make, a shorter last group counted."""
        return 1 if self.group_size in (-1, None) else -(-self.k // self.group_size)

    def __str__(self) -> str:
        """As the messages name it: "a GPTQ layer of 64 inputs and 32 outputs (4-bit, 2 groups of 32)"."""
        article = "an" if self.fmt[0] in "AEIOU" else "a"
        words = f"{article} {self.fmt} layer of {self.k} inputs and {self.n} outputs"
        if self.bits is None:
            return words
        plural = "s" if self.groups > 1 else ""
        spread = "per channel" if self.group_size in (-1, None) else f"{self.groups} group{plural} of {self.group_size}"
        return f"{words} ({self.bits}-bit, {spread})"

    def expect(self, name: str, kind: str, shape: tuple[int, ...] | int) -> None:
        """t[name] is a tensor of `kind` (a _KINDS key) and `shape` (an int: that many elements, in any shape)."""
        tensor = self.t.get(name)
        if tensor is None:
            raise ValueError(f"{name} is missing; {self} needs it")
        fits = tensor.numel() == shape if isinstance(shape, int) else tuple(tensor.shape) == shape
        if not fits or not _KINDS[kind](tensor):
            want = f"{shape} {kind} values" if isinstance(shape, int) else f"{kind} {list(shape)}"
            dtype = str(tensor.dtype).removeprefix("torch.")
            raise ValueError(f"{name} is {dtype} {list(tensor.shape)}; {self} needs {want}")

    def expect_groups(self, name: str) -> None:
        """t[name], an act order, gives each of the k inputs one of the shard's groups."""
        self.expect(name, "integer", (self.k,))
        low, high = int(self.t[name].min()), int(self.t[name].max())
        if low < 0 or high >= self.groups:
            bad = low if low < 0 else high
            raise ValueError(f"{name} names group {bad}; {self} has groups 0 to {self.groups - 1}")

    def expect_packing(self, per_word: int, *sizes: int) -> None:
        """The dimensions `sizes` pack into words of per_word fields."""
        if any(size % per_word for size in sizes):
            raise ValueError(f"{self} does not pack into words of {per_word} fields")
