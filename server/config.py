"""ServerConfig: the HTTP server's knobs, with their defaults and help, as EngineConfig holds the engine's.

Field metadata as in engine/config.py (help, choices, min, default_help), plus for list fields:

    metavar   the flag's value name
    repeat    True: the flag is given once per value (--api-key A --api-key B); otherwise it takes
              one or more values at once (--served-model-name A B)

This module imports nothing heavy (no torch), like the rest of server/ outside the engine's reach.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def knob(default: Any, help: str, **metadata: Any) -> Any:
    """A config field with its help text and flag metadata (see the module's docstring)."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class ServerConfig:
    host: str = knob("0.0.0.0", "address to listen on (0.0.0.0: every interface)")
    port: int = knob(8000, "port to listen on")
    api_key: list[str] | None = knob(
        None,
        "require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics; repeat the flag to "
        "accept several keys, each with its own rate limits",
        metavar="KEY",
        repeat=True,
        default_help="$PAGODA_API_KEY; unset: no auth",
    )
    rate_limit_requests_per_minute: int | None = knob(
        None,
        "per client (API key, or address without one): at most N requests a minute, as a token bucket; over it, "
        "429 with Retry-After",
        min=1,
        metavar="N",
        default_help="no limit",
    )
    rate_limit_tokens_per_minute: int | None = knob(
        None,
        "per client: at most N tokens a minute, counting prompt + max_tokens of each choice; over it, 429 with "
        "Retry-After",
        min=1,
        metavar="N",
        default_help="no limit",
    )
    served_model_name: list[str] | None = knob(
        None,
        "the model name(s) clients use; the first is the one responses carry",
        metavar="NAME",
        default_help="MODEL as given, or SmolLM2-135M-Instruct",
    )
    max_waiting_requests: int | None = knob(
        None,
        "at most this many requests queued without a first token; beyond it requests are answered 503 with Retry-After",
        min=0,
        default_help="unbounded",
    )
    shutdown_timeout: float = knob(30.0, "on SIGTERM, seconds to let in-flight requests finish before they are cut")
    uvicorn_log_level: str = knob("info", "uvicorn's log level", choices=LOG_LEVELS)
    disable_uvicorn_access_log: bool = knob(False, "no log line per HTTP request")
