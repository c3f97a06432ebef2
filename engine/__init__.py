"""pagoda's inference engine: a library with no HTTP in it."""

import logging

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
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


def _default_logging() -> None:
    """Start-up reports (model, KV capacity) reach the console unless the application set up logging."""
    log = logging.getLogger("pagoda")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


_default_logging()
