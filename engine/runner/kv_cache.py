"""The paged KV cache: how many blocks fit, the per-layer K/V tensors, the CPU swap pool, and the
block copies (swap out / in, copy-on-write) the scheduler asks for."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import Attention
from engine.kv_fp8 import raw

log = logging.getLogger("pagoda.runner")


@dataclass
class KVCache:
    """K and V of every attention layer, [num_blocks, block_size, num_kv_heads, head_dim] each, in `dtype`:
    the model's, or a float8 type (EngineConfig.kv_cache_dtype; one byte an element, so a block costs
    half and the same memory holds twice the blocks). Block copies move bytes, whatever the dtype."""

    layers: list[Attention]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    num_blocks: int = 0
    caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    swap_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across every layer."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.block_size * self.num_kv_heads * self.head_dim * elem

    def bind(self, num_blocks: int) -> None:
        """New zeroed K/V caches of `num_blocks` blocks bound to every attention layer (0: unbind).
        Throwaway caches (profiling, compiling, measuring the graphs) come through here too."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.caches = []
        for attn in self.layers:
            if num_blocks:
                attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
                attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            else:
                attn.k_cache = attn.v_cache = torch.empty(0)
            self.caches.append((attn.k_cache, attn.v_cache))
        self.num_blocks = num_blocks

    def allocate_swap_space(self, num_blocks: int) -> None:
        """CPU copies of the KV layout for `num_blocks` swapped-out blocks (pinned when the cache is on a GPU)."""
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        pin = self.device.type == "cuda"
        self.swap_caches = [
            (torch.zeros(shape, dtype=self.dtype, pin_memory=pin), torch.zeros(shape, dtype=self.dtype, pin_memory=pin))
            for _ in self.caches
        ]

    def swap_blocks(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copy whole blocks (all layers) device -> CPU pool (to_cpu) or back, as (src, dst) pairs."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs])
        dst = torch.tensor([d for _, d in pairs])
        for (k, v), (cpu_k, cpu_v) in zip(self.caches, self.swap_caches):
            k, v, cpu_k, cpu_v = raw(k), raw(v), raw(cpu_k), raw(cpu_v)
            if to_cpu:
                cpu_k.index_copy_(0, dst, k.index_select(0, src.to(self.device)).cpu())
                cpu_v.index_copy_(0, dst, v.index_select(0, src.to(self.device)).cpu())
            else:
                k.index_copy_(0, dst.to(self.device), cpu_k.index_select(0, src).to(self.device))
                v.index_copy_(0, dst.to(self.device), cpu_v.index_select(0, src).to(self.device))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers) before a shared one is written."""
        if not copies:
            return
        # Non-blocking from a host array: torch.tensor(list, device=cuda) would hold the host until the
        # device reached the copy (every step with a copy-on-write, once per cache with a draft model).
        pairs = torch.from_numpy(np.asarray(copies, dtype=np.int64)).to(self.device, non_blocking=True)
        src, dst = pairs[:, 0], pairs[:, 1]
        for k_cache, v_cache in self.caches:
            k_cache, v_cache = raw(k_cache), raw(v_cache)
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]


def blocks_that_fit_on_gpu(
    device: torch.device,
    utilization: float,
    bytes_per_block: int,
    profile_forward: Callable[[], None],
    graph_memory: Callable[[], int],
) -> int:
    """`utilization` of the card, minus what is in use now (weights), minus the activation peak of
    the largest forward (measured by running `profile_forward`), minus what the CUDA graphs will
    hold (`graph_memory`, measured by capturing them once), in blocks."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free_before, total = torch.cuda.mem_get_info(device)
    baseline = torch.cuda.memory_allocated(device)
    profile_forward()
    peak = torch.cuda.max_memory_allocated(device)
    # Memory other processes (and the CUDA context) hold counts against our budget too.
    used_elsewhere = total - free_before - torch.cuda.memory_reserved(device)
    budget = total * utilization - used_elsewhere - peak
    torch.cuda.empty_cache()
    graphs = graph_memory()
    log.info(
        "memory: total %.1f GiB, weights %.2f GiB, activation peak %.2f GiB, CUDA graphs %.2f GiB",
        total / 2**30,
        baseline / 2**30,
        (peak - baseline) / 2**30,
        graphs / 2**30,
    )
    return int((budget - graphs) // bytes_per_block)
