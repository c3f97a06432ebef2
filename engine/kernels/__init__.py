"""Triton GPU kernels of the engine."""
