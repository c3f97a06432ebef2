"""Qwen3 (dense): the Llama graph plus an RMSNorm over each head of q and k before rotary."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
