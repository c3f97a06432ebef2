"""`--quantization int8` on a full-precision checkpoint: weight-only INT8 (W8A16) made at load, each linear's
weight (but the LM head's) rounded to 255 levels with one scale per output channel (absolute maximum / 127)."""

from __future__ import annotations

from engine.quant import QuantScheme, quantize_rtn


class Int8AtLoad(QuantScheme):
    name = "int8"

    def describe(self) -> str:
        return "int8 (weight-only, per-channel, made at load)"

    def make_linear(self, shards, bias, dtype):
        from engine.layers.linear import weight_only_linear

        return weight_only_linear([quantize_rtn(shards[0]["weight"], 8, -1)], bias, dtype, self.fragment_copies)
