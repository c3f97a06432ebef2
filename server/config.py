"""ServerConfig: the HTTP server's knobs, with their defaults and help, as EngineConfig holds the engine's.

Field metadata as in engine/config.py (help, choices, min, default_help), plus for list fields:

    metavar   the flag's value name
    repeat    True: the flag is given once per value (--api-key A --api-key B); otherwise it takes
              one or more values at once (--served-model-name A B)
    parse     a function from the flag's text to the value, for values given as JSON (as vLLM takes them)

This module imports nothing heavy (no torch), like the rest of server/ outside the engine's reach.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# The names of server/tool_parsers.py's and server/reasoning.py's parsers (a test keeps them in step).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def json_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM's CORS flags take them: '["https://a.example", "https://b.example"]'."""
    value = json.loads(text)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError("not a JSON list of strings")
    return tuple(value)


def knob(default: Any, help: str, **metadata: Any) -> Any:
    """A config field with its help text and flag metadata (see the module's docstring)."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class ServerConfig:
    host: str = knob("0.0.0.0", "address to listen on (0.0.0.0: every interface)")
    port: int = knob(8000, "port to listen on")
    api_key: list[str] | None = knob(
        None,
        "require 'Authorization: Bearer KEY' on every endpoint but /health, /metrics and the playground page /; "
        "repeat the flag to accept several keys, each with its own rate limits",
        metavar="KEY",
        repeat=True,
        default_help="$PAGODA_API_KEY; unset: no auth",
    )
    rate_limit_requests_per_minute: int | None = knob(
        None,
        "per client (its API key when --api-key is set, else its address; see --forwarded-allow-ips): at most N "
        "requests a minute, as a token bucket; over it, 429 with Retry-After",
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
    forwarded_allow_ips: str | None = knob(
        None,
        "the proxies whose X-Forwarded-For (and X-Forwarded-Proto) header is believed, as uvicorn takes them: a "
        "comma-separated list of addresses or networks, or *; a request from one of them counts as from the "
        "address the header names (for rate limits and the access log)",
        metavar="IPS",
        default_help="none: the client is the connection's peer address",
    )
    served_model_name: list[str] | None = knob(
        None,
        "the model name(s) clients use: each is taken as a request's model and listed by /v1/models; the first "
        "is the one responses carry",
        metavar="NAME",
        default_help="MODEL as given, or SmolLM2-135M-Instruct",
    )
    max_waiting_requests: int | None = knob(
        None,
        "at most this many sequences (a request's prompts x n) queued without a first token; a request that would "
        "pass it is answered 503 with Retry-After, one that alone passes it 400",
        min=0,
        default_help="unbounded",
    )
    max_request_body_bytes: int = knob(
        16 * 1024 * 1024,
        "refuse a request body over BYTES with 413, before it is parsed (at once when its Content-Length says "
        "so, else as soon as that much has arrived)",
        min=1,
        metavar="BYTES",
    )
    max_sequences_per_request: int = knob(
        1024,
        "at most N sequences (prompts x n) in one request; beyond it the request is refused with 400",
        min=1,
        metavar="N",
    )
    max_stored_responses: int = knob(
        1000,
        "at most N finished /v1/responses responses kept in memory (those with store=true) for "
        "previous_response_id and GET /v1/responses/{id}; beyond it the least recently used is dropped",
        min=0,
        metavar="N",
    )
    enable_auto_tool_choice: bool = knob(
        False, 'tool_choice "auto": parse the tool calls the model writes (needs --tool-call-parser)'
    )
    tool_call_parser: str | None = knob(
        None,
        "how the model writes tool calls: hermes (<tool_call> JSON: Qwen2.5, Qwen3, Hermes), llama3_json, "
        "mistral ([TOOL_CALLS]) or pythonic ([f(x=1)]: Llama 3.2/4)",
        choices=TOOL_CALL_PARSERS,
        metavar="NAME",
        default_help="none",
    )
    reasoning_parser: str | None = knob(
        None,
        "split <think>...</think> reasoning into reasoning_content: qwen3, or deepseek_r1 (reasoning open from "
        "the first token)",
        choices=REASONING_PARSERS,
        metavar="NAME",
        default_help="none",
    )
    chat_template: str | None = knob(
        None,
        "a Jinja chat template (a file, or the template itself) to use instead of the tokenizer's",
        metavar="TEMPLATE",
        default_help="the tokenizer's",
    )
    generation_config: str = knob(
        "auto",
        "auto: the model's generation_config.json supplies default temperature, top_p, top_k, min_p and "
        "repetition_penalty for requests that omit them; vllm: ignore it; or a folder holding one",
        metavar="auto|vllm|DIR",
    )
    metrics_prefix: str = knob(
        "pagoda",
        "the prefix of every /metrics series but process_*: vllm exports them as vLLM does (vllm:...), so a vLLM "
        "dashboard or autoscaler works unchanged",
        metavar="PREFIX",
    )
    otlp_traces_endpoint: str | None = knob(
        None,
        "send a trace span per request (llm_request, with vLLM's gen_ai.* attributes) to this OpenTelemetry "
        "collector over OTLP/HTTP, e.g. http://localhost:4318/v1/traces (needs pip install 'pagoda[otel]')",
        metavar="URL",
        default_help="no tracing",
    )
    root_path: str | None = knob(
        None,
        "the path prefix a proxy serves the API under (e.g. /api): routes answer with and without it, and the "
        "OpenAPI docs link through it",
        metavar="PATH",
        default_help="none",
    )
    allowed_origins: tuple[str, ...] = knob(
        ("*",),
        "CORS: the origins whose web pages may call the API, as a JSON list",
        parse=json_list,
        metavar="JSON",
        default_help='["*"]: any',
    )
    allowed_methods: tuple[str, ...] = knob(
        ("*",),
        "CORS: the HTTP methods they may use, as a JSON list",
        parse=json_list,
        metavar="JSON",
        default_help='["*"]: any',
    )
    allowed_headers: tuple[str, ...] = knob(
        ("*",),
        "CORS: the request headers they may send, as a JSON list",
        parse=json_list,
        metavar="JSON",
        default_help='["*"]: any',
    )
    allow_credentials: bool = knob(False, "CORS: let those pages send cookies and Authorization headers")
    ssl_keyfile: str | None = knob(
        None, "serve HTTPS: the private key (PEM) of --ssl-certfile", metavar="FILE", default_help="plain HTTP"
    )
    ssl_certfile: str | None = knob(
        None, "serve HTTPS: the certificate chain (PEM), with --ssl-keyfile", metavar="FILE", default_help="plain HTTP"
    )
    disable_fastapi_docs: bool = knob(False, "no /docs page and no /openapi.json")
    log_requests: bool = knob(
        True,
        "a log line for each request as it ends: its id, prompt and generated tokens, TTFT, end-to-end time and "
        "finish reason",
        flags=("--enable-log-requests",),
        off_flags=("--disable-log-requests",),
    )
    max_log_len: int | None = knob(
        None,
        "taken for vLLM's command lines: pagoda's request log lines print no prompt text, so there is nothing to cut",
        min=0,
        metavar="N",
        default_help="all of it",
    )
    shutdown_timeout: float = knob(
        30.0,
        "on SIGTERM, seconds to let in-flight requests finish; then each one still running ends with a 503 error "
        "(in a stream: an error event, then [DONE]) and the process exits 1",
        min=0,
    )
    header_read_timeout: float = knob(
        30.0,
        "close a connection whose request head (request line and headers) is not complete SECONDS after the "
        "connection opened, or after the head's first byte on a kept-alive connection (slowloris)",
        min=0.1,
        metavar="SECONDS",
    )
    send_timeout: float = knob(
        30.0,
        "drop a connection whose client has read nothing for SECONDS while the server had data to send (its "
        "kernel buffers full, about 300 KB unread): its requests are aborted as at a disconnect, freeing their KV "
        "blocks",
        min=0.1,
        metavar="SECONDS",
    )
    uvicorn_log_level: str = knob("info", "uvicorn's log level", choices=LOG_LEVELS)
    disable_uvicorn_access_log: bool = knob(False, "no log line per HTTP request")
