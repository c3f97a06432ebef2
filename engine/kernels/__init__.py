"""Triton GPU kernels of the engine: paged attention (attention.py: the shared tile loop and the paged
prefill; decode.py; prefill_fresh.py), the fused q/k preparation and KV store (qkv_store.py), RMSNorm
(norm.py) and SwiGLU (activation.py)."""
