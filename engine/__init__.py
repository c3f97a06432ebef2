"""pagoda's inference engine: a library with no HTTP in it."""

from engine.config import EngineConfig
from engine.llm_engine import LLM, LLMEngine
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.sequence import CompletionOutput, RequestOutput, TokenLogprobs

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "InvalidParameter",
    "RequestOutput",
    "CompletionOutput",
    "TokenLogprobs",
]
