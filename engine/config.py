"""EngineConfig: every engine knob, with its default."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import BACKENDS

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory; None: the embedded default model
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: cuda if available, else cpu
    load_format: str = "auto"  # auto (safetensors) | dummy (random weights from config.json)
    seed: int = 0  # seeds dummy weights and the draws for unseeded requests
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 2 << 30  # the KV pool's byte budget on the CPU
    num_gpu_blocks_override: int | None = None  # fix the pool size (tests, experiments)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # recompute | swap (to a CPU pool of swap_space GiB)
    queue_timeout: float | None = None  # seconds a request may wait unscheduled before it fails ("timeout")
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out KV blocks (preemption_mode="swap")
    attention_backend: str = "auto"  # auto | torch | triton | flash_attn | cpu (auto: triton on CUDA, cpu on the CPU)
    enforce_eager: bool = False  # no CUDA graphs
    max_graph_batch_size: int = 512  # decode batches up to this size replay a captured CUDA graph
    # Steps with prompt tokens, up to this many tokens in all, replay piecewise CUDA graphs (0: never).
    max_prefill_graph_tokens: int = 1024
    # With the triton backend on a Hopper GPU, attention of prompt steps whose longest query run has at
    # least this many tokens goes to flash-attn-4 when it is installed (0: never): level with pagoda's
    # kernels at 2,048 tokens, faster beyond, slower below. See engine/attention/flash_attn.py.
    fa4_prefill_min_tokens: int = 2048
    # Schedule and launch step N+1 while step N runs on the device. None: on for CUDA, where the host's
    # work per step hides behind the GPU's; off on the CPU, where the same cores do both and nothing overlaps.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or auto, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.attention_backend not in ("auto", *BACKENDS):
            raise ValueError(
                f"attention_backend must be one of auto, {', '.join(BACKENDS)}; got {self.attention_backend!r}"
            )
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.fa4_prefill_min_tokens < 0:
            raise ValueError("fa4_prefill_min_tokens must be 0 (never) or more")
        if self.max_prefill_graph_tokens < 0:
            raise ValueError("max_prefill_graph_tokens must be 0 (no graphs) or more")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
