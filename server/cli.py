"""The `pagoda` command: `pagoda serve [MODEL] ...` starts the OpenAI-compatible server.

Flags are spelled as `vllm serve` spells them wherever vLLM has the same knob, so a vLLM command line
carries over. They are not written here: each is generated from a field of ServerConfig (server/config.py)
or EngineConfig (engine/config.py). The flag is the field's name with dashes, its type the field's annotation
(X | None: X, default None), its choices, help and bounds the field's metadata; a bool is --x / --no-x, or a
plain --x switch when it is off by default. README.md's flag table is generated from the same fields
(`python -m server.cli flag-table --write` rewrites it; tests/test_cli.py fails when it drifts).

Other installed packages add commands through the entry point group `pagoda.commands`: each entry point is a
function that takes the subparsers object and adds its command's parser, with `run` set to a function of
the parsed arguments that returns the exit code (bench/cli.py adds `pagoda bench` so).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import logging
import os
import signal
import socket
import ssl
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("pagoda.server")

PLUGIN_GROUP = "pagoda.commands"
_README = Path(__file__).resolve().parents[1] / "README.md"
_TABLE_START = (
    "<!-- flag table: generated from ServerConfig and EngineConfig by `python -m server.cli flag-table --write` -->"
)
_TABLE_END = "<!-- end of the generated flag table -->"
# uvicorn cancels what still runs this long after --shutdown-timeout; by then pagoda has ended every
# request itself (the app's cut_off), so this is only a backstop.
_CUT_OFF_GRACE_S = 5.0
# How long /health answers 503 before a server whose engine died exits.
_DEAD_ENGINE_GRACE_S = 1.0


# ----- flags from config fields -----


def _config_classes() -> list[tuple[str, type]]:
    """(argument group, config class) in the order --help and the README list them."""
    from engine.config import EngineConfig  # with torch: when a parser is built, not when this module is imported
    from server.config import ServerConfig

    return [("HTTP server", ServerConfig), ("engine", EngineConfig)]


def _flag_fields(cls: type) -> list[tuple[dataclasses.Field, type]]:
    """Each field that is a flag, with its base type (int | None -> int, list[str] -> list). EngineConfig's
    model is the positional MODEL instead."""
    hints = typing.get_type_hints(cls)
    return [(f, _base_type(hints[f.name])) for f in dataclasses.fields(cls) if f.name != "model"]


def _base_type(annotation: typing.Any) -> type:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return typing.get_origin(annotation) or annotation


def _flags(f: dataclasses.Field) -> tuple[str, ...]:
    """The flag's spellings: its metadata's, or the field's name with dashes."""
    return f.metadata.get("flags", ("--" + f.name.replace("_", "-"),))


def default_text(f: dataclasses.Field) -> str:
    """How a field's default is told: its metadata's default_help, on/off, none, or the value."""
    if "default_help" in f.metadata:
        return f.metadata["default_help"]
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return "none" if f.default is None else str(f.default)


