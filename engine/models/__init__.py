"""Architecture registry: HF `architectures[0]` -> model class."""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(hf_config: dict) -> type[nn.Module]:
    names = hf_config.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise ValueError(f"unsupported architecture {names!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
