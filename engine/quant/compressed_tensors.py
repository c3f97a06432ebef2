"""compressed-tensors checkpoints as llm-compressor writes them (`quant_method: compressed-tensors`).

The scheme comes from the config's `config_groups` (pagoda serves one scheme per model):

- W4A16 / W8A16 (`pack-quantized`): per linear layer, with W [N outputs, K inputs]
      weight_packed     [N, K * bits / 32] int32  the input dimension packed, low bits first, each value
                                                  stored as q + 2**(bits-1) (q signed)
      weight_scale      [N, G]                    G = K / group_size (1 for per-channel)
      weight_zero_point [N * bits / 32, G] int32  asymmetric only: signed zero points packed along N the same way
      weight_shape      [2]                       (N, K)
      weight_g_idx      [K]                       act-order only
  W[n, k] = weight_scale[n, g] * (q[n, k] - zp[n, g]).
- W8A8 INT8 (`int-quantized`) and FP8 (`float-quantized`): `weight` int8 / float8_e4m3fn [N, K],
  `weight_scale` [N, 1] (channel) or one value (tensor); activations symmetric, per token at run time, or
  by the static per-tensor `input_scale` beside the weight (a calibrated absolute maximum / 127 or / 448).
- `kv_cache_scheme` fp8 per tensor: `self_attn.k_scale` / `self_attn.v_scale` per layer, read by the loader
  into the attention layers' scales (an fp8 KV cache uses them; --kv-cache-dtype auto ignores them).
"""

from __future__ import annotations

import torch

from engine.quant import IntWeight, QuantScheme, pack_int32, quantize_rtn, unpack_int32
from engine.quant.checks import Shard, UnsupportedQuantization, config_int

SUPPORTED = (
    "W4A16 / W8A16 (pack-quantized int weights, group or channel, symmetric or not), "
    "W8A8 int8 and fp8 (channel or tensor weights, symmetric dynamic per-token or static per-tensor activations)"
)


