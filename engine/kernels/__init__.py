"""Triton GPU kernels of the engine: paged attention (attention.py), the fused q/k preparation and KV
store (qkv_store.py), RMSNorm (norm.py) and SwiGLU (activation.py)."""
