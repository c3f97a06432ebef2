"""GPTQ checkpoints as auto-gptq defined them and GPTQModel writes them.

Per linear layer (W is [N outputs, K inputs]; G = K / group_size groups):
    qweight [K * bits / 32, N] int32   the input dimension packed, 32 / bits rows per word, low bits first
    qzeros  [G, N * bits / 32] int32   zero points, the output dimension packed the same way
    scales  [G, N]                     float16 or bfloat16
    g_idx   [K] int32                  each input row's group (act-order / desc_act permutes it)
W[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = g_idx[k].

The "gptq" checkpoint format (auto-gptq, and GPTQModel's default `format="gptq"`) stores each zero point
minus one, so z is the stored field + 1 (modulo 2**bits: a zero of 0 wrapped to all ones); GPTQModel's
`gptq_v2` format (`checkpoint_format: gptq_v2`) stores z itself.
"""

from __future__ import annotations

import torch

from engine.quant import IntWeight, QuantScheme, pack_int32, quantize_rtn, unpack_int32
from engine.quant.checks import Shard, UnsupportedQuantization, config_int

BITS = (4, 8)
GROUP_SIZES = (-1, 32, 64, 128)
FORMATS = ("gptq", "gptq_v2")


class GPTQ(QuantScheme):
    name = "gptq"
    marker = "qweight"

    def __init__(self, bits: int, group_size: int, v2: bool, sym: bool, desc_act: bool):
        self.bits, self.group_size, self.v2, self.sym, self.desc_act = bits, group_size, v2, sym, desc_act

    def describe(self) -> str:
        fmt = "gptq_v2" if self.v2 else "gptq"
        return (
            f"gptq ({fmt} format, {self.bits}-bit, group {self.group_size}, sym={self.sym}, desc_act={self.desc_act})"
        )

    def check_shard(self, t, k, n):
        shard, per = Shard("GPTQ", t, k, n, self.bits, self.group_size), 32 // self.bits
        shard.expect_packing(per, k, n)
        shard.expect("qweight", "int32", (k // per, n))
        shard.expect("qzeros", "int32", (shard.groups, n // per))
        shard.expect("scales", "float", (shard.groups, n))
        if "g_idx" in t:
            shard.expect_groups("g_idx")

    def unpack(self, t: dict[str, torch.Tensor]) -> IntWeight:
        mask = (1 << self.bits) - 1
        q = unpack_int32(t["qweight"], self.bits, dim=0)
        zeros = unpack_int32(t["qzeros"], self.bits, dim=1)
        if not self.v2:
            zeros = (zeros + 1) & mask
        k = q.shape[0]
        scales = t["scales"]  # check_shard has matched the shapes
        group_size = k if self.group_size == -1 else self.group_size
        g_idx = t.get("g_idx")
        if g_idx is not None:
            g_idx = g_idx.to(torch.int32)
            if torch.equal(g_idx, torch.arange(k, device=g_idx.device, dtype=torch.int32) // group_size):
                g_idx = None  # the plain order: no gather needed
        return IntWeight(q, scales, zeros, self.bits, group_size, g_idx)

    def tensors_of(self, weight):
        return pack(quantize_rtn(weight, self.bits, self.group_size, self.sym), self.v2)

    def make_linear(self, shards, bias, dtype):
        from engine.layers.linear import weight_only_linear

        return weight_only_linear([self.unpack(s) for s in shards], bias, dtype, self.fragment_copies)


def pack(weight: IntWeight, v2: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a quantized weight, written as GPTQ writes them (the inverse of unpack)."""
    mask = (1 << weight.bits) - 1
    zeros = weight.zeros if v2 else (weight.zeros - 1) & mask
    k = weight.q.shape[0]
    g_idx = weight.g_idx
    if g_idx is None:
        g_idx = torch.arange(k, dtype=torch.int32, device=weight.q.device) // weight.group_size
    return {
        "qweight": pack_int32(weight.q, weight.bits, dim=0),
        "qzeros": pack_int32(zeros, weight.bits, dim=1),
        "scales": weight.scales,
        "g_idx": g_idx.to(torch.int32),
    }


def from_config(qc: dict) -> GPTQ:
    bits = config_int(qc, "bits", default=4)
    group_size = config_int(qc, "group_size", default=-1)
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if bits not in BITS or group_size not in GROUP_SIZES or fmt not in FORMATS:
        raise UnsupportedQuantization(
            f"GPTQ checkpoint with bits={bits}, group_size={group_size}, format={fmt}; supported: bits "
            f"{'/'.join(map(str, BITS))}, group_size {'/'.join(map(str, GROUP_SIZES))}, format {'/'.join(FORMATS)}"
        )
    return GPTQ(bits, group_size, fmt == "gptq_v2", bool(qc.get("sym", True)), bool(qc.get("desc_act", False)))