class CompressedWeightOnly(QuantScheme):
    name = "compressed-tensors"
    marker = "weight_scale"

    def __init__(self, bits: int, group_size: int | None):
        self.bits, self.group_size = bits, group_size  # group_size None: per channel

    def describe(self) -> str:
        groups = "channel" if self.group_size is None else f"group {self.group_size}"
        return f"compressed-tensors W{self.bits}A16 ({groups})"

    def check_shard(self, t, k, n):
        shard, per = Shard("compressed-tensors", t, k, n, self.bits, self.group_size), 32 // self.bits
        if "weight_packed" in t:
            shard.expect("weight_packed", "int32", (n, -(-k // per)))
            shard.expect("weight_shape", "integer", 2)
            if [int(v) for v in t["weight_shape"].flatten().tolist()] != [n, k]:
                raise ValueError(f"weight_shape is {t['weight_shape'].tolist()}; {shard} needs [{n}, {k}]")
        else:  # 8-bit weights stored unpacked
            shard.expect("weight", "int8", (n, k))
        shard.expect("weight_scale", "float", (n, shard.groups))
        if "weight_zero_point" in t:
            rows = -(-n // per) if _packed_zero_points(t["weight_zero_point"], n, self.bits) else n
            shard.expect("weight_zero_point", "integer", (rows, shard.groups))
        if "weight_g_idx" in t:
            shard.expect_groups("weight_g_idx")

    def unpack(self, t: dict[str, torch.Tensor]) -> IntWeight:
        offset = 1 << (self.bits - 1)
        if "weight_packed" in t:
            n, k = (int(v) for v in t["weight_shape"].tolist())
            q = unpack_int32(t["weight_packed"], self.bits, dim=1)[:, :k]
        else:  # 8-bit weights stored unpacked, as signed int8
            q = t["weight"].to(torch.int32) + offset
            n, k = q.shape
        scales = t["weight_scale"].reshape(n, -1)
        zp = t.get("weight_zero_point")
        if zp is None:
            zeros = torch.full_like(scales, offset, dtype=torch.int32)
        elif _packed_zero_points(zp, n, self.bits):
            zeros = unpack_int32(zp, self.bits, dim=0)[:n]  # packed: already offset, like the weights
        else:
            zeros = zp.reshape(n, -1).to(torch.int32) + offset
        group_size = k if self.group_size is None else self.group_size
        g_idx = t.get("weight_g_idx")
        if g_idx is not None:
            g_idx = g_idx.to(torch.int32)
            if torch.equal(g_idx, torch.arange(k, device=g_idx.device, dtype=torch.int32) // group_size):
                g_idx = None
        return IntWeight(q.t(), scales.t(), zeros.t(), self.bits, group_size, g_idx)

    def tensors_of(self, weight):
        return pack(quantize_rtn(weight, self.bits, self.group_size or -1))

    def make_linear(self, shards, bias, dtype):
        from engine.layers.linear import weight_only_linear

        return weight_only_linear([self.unpack(s) for s in shards], bias, dtype, self.fragment_copies)


class CompressedW8A8(QuantScheme):
    """INT8 or FP8 weights and activations."""

    name = "compressed-tensors"
    marker = "weight_scale"

    def __init__(self, kind: str, static_input: bool):
        self.kind, self.static_input = kind, static_input

    def describe(self) -> str:
        acts = "static" if self.static_input else "dynamic per-token"
        return f"compressed-tensors W8A8 {self.kind} ({acts} activations)"

    def tensors_of(self, weight):
        from engine.layers.linear import FP8, quantize_per_row

        q, scale = quantize_per_row(weight, torch.int8 if self.kind == "int8" else FP8)
        out = {"weight": q, "weight_scale": scale}
        if self.static_input:  # no data to calibrate on: a scale for inputs of magnitude up to ~8
            out["input_scale"] = torch.tensor([8.0 / (127.0 if self.kind == "int8" else 448.0)], device=q.device)
        return out

    def check_shard(self, t, k, n):
        shard = Shard(f"compressed-tensors W8A8 {self.kind}", t, k, n)
        shard.expect("weight", "int8" if self.kind == "int8" else "float8_e4m3fn", (n, k))
        per_tensor = "weight_scale" in t and t["weight_scale"].numel() == 1
        shard.expect("weight_scale", "float", 1 if per_tensor else n)
        if self.static_input:
            shard.expect("input_scale", "float", 1)

    def make_linear(self, shards, bias, dtype):
        from engine.layers.linear import ScaledLinear

        weights, scales = [], []
        for s in shards:
            w = s["weight"]
            scale = s["weight_scale"].float().reshape(-1)
            # A per-tensor scale becomes per-channel, so fused shards with different scales concatenate.
            weights.append(w)
            scales.append(scale.expand(w.shape[0]) if scale.numel() == 1 else scale)
        input_scale = None
        if self.static_input:
            # The shards read the same input; the largest scale clips none of them.
            input_scale = torch.stack([s["input_scale"].float().reshape(()) for s in shards]).max()
        return ScaledLinear(torch.cat(weights), torch.cat(scales), bias, dtype, input_scale)


def _packed_zero_points(zp: torch.Tensor, n: int, bits: int) -> bool:
    """Whether an asymmetric layer's weight_zero_point holds its n outputs' zero points packed into int32 words
    (W4: [N * bits / 32, G]) rather than one a row ([N, G])."""
    return zp.dtype == torch.int32 and zp.shape[0] * (32 // bits) >= n > zp.shape[0]


def pack(weight: IntWeight, symmetric: bool = True) -> dict[str, torch.Tensor]:
    """pack-quantized tensors of a weight (the inverse of CompressedWeightOnly.unpack; no act order)."""
    offset = 1 << (weight.bits - 1)
    k, n = weight.q.shape
    out = {
        "weight_packed": pack_int32(weight.q.t().contiguous(), weight.bits, dim=1),
        "weight_scale": weight.scales.t().contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if not symmetric:
        out["weight_zero_point"] = pack_int32(weight.zeros.t().contiguous(), weight.bits, dim=0)
    elif not bool((weight.zeros == offset).all()):
        raise ValueError("a symmetric weight has every zero point at 2**(bits-1)")
    return out


def _unsupported(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"compressed-tensors checkpoint with {what}; supported: {SUPPORTED}")


def from_config(qc: dict) -> QuantScheme:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _unsupported("no config_groups")
    first = groups[0]
    for g in groups[1:]:
        if g.get("weights") != first.get("weights") or g.get("input_activations") != first.get("input_activations"):
            raise _unsupported("several different config_groups")
    w = first.get("weights") or {}
    a = first.get("input_activations")
    fmt = first.get("format") or qc.get("format")
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    found = f"format={fmt}, weights {kind}{bits} {strategy} symmetric={w.get('symmetric')}"
    if a is not None:
        found += f", activations {a.get('type')}{a.get('num_bits')} {a.get('strategy')} dynamic={a.get('dynamic')}"
    kv = qc.get("kv_cache_scheme")
    if kv:
        # Per-tensor fp8 K/V scales (self_attn.k_scale / v_scale) load into the attention layers and are
        # used with --kv-cache-dtype fp8 (engine/loader.py); other KV schemes are not read.
        if not (kv.get("type") == "float" and kv.get("num_bits") == 8 and kv.get("strategy", "tensor") == "tensor"):
            raise _unsupported(
                found + f", KV cache {kv.get('type')}{kv.get('num_bits')} {kv.get('strategy')} (only fp8 per tensor)"
            )
    if a is None:
        if kind == "int" and bits in (4, 8) and strategy in ("group", "channel"):
            if fmt == "pack-quantized" or (bits == 8 and fmt in ("int-quantized", "naive-quantized")):
                group_size = config_int(w, "group_size", default=0) if strategy == "group" else None
                if group_size is not None and group_size <= 0:
                    raise _unsupported(found + f", group_size {w.get('group_size')}")
                return CompressedWeightOnly(bits, group_size)
        raise _unsupported(found)
    dynamic = a.get("dynamic") is True
    act_ok = (dynamic and a.get("strategy") == "token") or (not dynamic and a.get("strategy") == "tensor")
    sym = w.get("symmetric", True) and a.get("symmetric", True)
    if bits == 8 and a.get("num_bits") == 8 and act_ok and sym and kind == a.get("type"):
        if strategy in ("channel", "tensor") and fmt == f"{kind}-quantized" and kind in ("int", "float"):
            return CompressedW8A8("int8" if kind == "int" else "fp8", static_input=not dynamic)
    raise _unsupported(found)
