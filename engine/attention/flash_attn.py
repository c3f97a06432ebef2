"""The flash_attn backend (`flash_attn_varlen_func` with `block_table`, from the `flash-attn` package or
the build vLLM ships), and the flash-attn-4 lookups the triton backend uses for long prompts."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata
from engine.attention.triton import TritonBackend


@functools.cache
def flash_attn_module():
    """(flash_attn_varlen_func, is_vllm_build) or None when no FlashAttention build imports."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func, True
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func, False
    except ImportError:
        return None


@functools.cache
def fa4_varlen():
    """flash-attn-4's `flash_attn_varlen_func` (FlashAttention's CuTe-DSL build), or None where it does
    not import."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # not installed, or its CUDA libraries do not load here
        return None
    return flash_attn_varlen_func


def fa4_prefill_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether long prompt steps should attend through flash-attn-4 here rather than pagoda's kernels.

    Measured on the H100 (`bench/gpu_check.py kernels` and `long-prompt`, WRITEUP.md): its
    warp-specialized Hopper forward (one warpgroup's softmax overlapped with another's matmuls, which
    Triton does not produce from prefill_fresh) is faster than prefill_fresh from a few thousand
    tokens and slower on short prompts; a prompt's time to first token is level at 2k tokens and
    shorter beyond, hence the default threshold of 2,048. Its decode (no split-KV on Hopper) loses to
    pagoda's at every batch, so decodes never go there. Hopper only (where it was measured), its
    16-bit types, head dims of 8..256 in multiples of 8."""
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] == 9
        and dtype in (torch.bfloat16, torch.float16)
        and 8 <= head_dim <= 256
        and head_dim % 8 == 0
        and fa4_varlen() is not None
    )


class FlashAttnBackend(TritonBackend):
    """Attention through FlashAttention's paged varlen forward; the KV store and the fused q/k
    preparation stay the Triton kernel's, and so do the norm and SwiGLU ops."""

    name = "flash_attn"
    supports_verify_graphs = False  # its decode is the varlen prefill, which knows no padded query rows
    supports_prompt_graphs = False  # the varlen kernel's grid follows the step's lengths, read on the host

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.varlen, self.vllm_build = flash_attn_module()
        self.fa_version = 3 if torch.cuda.get_device_capability(device)[0] == 9 else 2

    def plan(self, meta: AttentionMetadata) -> None:
        # Upstream FlashAttention wants cumulative key lengths; vLLM's build takes the lengths themselves.
        if not self.vllm_build:
            meta.plan = F.pad(meta.seq_lens_tensor.cumsum(0, dtype=torch.int32), (1, 0))

    def prefill(self, layer, q, k, v, meta):
        kwargs = dict(
            cu_seqlens_q=meta.query_start_tensor,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=layer.scale,
            causal=True,
            block_table=meta.block_tables,
        )
        if self.vllm_build:
            result = self.varlen(
                q, layer.k_cache, layer.v_cache, seqused_k=meta.seq_lens_tensor, fa_version=self.fa_version, **kwargs
            )
        else:
            result = self.varlen(q, layer.k_cache, layer.v_cache, cu_seqlens_k=meta.plan, **kwargs)
        return result

    def decode(self, layer, q, meta):
        return self.prefill(layer, q, None, None, meta)


class TritonFa4Backend(TritonBackend):
    """TritonBackend whose prompt steps with a query run of at least `min_tokens` tokens attend
    through flash-attn-4 (see flash_attn.fa4_prefill_applies for where that pays)."""

    name = "triton+fa4"

    def __init__(self, device: torch.device, min_tokens: int):
        super().__init__(device)
        self.min_tokens = min_tokens
        # flash-attn-4 compiles a kernel on its first call of each kind, too.
        self.warmup_prompt_lens = ((9, 8), (min_tokens,))

    def prefill(self, layer, q, k, v, meta):
        # A prompt-step graph's launch (meta.tile_map) stays Triton's, whatever its captured size.
        if meta.tile_map is not None or meta.max_query_len < self.min_tokens:
            return super().prefill(layer, q, k, v, meta)
        result = fa4_prefill(layer, q, k, v, meta)
        return result


def fa4_prefill(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """A prompt step through flash-attn-4: from the step's own k/v (prepared in place) when every
    sequence is a whole prompt, as prefill_fresh does, else through the block tables, which also
    covers cached context and the decodes beside the prompt."""
    common = dict(
        cu_seqlens_q=meta.query_start_tensor,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=layer.scale,
        causal=True,
    )
    if meta.fresh:
        result = fa4_varlen()(q, k, v, cu_seqlens_k=meta.query_start_tensor, **common)
    else:
        result = fa4_varlen()(
            q, layer.k_cache, layer.v_cache, seqused_k=meta.seq_lens_tensor, page_table=meta.block_tables, **common
        )
    return result[0] if isinstance(result, tuple) else result  # (out, lse)
