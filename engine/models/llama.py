"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (qkv bias) and, with q/k norm, Qwen3.

Tokens are flat ([T] ids, [T] positions) across all sequences of a step; attention finds each
sequence's context through the paged cache (engine/attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import Attention, AttentionBackend, AttentionMetadata, QKPrep
from engine.layers.linear import QuantizedActivation, fused_input_quant
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.ops import Ops


@dataclass
class DecoderConfig:
    """The architecture knobs read from a HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config: dict, *, qk_norm: bool = False, attention_bias: bool | None = None) -> DecoderConfig:
        num_heads = config["num_attention_heads"]
        if attention_bias is None:
            attention_bias = bool(config.get("attention_bias", False))
        sliding = config.get("sliding_window")
        if not config.get("use_sliding_window", True):
            sliding = None
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rope=rope_parameters(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=qk_norm,
            sliding_window=sliding,
        )


class SelfAttention(nn.Module):
    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        # One fused projection: a single matmul instead of three per layer.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend.ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, backend.ops) if cfg.qk_norm else None
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, backend)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | QuantizedActivation, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.q_size // self.head_dim, self.head_dim)
        k = k.view(-1, self.kv_size // self.head_dim, self.head_dim)
        v = v.view(-1, self.kv_size // self.head_dim, self.head_dim)
        # The norms and rotary run inside the attention call, fused with the KV store on the GPU.
        out = self.attn(q, k, v, meta, QKPrep(positions, self.rotary, self.q_norm, self.k_norm))
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, ops: Ops):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        quant = fused_input_quant(self.ops, self.down_proj, gate_up.shape[0])
        if quant is None:
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        return self.down_proj(QuantizedActivation(*self.ops.silu_and_mul(gate_up, quant=quant)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)
        self.self_attn = SelfAttention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)
        self.mlp = MLP(cfg, backend.ops)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # W8A8 projections with dynamic input scales take their input quantized by the norm before them.
        ops, rows = self.mlp.ops, x.shape[0]
        quant = fused_input_quant(ops, self.self_attn.qkv_proj, rows)
        if residual is None:
            residual = x
            x = self.input_layernorm(x, quant=quant)
        else:
            x, residual = self.input_layernorm(x, residual, quant=quant)
        x = self.self_attn(positions, x, meta)
        quant = fused_input_quant(ops, self.mlp.gate_up_proj, rows)
        x, residual = self.post_attention_layernorm(x, residual, quant=quant)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Llama 2/3 and Mistral (same graph; Mistral's sliding window caps max_model_len instead)."""

    # HF checkpoint names of the projections that live fused here: (fused name, shard index).
    packed = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False
    attention_bias: bool | None = None  # None: the config's `attention_bias`

    def __init__(self, hf_config: dict, backend: AttentionBackend | None = None):
        """`backend`: the attention backend every layer calls (and whose ops the norms and MLPs use);
        default: the torch reference."""
        super().__init__()
        if backend is None:
            from engine.attention.torch_ref import TorchBackend

            backend = TorchBackend()
        cfg = DecoderConfig.from_hf(hf_config, qk_norm=self.qk_norm, attention_bias=self.attention_bias)
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # One cos/sin table shared by every layer (it is large at long max_position_embeddings).
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend.ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] final hidden states."""
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    @classmethod
    def fused_name(cls, name: str) -> tuple[str, int] | None:
        """A checkpoint tensor's or module's name (without "model.") as this model names it when it is a shard
        of a fused layer (layers.0.self_attn.k_proj.weight -> (layers.0.self_attn.qkv_proj.weight, 1)); None
        when it is not one."""
        dotted = f"{name}."
        for part, (fused, index) in cls.packed.items():
            if f".{part}." in dotted:
                return dotted.replace(f".{part}.", f".{fused}.")[:-1], index
        return None

    @classmethod
    def shard_names(cls, name: str) -> list[str]:
        """The checkpoint names (without "model.") that fill this model's parameter or module `name`: a fused
        one's shards, in order; otherwise `name` itself."""
        dotted = f"{name}."
        parts = [
            dotted.replace(f".{fused}.", f".{part}.")[:-1]
            for part, (fused, _) in cls.packed.items()
            if f".{fused}." in dotted
        ]
        return parts or [name]

    def load_weight(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]) -> bool:
        """Copy one checkpoint tensor into its (possibly fused) parameter in `params` (the model's
        named_parameters, which the loader holds for the load only: kept on the model, the map would keep the
        16-bit weights of the linears a quantization replaces alive); False if unused."""
        name = name.removeprefix("model.")
        if "rotary_emb.inv_freq" in name:
            return False
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return False
        shard = self.fused_name(name)
        if shard is not None:
            fused, index = shard
            sizes = self.shard_sizes(fused.rpartition(".")[0])
            start = sum(sizes[:index])
            _copy_checked(name, params[fused].data.narrow(0, start, sizes[index]), tensor)
            return True
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        _copy_checked(name, params[name].data, tensor)
        return True

    def shard_sizes(self, name: str) -> list[int]:
        """The outputs of each checkpoint shard (shard_names' order) that fills this model's fused linear `name`."""
        cfg = self.config
        if name.endswith("qkv_proj"):
            return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        return [cfg.intermediate_size, cfg.intermediate_size]


def _copy_checked(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
    # copy_ would broadcast a tensor of a wrong but compatible shape ([1, n] into [m, n]) without a word.
    if target.shape != tensor.shape:
        raise ValueError(
            f"tensor {name!r} has shape {list(tensor.shape)}, but config.json makes it {list(target.shape)}"
        )
    target.copy_(tensor)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with a bias on the q/k/v projections (always, whatever the config says)."""

    attention_bias = True
