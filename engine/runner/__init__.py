"""The model runner, split by job: kv_cache.py (allocation, swap, copy-on-write), step_inputs.py
(a step's flat tensors), cuda_graphs.py (decode, verify and prompt-step graphs), model_runner.py
(start-up, forward + sample)."""

from engine.runner.model_runner import LaunchedStep, ModelRunner, SampledTokens

__all__ = ["LaunchedStep", "ModelRunner", "SampledTokens"]
