"""pagoda's inference engine: a library with no HTTP in it.

The names below load on first use, so that importing a light module of the package (engine.config,
for the command line's flags) does not load torch and the model code.
"""

import importlib
import logging

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "PoolingParams": "engine.pooling_params",
    "InvalidParameter": "engine.sampling_params",
    "RequestOutput": "engine.sequence",
    "CompletionOutput": "engine.sequence",
    "TokenLogprobs": "engine.sequence",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "PoolingParams",
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
