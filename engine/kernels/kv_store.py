"""Scatter each new token's K/V rows into the paged cache (Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_st,
    k_sh,
    k_sd,
    v_st,
    v_sh,
    v_sd,
    kc_sb,
    kc_so,
    kc_sh,
    kc_sd,
    vc_sb,
    vc_so,
    vc_sh,
    vc_sd,
    block_size,
    n_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token, all its heads at once.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # A negative slot (padded CUDA-graph rows) masks every load and store: no branch,
    # so the launch stays the same for any slot values. The slot is broadcast before the
    # comparison because the triton 3.9 interpreter mistypes (scalar bool & block) masks.
    valid = (slot + tl.zeros([BLOCK_H, 1], dtype=tl.int64)) >= 0
    mask = (heads < n_heads) & (dims < head_dim) & valid
    # Block and offset from the slot, so the cache strides need not be contiguous.
    block = slot // block_size
    offset = slot % block_size
    k = tl.load(k_ptr + t * k_st + heads * k_sh + dims * k_sd, mask=mask)
    v = tl.load(v_ptr + t * v_st + heads * v_sh + dims * v_sd, mask=mask)
    kc = k_cache_ptr + block * kc_sb + offset * kc_so + heads * kc_sh + dims * kc_sd
    vc = v_cache_ptr + block * vc_sb + offset * vc_so + heads * vc_sh + dims * vc_sd
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write k/v [T, KVH, D] (any strides) into k_cache/v_cache [num_blocks, block_size, KVH, D]
    at flat slots `slot_mapping` [T] (block * block_size + offset). Tokens whose slot is
    negative are skipped: nothing is written for them."""
    assert k.shape == v.shape and k.dim() == 3 and slot_mapping.shape == (k.shape[0],)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:]
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride(),
        *v.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        k_cache.shape[1],
        k.shape[1],
        k.shape[2],
        BLOCK_H=triton.next_power_of_2(k.shape[1]),
        BLOCK_D=triton.next_power_of_2(k.shape[2]),
        num_warps=4 if k.shape[1] * k.shape[2] >= 1024 else 1,
    )