def _at_least(kind: type, minimum: int | float) -> Callable[[str], typing.Any]:
    def parse(text: str):
        value = kind(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
    return parse


def _add_flag(group: argparse._ArgumentGroup, f: dataclasses.Field, kind: type) -> None:
    meta = f.metadata
    kwargs: dict[str, typing.Any] = {"dest": f.name, "default": f.default}
    if "parse" in meta:
        kwargs["type"] = meta["parse"]
    elif kind is bool:
        kwargs["action"] = "store_true" if f.default is False else argparse.BooleanOptionalAction
    elif kind is list:
        if meta.get("repeat"):
            kwargs["action"] = "append"
        else:
            kwargs["nargs"] = "+"
    else:
        kwargs["type"] = _at_least(kind, meta["min"]) if "min" in meta else kind
    for key in ("choices", "metavar"):
        if key in meta:
            kwargs[key] = meta[key]
    action = group.add_argument(*_flags(f), **kwargs)
    # Set afterwards: on Python < 3.14 BooleanOptionalAction appends a "(default: True)" of its own.
    action.help = f"{meta['help']} (default: {default_text(f)})".replace("%", "%%")
    if "off_flags" in meta:
        group.add_argument(
            *meta["off_flags"], dest=f.name, action="store_false", help=f"the opposite of {_flags(f)[0]}"
        )


def _model_field() -> dataclasses.Field:
    from engine.config import EngineConfig

    return next(f for f in dataclasses.fields(EngineConfig) if f.name == "model")


def _from_args(cls: type, args: argparse.Namespace, **given: typing.Any):
    """An instance of a config class with every flag field copied from the parsed arguments."""
    return cls(**{f.name: getattr(args, f.name) for f, _ in _flag_fields(cls)}, **given)


# ----- the README's flag table -----


def _flag_cell(f: dataclasses.Field, kind: type) -> str:
    meta = f.metadata
    if kind is bool and f.default is not False:
        return f"`{_flags(f)[0]}`, `--no-{_flags(f)[0][2:]}`"
    if "off_flags" in meta:
        return ", ".join(f"`{flag}`" for flag in (*_flags(f), *meta["off_flags"]))
    value = ""
    if "choices" in meta:
        value = " {" + ",".join(meta["choices"]) + "}"
    elif kind is list:
        value = f" {meta['metavar']}" + ("" if meta.get("repeat") else "...")
    elif "metavar" in meta:
        value = f" {meta['metavar']}"
    return ", ".join(f"`{flag}{value}`" for flag in _flags(f))


def _default_cell(f: dataclasses.Field) -> str:
    if "default_help" in f.metadata or isinstance(f.default, bool) or f.default is None:
        return default_text(f)
    return f"`{f.default}`"


def _markdown(text: str) -> str:
    """Plain text as a table cell shows it: no column breaks, emphasis or HTML tags."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def flag_table() -> str:
    """README.md's table of `pagoda serve` flags, in markdown, from the same fields as the flags."""
    model = _model_field()
    rows = [("`MODEL`, `--model MODEL`", default_text(model), model.metadata["help"])]
    for _, cls in _config_classes():
        rows += [(_flag_cell(f, kind), _default_cell(f), f.metadata["help"]) for f, kind in _flag_fields(cls)]
    lines = ["| flag | default | |", "|---|---|---|"]
    lines += [f"| {flag} | {_markdown(default)} | {_markdown(help)} |" for flag, default, help in rows]
    return "\n".join(lines) + "\n"


def readme_flag_table(readme: str) -> str | None:
    """The generated table as README.md holds it (between its markers), or None when the markers are missing."""
    start, end = readme.find(_TABLE_START), readme.find(_TABLE_END)
    if start < 0 or end < start:
        return None
    return readme[start + len(_TABLE_START) : end].strip("\n") + "\n"


def write_flag_table(path: Path = _README) -> None:
    text = path.read_text()
    if readme_flag_table(text) is None:
        raise SystemExit(f"{path} has no flag table markers:\n{_TABLE_START}\n{_TABLE_END}")
    head, rest = text.split(_TABLE_START, 1)
    tail = rest.split(_TABLE_END, 1)[1]
    path.write_text(f"{head}{_TABLE_START}\n{flag_table()}{_TABLE_END}{tail}")


def _flag_table_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m server.cli flag-table", description="Print README.md's flag table, or rewrite it in place."
    )
    parser.add_argument("--write", nargs="?", const=_README, type=Path, metavar="README", help=f"default {_README}")
    args = parser.parse_args(argv)
    if args.write is None:
        print(flag_table(), end="")
    else:
        write_flag_table(args.write)
        print(f"wrote the flag table into {args.write}")
    return 0


