"""`--quantization fp8` on a full-precision checkpoint: each linear's weight (but the LM head's) becomes
float8 E4M3 with one float32 scale per output channel (its absolute maximum / 448), made at load;
activations are quantized per token at run time (engine/layers/linear.py ScaledLinear)."""

from __future__ import annotations

from engine.quant import QuantScheme


class Fp8AtLoad(QuantScheme):
    name = "fp8"

    def describe(self) -> str:
        return "fp8 (E4M3 per-channel weights made at load, dynamic per-token activations)"

    def make_linear(self, shards, bias, dtype):
        from engine.layers.linear import FP8, ScaledLinear, quantize_per_row

        weight, scale = quantize_per_row(shards[0]["weight"], FP8)
        return ScaledLinear(weight, scale.reshape(-1), bias, dtype)
