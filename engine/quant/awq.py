"""AWQ checkpoints in the GEMM layout AutoAWQ writes (`version: gemm`).

Per linear layer (K inputs, N outputs, G = K / group_size):
    qweight [K, N / 8] int32   the output dimension packed, 8 four-bit fields per word
    qzeros  [G, N / 8] int32   zero points, packed the same way
    scales  [G, N]             float16
W[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = k // group_size; zero points are stored as they are.

Within each word the fields are interleaved: field i (from the low bits) holds output column
AWQ_ORDER[i] of the word's eight, the order AutoAWQ's packer writes for its dequantizing kernels.
Unpacking puts the columns back in order, so fused shards then concatenate along N like any other.
"""

from __future__ import annotations

import torch

from engine.quant import IntWeight, QuantScheme, pack_int32, quantize_rtn, unpack_int32
from engine.quant.checks import Shard, UnsupportedQuantization, config_int

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of a word holds column AWQ_ORDER[i]
_COLUMN_FIELD = [AWQ_ORDER.index(c) for c in range(8)]  # column c sits in field _COLUMN_FIELD[c]
GROUP_SIZES = (-1, 32, 64, 128)


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    fields = unpack_int32(packed, 4, dim=1)  # [R, N], column 8w + i = field i of word w
    index = torch.tensor(_COLUMN_FIELD, device=packed.device)
    return fields.view(fields.shape[0], -1, 8)[:, :, index].reshape(fields.shape)


def _pack_columns(values: torch.Tensor) -> torch.Tensor:
    index = torch.tensor(AWQ_ORDER, device=values.device)
    return pack_int32(values.view(values.shape[0], -1, 8)[:, :, index].reshape(values.shape), 4, dim=1)


class AWQ(QuantScheme):
    name = "awq"
    marker = "qweight"

    def __init__(self, group_size: int):
        self.group_size = group_size

    def describe(self) -> str:
        return f"awq (gemm layout, 4-bit, group {self.group_size})"

    def check_shard(self, t, k, n):
        shard = Shard("AWQ", t, k, n, 4, self.group_size)
        shard.expect_packing(8, n)
        shard.expect("qweight", "int32", (k, n // 8))
        shard.expect("qzeros", "int32", (shard.groups, n // 8))
        shard.expect("scales", "float", (shard.groups, n))

    def unpack(self, t: dict[str, torch.Tensor]) -> IntWeight:
        q = _unpack_columns(t["qweight"])
        zeros = _unpack_columns(t["qzeros"])
        scales = t["scales"]  # check_shard has matched the shapes
        group_size = q.shape[0] if self.group_size == -1 else self.group_size
        return IntWeight(q, scales, zeros, 4, group_size)

    def tensors_of(self, weight):
        return pack(quantize_rtn(weight, 4, self.group_size, symmetric=False))

    def make_linear(self, shards, bias, dtype):
        from engine.layers.linear import weight_only_linear

        return weight_only_linear([self.unpack(s) for s in shards], bias, dtype, self.fragment_copies)


def pack(weight: IntWeight) -> dict[str, torch.Tensor]:
    """The checkpoint tensors AutoAWQ writes for a 4-bit weight (the inverse of unpack)."""
    return {"qweight": _pack_columns(weight.q), "qzeros": _pack_columns(weight.zeros), "scales": weight.scales}


def from_config(qc: dict) -> AWQ:
    bits = config_int(qc, "bits", "w_bit", default=4)
    group_size = config_int(qc, "group_size", "q_group_size", default=128)
    version = str(qc.get("version", "gemm")).lower()
    zero_point = bool(qc.get("zero_point", True))
    if bits != 4 or group_size not in GROUP_SIZES or version != "gemm" or not zero_point:
        raise UnsupportedQuantization(
            f"AWQ checkpoint with bits={bits}, group_size={group_size}, version={version}, zero_point={zero_point}; "
            f"supported: bits 4, group_size {'/'.join(map(str, GROUP_SIZES))}, version gemm, zero_point true"
        )
    return AWQ(group_size)