# ----- the parser -----


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda: an OpenAI-compatible LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        # No prefix matching: a vLLM flag pagoda lacks must be refused, never taken for a longer flag it prefixes.
        allow_abbrev=False,
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/models, /tokenize, /detokenize, /health, /metrics, /version). Flags are named as vllm "
        "serve names them. SIGTERM (or Ctrl-C) stops taking requests, lets the ones in flight finish within "
        "--shutdown-timeout, and exits 0 (1 when it had to cut requests off at that timeout).",
    )
    model = _model_field()
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"{model.metadata['help']} (default: {default_text(model)})".replace("%", "%%"),
    )
    serve.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help="the same as the positional MODEL (older vLLM spelling)",
    )
    for title, cls in _config_classes():
        group = serve.add_argument_group(title)
        for f, kind in _flag_fields(cls):
            _add_flag(group, f, kind)
    serve.set_defaults(run=serve_command)
    _add_plugin_commands(commands)
    return parser


def _add_plugin_commands(commands) -> None:
    """The commands of installed packages, from the entry point group pagoda.commands (see the module's docstring)."""
    from importlib.metadata import entry_points

    seen = set(commands.choices)
    for entry in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        if entry.name in seen:  # e.g. the same package installed twice on the path
            continue
        seen.add(entry.name)
        try:
            entry.load()(commands)
        except Exception as exc:  # a broken plugin must not take `pagoda serve` down with it
            log.warning("pagoda: the command %r (%s) is unavailable: %s", entry.name, entry.value, exc)


# ----- pagoda serve -----


def _engine_config(args: argparse.Namespace, model: str | None):
    from engine.config import EngineConfig

    return _from_args(EngineConfig, args, model=model)


def _server_config(args: argparse.Namespace):
    from server.config import ServerConfig

    return _from_args(ServerConfig, args)


def _listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a taken port fails in a moment, not after the load."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    # As uvicorn binds: a restart may take the port while the last run's connections are in TIME_WAIT.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "it is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
        raise SystemExit(f"pagoda serve: cannot listen on {host} port {port}: {reason}") from None
    return sock


def serve_command(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.default_model import DEFAULT_MODEL_NAME
    from engine.loader import ModelLoadError
    from server.api import ServerSettings, build_app
    from server.chat import ChatOptions
    from server.connection import protocol_class
    from server.ratelimit import RateLimiter

    if args.model and args.model_flag and args.model != args.model_flag:
        raise SystemExit("pagoda serve: give the model once (MODEL or --model)")
    args.model = args.model or args.model_flag
    http = _server_config(args)
    _check_tls(http)
    names = http.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    api_keys = http.api_key or ([os.environ["PAGODA_API_KEY"]] if os.environ.get("PAGODA_API_KEY") else [])
    try:
        config = _engine_config(args, args.model)  # the flags first: a bad one is named whatever holds the port
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    sock = _listening_socket(http.host, http.port)
    try:
        engine = AsyncEngine(config)  # loads the model and sizes the KV cache; logs both
        settings = ServerSettings(
            names,
            engine.engine.model_dir,
            api_keys,
            http.max_waiting_requests,
            RateLimiter(http.rate_limit_requests_per_minute, http.rate_limit_tokens_per_minute),
            ChatOptions.from_config(http, engine.engine.model_dir),
            http.max_stored_responses,
            http.metrics_prefix,
            _tracer_provider(http.otlp_traces_endpoint),
            http,
        )
        app = build_app(engine, settings)
    except (ModelLoadError, ValueError, RuntimeError, OSError) as exc:  # a model, config or machine it cannot take
        raise SystemExit(f"pagoda serve: {exc}") from None
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=http.host,
            port=http.port,
            log_level=http.uvicorn_log_level,
            access_log=not http.disable_uvicorn_access_log,
            # uvicorn believes X-Forwarded-For from 127.0.0.1 (or $FORWARDED_ALLOW_IPS) unless told otherwise:
            # then any local client could pose as any address and get a fresh rate-limit budget each time.
            proxy_headers=http.forwarded_allow_ips is not None,
            forwarded_allow_ips=http.forwarded_allow_ips,
            timeout_graceful_shutdown=http.shutdown_timeout + _CUT_OFF_GRACE_S,
            http=protocol_class(http.header_read_timeout, http.send_timeout),
            ssl_keyfile=http.ssl_keyfile,
            ssl_certfile=http.ssl_certfile,
        )
    )
    capacity = engine.engine.block_manager.num_blocks * config.block_size
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully, which would end
    # the process "killed by SIGTERM"; with no-op handlers underneath, a drained stop exits 0.
    # (Set only now: until the server runs, the default handlers stop a model load at once.)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: None)
    cut = asyncio.run(_serve(server, engine, sock, names[0], capacity, engine.max_model_len, http, bool(api_keys)))
    if settings.tracer_provider is not None:
        settings.tracer_provider.shutdown()  # sends the spans still batched
    # Non-zero when the stop lost work (requests cut off at the drain time) or the engine had died, so a
    # supervisor or a rollout can tell a clean stop from one that dropped requests.
    return 0 if engine.error is None and cut == 0 else 1


