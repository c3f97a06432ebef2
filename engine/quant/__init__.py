"""Quantized checkpoints and load-time quantization: which scheme a model uses, and the linear layers it makes.

A scheme is chosen once at load (`detect_scheme`): from `quantization_config` in config.json (or an old
`quantize_config.json` / `quant_config.json`), or from `EngineConfig.quantization`. Each scheme module
(gptq, awq, compressed_tensors, fp8, int8) turns one linear layer's checkpoint tensors, a fused layer's
shards in order, into the module that replaces its `nn.Linear` (engine/layers/linear.py); the forward
pass calls that module and never asks which scheme made it.

Weight-only schemes all unpack to one form, `IntWeight` (one unsigned integer per element, input-major,
with per-group scales and zero points), so that fused shards concatenate along the output dimension
whatever the packing, and one kernel serves GPTQ, AWQ and compressed-tensors alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.config import QUANTIZATIONS
from engine.quant.checks import UnsupportedQuantization


@dataclass
class IntWeight:
    """A weight-only quantized [K, N] matrix (K inputs, N outputs), one integer per element.

    Element (k, n) is (q[k, n] - zeros[g, n]) * scales[g, n] with g = g_idx[k], or k // group_size
    when g_idx is None."""

    q: torch.Tensor  # [K, N] int32 in [0, 2**bits)
    scales: torch.Tensor  # [G, N] floating, G = ceil(K / group_size)
    zeros: torch.Tensor  # [G, N] int32 in [0, 2**bits)
    bits: int
    group_size: int  # K when one group spans the whole input
    g_idx: torch.Tensor | None = None  # [K] group of each input row (GPTQ act-order); None: k // group_size

    def dequantize(self) -> torch.Tensor:
        """The [K, N] float32 matrix it stands for."""
        g = self.g_idx.long() if self.g_idx is not None else torch.arange(self.q.shape[0], device=self.q.device)
        if self.g_idx is None:
            g = g // self.group_size
        return (self.q - self.zeros[g]).float() * self.scales[g].float()


def quantize_rtn(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool = True, g_idx: torch.Tensor | None = None
) -> IntWeight:
    """Round-to-nearest quantization of an [N, K] weight (as nn.Linear holds it) in groups of `group_size`
    inputs (-1: one group), or in the groups `g_idx` gives ([K], each group_size rows but the last, any order).

    Symmetric: scale = max |w| / (2**(bits-1) - 1), zero point 2**(bits-1); asymmetric: the group's range
    over 2**bits - 1 levels, zero point where 0.0 rounds to."""
    n, k = weight.shape
    group_size = k if group_size == -1 else group_size
    groups = -(-k // group_size)  # the last group is short when group_size does not divide K, as the tools make it
    w = weight.detach().float()
    if g_idx is not None:
        order = torch.argsort(g_idx, stable=True)
        w = w[:, order]
    # Zeros fill the short group: they change neither its absolute maximum nor its range, which holds 0.
    w = torch.nn.functional.pad(w, (0, groups * group_size - k)).reshape(n, groups, group_size)
    top = (1 << bits) - 1
    if symmetric:
        scale = w.abs().amax(-1).clamp(min=1e-10) / ((1 << (bits - 1)) - 1)
        zero = torch.full_like(scale, 1 << (bits - 1))
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-10)
        zero = (-lo / scale).round().clamp(0, top)
    q = (w / scale[..., None]).round().add(zero[..., None]).clamp(0, top).to(torch.int32).reshape(n, -1)[:, :k]
    if g_idx is not None:
        q = q[:, torch.argsort(order)]
    return IntWeight(
        q.t().contiguous(),
        scale.t().contiguous(),
        zero.to(torch.int32).t().contiguous(),
        bits,
        group_size,
        None if g_idx is None else g_idx.to(torch.int32),
    )


def concat_outputs(parts: list[IntWeight]) -> IntWeight:
    """Fused shards (q/k/v, gate/up) side by side along N; they share the input, so bits, groups and g_idx
    must agree."""
    first = parts[0]
    for p in parts[1:]:
        if p.bits != first.bits or p.group_size != first.group_size:
            raise UnsupportedQuantization("fused projections quantized with different bits or group sizes")
        if (p.g_idx is None) != (first.g_idx is None) or (
            p.g_idx is not None and not torch.equal(p.g_idx, first.g_idx)
        ):
            raise UnsupportedQuantization(
                "fused projections with different act-order group indices (g_idx): the CUDA kernel needs one order"
            )
    if len(parts) == 1:
        return first
    return IntWeight(
        torch.cat([p.q for p in parts], 1),
        torch.cat([p.scales for p in parts], 1),
        torch.cat([p.zeros for p in parts], 1),
        first.bits,
        first.group_size,
        first.g_idx,
    )


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> one int32 per `bits`-bit field, fields in order from the low bits, expanded along `dim`."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    if dim == 0:
        fields = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
        return fields.reshape(packed.shape[0] * per_word, packed.shape[1])
    fields = (packed.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)
    return fields.reshape(packed.shape[0], packed.shape[1] * per_word)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of `unpack_int32`: values in [0, 2**bits), their count along `dim` a multiple of 32 // bits."""
    per_word = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.reshape(v.shape[0] // per_word, per_word, v.shape[1])
        shifts = torch.arange(0, 32, bits, device=v.device).view(1, -1, 1)
    else:
        v = v.reshape(v.shape[0], v.shape[1] // per_word, per_word)
        shifts = torch.arange(0, 32, bits, device=v.device).view(1, 1, -1)
    words = (v << shifts).sum(dim=1 if dim == 0 else 2)  # fields are disjoint: the sum is their OR
    return (words - ((words >= 2**31).to(torch.int64) << 32)).to(torch.int32)  # uint32 bits as int32


class QuantScheme(ABC):
    """A quantization scheme: which checkpoint tensors it reads, and the linear module it makes of them."""

    name: str
    # The checkpoint tensor suffix that marks a linear layer as quantized (e.g. "qweight"); None for a scheme
    # that quantizes full-precision weights at load, where every linear but the LM head is quantized.
    marker: str | None = None
    # Weight-only schemes: whether their CUDA linears keep fragment-layout copies (load_model sets it from
    # EngineConfig.quant_fragment_copies; engine/layers/linear.py weight_only_linear).
    fragment_copies: bool = True

    @abstractmethod
    def make_linear(
        self, shards: list[dict[str, torch.Tensor]], bias: torch.Tensor | None, dtype: torch.dtype
    ) -> nn.Module:
        """The module for one linear layer from its shards' tensors (one dict per fused shard, in output order;
        `{"weight": W}` for a load-time scheme)."""

    def describe(self) -> str:
        return self.name

    def tensors_of(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors `make_linear` takes for one shard standing for an [N, K] full-precision weight: the weight
        itself for a load-time scheme; a checkpoint scheme quantizes it into its own tensors (round-to-nearest),
        which is how dummy weights (load_format="dummy") of a quantized config are made."""
        return {"weight": weight}

    def check_shard(self, t: dict[str, torch.Tensor], k: int, n: int) -> None:  # noqa: B027  (load-time schemes: nothing)
        """A checkpoint scheme: raise ValueError naming the first of one shard's checkpoint tensors `t` whose dtype or
        shape does not fit a shard of k inputs and n outputs (config.json's sizes; engine/quant/checks.py Shard),
        so that a corrupted checkpoint is refused at load by name, never unpacked wrong or failed on at the first
        request. A load-time scheme has nothing to check: it takes the weight the loader has checked."""


def _read_json(path: Path) -> dict | None:
    from engine.loader import read_json  # the loader imports this package: imported at use, not at the top

    return read_json(path) if path.is_file() else None


def checkpoint_quantization(hf_config: dict, model_dir: str | Path) -> dict | None:
    """The checkpoint's quantization config: config.json's `quantization_config`, else the file older tools
    wrote beside it (auto-gptq's quantize_config.json, AutoAWQ's quant_config.json)."""
    qc = hf_config.get("quantization_config")
    if qc:
        return qc
    qc = _read_json(Path(model_dir) / "quantize_config.json")
    if qc:
        return {"quant_method": "gptq", **qc}
    qc = _read_json(Path(model_dir) / "quant_config.json")
    if qc:
        return {"quant_method": "awq", **qc}
    return None


def detect_scheme(hf_config: dict, model_dir: str | Path, override: str | None = None) -> QuantScheme | None:
    """The scheme that serves this checkpoint: its own quantization, or `override` (EngineConfig.quantization).
    Raises UnsupportedQuantization naming what was found and what is supported."""
    from engine.quant import awq, compressed_tensors, fp8, gptq, int8

    qc = checkpoint_quantization(hf_config, model_dir)
    if qc is not None and not isinstance(qc, dict):
        raise UnsupportedQuantization(f"the checkpoint's quantization_config should be an object, not {qc!r:.80}")
    found = None if qc is None else str(qc.get("quant_method", "")).lower().replace("_", "-")
    if override is not None and override not in QUANTIZATIONS:
        raise UnsupportedQuantization(
            f"--quantization {override} is not supported; supported: {', '.join(QUANTIZATIONS)}"
        )
    if found is None:
        if override in ("fp8", "int8"):
            return fp8.Fp8AtLoad() if override == "fp8" else int8.Int8AtLoad()
        if override is not None:
            raise UnsupportedQuantization(
                f"--quantization {override} needs a checkpoint quantized with it (a quantization_config in "
                "config.json); only fp8 and int8 quantize a full-precision checkpoint at load"
            )
        return None
    if override is not None and override != found:
        raise UnsupportedQuantization(
            f"the checkpoint is quantized with {found}; --quantization {override} cannot serve it "
            f"(leave --quantization out, or pass {found})"
        )
    readers = {"gptq": gptq.from_config, "awq": awq.from_config, "compressed-tensors": compressed_tensors.from_config}
    if found not in readers:
        raise UnsupportedQuantization(
            f"the checkpoint's quantization_config has quant_method {found!r}; supported checkpoints: "
            f"{', '.join(readers)}, and fp8 / int8 quantize a full-precision checkpoint at load"
        )
    return readers[found](qc)


def replaced_at_load(name: str, module: nn.Module) -> bool:
    """Whether a load-time scheme, or any scheme over dummy weights, replaces this module (its name in the
    model): every nn.Linear but the LM head."""
    return isinstance(module, nn.Linear) and name.rpartition(".")[2] != "lm_head"


def replace_linear(
    parent: nn.Module, child_name: str, scheme: QuantScheme, shards: list[dict[str, torch.Tensor]]
) -> None:
    """Put the scheme's module made from `shards` in place of the nn.Linear `parent.child_name` (its bias kept)."""
    child = getattr(parent, child_name)
    bias = None if child.bias is None else child.bias.detach()
    setattr(parent, child_name, scheme.make_linear(shards, bias, child.weight.dtype))


def _replace_checked(
    model: nn.Module, name: str, scheme: QuantScheme, parts: list[str], shards: list[dict[str, torch.Tensor]]
) -> None:
    """replace_linear for the model's linear `name` from the checkpoint tensors of its shards (checkpoint names
    `parts`), each checked against config.json's sizes first; a ValueError names the shard or the layer."""
    parent_name, _, child_name = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    child = getattr(parent, child_name)
    sizes = model.shard_sizes(name) if len(parts) > 1 else [child.out_features]
    for part, n, shard in zip(parts, sizes, shards, strict=True):
        try:
            scheme.check_shard(shard, child.in_features, n)
        except ValueError as exc:
            raise ValueError(f"{part}: {exc}") from None
    try:
        replace_linear(parent, child_name, scheme, shards)
    except ValueError as exc:  # what the shapes cannot tell: act orders the kernel cannot take, fused shards unlike
        raise ValueError(f"{parts[0] if len(parts) == 1 else name}: {exc}") from None


def quantize_linears(
    model: nn.Module,
    scheme: QuantScheme,
    tensors: dict[str, dict[str, torch.Tensor]],
    dummy_weight: Callable[[str], torch.Tensor] | None = None,
) -> int:
    """Replace the model's quantized nn.Linear layers by the scheme's modules; returns how many.

    `tensors`: checkpoint module name (without "model.") -> its quantized tensors, consumed here. A
    checkpoint scheme quantizes the layers whose tensors it has (others keep their loaded weights: the
    LM head and `ignore`d layers); a load-time scheme quantizes every linear but the LM head from its loaded
    weight (`QuantScheme.tensors_of`). `dummy_weight` (load_format="dummy"): any scheme quantizes every linear
    but the LM head from the full-precision weight it gives for the linear's name, made one layer at a time
    (the linears' own weights were never allocated)."""
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        prefix = f"{parent_name}." if parent_name else ""
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if scheme.marker is None or dummy_weight is not None:
                if not replaced_at_load(prefix + child_name, child):
                    continue
                weight = child.weight if dummy_weight is None else dummy_weight(prefix + child_name)
                replace_linear(parent, child_name, scheme, [scheme.tensors_of(weight.detach())])  # fused: one shard
            else:
                parts = model.shard_names(prefix + child_name)  # a fused layer's shards, in output order
                present = [p for p in parts if p in tensors]
                if not present:
                    continue
                if len(present) != len(parts):
                    missing = sorted(set(parts) - set(present))
                    raise ValueError(f"checkpoint has quantized {present[0]} but not {missing[0]} beside it")
                _replace_checked(model, prefix + child_name, scheme, parts, [tensors.pop(p) for p in parts])
            replaced += 1
    if tensors:
        left = sorted(tensors)
        raise ValueError(f"quantized tensors with no linear layer to take them, e.g. {left[0]!r}")
    return replaced