def _tracer_provider(endpoint: str | None):
    """The OTLP span exporter's TracerProvider for --otlp-traces-endpoint; None (nothing imported) without it."""
    if endpoint is None:
        return None
    try:
        from server.tracing import otlp_provider
    except ImportError as exc:
        raise SystemExit(
            f"pagoda serve: --otlp-traces-endpoint needs OpenTelemetry (pip install 'pagoda[otel]'): {exc}"
        ) from None
    return otlp_provider(endpoint)


async def _serve(
    server, engine, sock: socket.socket, name: str, capacity: int, max_model_len: int, http, api_key_required: bool
) -> int:
    """Serve until a shutdown ends; returns how many requests it cut off at the drain time."""
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if not server.started:
        await task
        return 0
    host = "localhost" if http.host in ("0.0.0.0", "::") else http.host
    log.info(
        "ready at %s://%s:%d (serving %s at /v1; KV cache: %d tokens, max_model_len %d%s)",
        "https" if http.ssl_certfile else "http",
        host,
        http.port,
        name,
        capacity,
        max_model_len,
        ", API key required" if api_key_required else "",
    )
    deadline = asyncio.create_task(_cut_off_when_drain_ends(server, http.shutdown_timeout))
    watch = asyncio.create_task(_stop_when_engine_dies(server, engine))
    try:
        await task
    finally:
        deadline.cancel()
        watch.cancel()
    return deadline.result() if deadline.done() and not deadline.cancelled() else 0


async def _stop_when_engine_dies(server, engine) -> None:
    """A dead engine (steps kept failing) serves nothing: once /health has said 503 for a moment (load
    balancers poll it), stop the server; serve_command then exits 1. A supervisor restarts it."""
    while engine.is_alive:
        await asyncio.sleep(0.2)
    if server.should_exit:  # a shutdown stopped the engine
        return
    log.error("the engine died (%s); the server stops", engine.error or "stopped")
    await asyncio.sleep(_DEAD_ENGINE_GRACE_S)
    server.should_exit = True


async def _cut_off_when_drain_ends(server, timeout: float) -> int:
    """Once a shutdown begins (SIGTERM, Ctrl-C), give the requests in flight `timeout` seconds, then end them;
    returns how many it ended."""
    while not server.should_exit:  # uvicorn's own shutdown polls this flag too
        await asyncio.sleep(0.1)
    await asyncio.sleep(timeout)
    return server.config.app.state.cut_off(timeout)


def _check_tls(http) -> None:
    """Refuse an incomplete or unreadable key pair now, before the model loads, instead of when uvicorn starts."""
    if http.ssl_keyfile is None and http.ssl_certfile is None:
        return
    if http.ssl_keyfile is None or http.ssl_certfile is None:
        raise SystemExit("pagoda serve: HTTPS needs both --ssl-keyfile and --ssl-certfile")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(http.ssl_certfile, http.ssl_keyfile)
    except OSError as exc:  # ssl.SSLError is one: a file that is missing, or not a matching PEM key and certificate
        raise SystemExit(
            f"pagoda serve: cannot use {http.ssl_certfile} and {http.ssl_keyfile} for HTTPS: {exc}"
        ) from None


def main(argv: list[str] | None = None) -> int:
    # Before the parser imports the engine, whose own console handler would otherwise print every line twice.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["flag-table"]:
        sys.exit(_flag_table_main(sys.argv[2:]))
    sys.exit(main())
