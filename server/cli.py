"""The `pagoda` command: `pagoda serve [MODEL] ...` starts the OpenAI-compatible server.

Flags are spelled as `vllm serve` spells them wherever vLLM has the same knob, so a vLLM
command line carries over.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

log = logging.getLogger("pagoda.server")

_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="pagoda: an OpenAI-compatible LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /tokenize, /detokenize, /health, /metrics, /version). Flags are named as vllm serve names "
        "them. SIGTERM (or Ctrl-C) stops taking requests, lets the ones in flight finish within "
        "--shutdown-timeout, and exits 0.",
    )
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a Hugging Face model directory (config.json, *.safetensors, tokenizer) or the id of a model in "
        "the local Hugging Face cache; none: the embedded default, SmolLM2-135M-Instruct",
    )
    serve.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help="the same as the positional MODEL (older vLLM spelling)",
    )

    http = serve.add_argument_group("HTTP server")
    http.add_argument("--host", default="0.0.0.0", help="address to listen on (default: %(default)s, every interface)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    http.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require 'Authorization: Bearer <key>' on every endpoint but /health and /metrics; repeat the "
        "flag to accept several keys, each with its own rate limits (default: $PAGODA_API_KEY; unset: no auth)",
    )
    http.add_argument(
        "--rate-limit-requests-per-minute",
        type=_positive_int,
        default=None,
        metavar="N",
        help="per client (API key, or address without one): at most N requests a minute, as a token "
        "bucket; over it, 429 with Retry-After (default: no limit)",
    )
    http.add_argument(
        "--rate-limit-tokens-per-minute",
        type=_positive_int,
        default=None,
        metavar="N",
        help="per client: at most N tokens a minute, counting prompt + max_tokens of each choice; over it, "
        "429 with Retry-After (default: no limit)",
    )
    http.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) clients use; the first is the one responses carry "
        "(default: MODEL as given, or SmolLM2-135M-Instruct)",
    )
    http.add_argument(
        "--max-waiting-requests",
        type=_non_negative_int,
        default=None,
        help="at most this many requests queued without a first token; beyond it requests are answered "
        "503 with Retry-After (default: unbounded)",
    )
    http.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish before they are cut (default: %(default)s)",
    )
    http.add_argument(
        "--uvicorn-log-level", default="info", choices=_LOG_LEVELS, help="uvicorn's log level (default: %(default)s)"
    )
    http.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")

    eng = serve.add_argument_group("engine")
    eng.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="weight and activation dtype (default: auto, which is bfloat16 on CUDA and float32 on the CPU)",
    )
    eng.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto: cuda if available (default: auto)")
    eng.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="auto: the safetensors files; dummy: random weights of the model's architecture, for benchmarks",
    )
    eng.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds dummy weights and the sampling of requests that give no seed (default: %(default)s)",
    )
    eng.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="context length: prompt + output tokens (default: the model's)",
    )
    eng.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=256,
        help="sequences decoded together, at most (default: %(default)s)",
    )
    eng.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=8192,
        help="tokens computed per engine step, at most: prefill chunks + decodes (default: %(default)s)",
    )
    eng.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps so decodes keep going (default: on)",
    )
    eng.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompt prefixes seen before (default: on)",
    )
    eng.add_argument(
        "--preemption-mode",
        default="recompute",
        choices=["recompute", "swap"],
        help="when KV blocks run out, drop a sequence's blocks and recompute them later, or swap them to "
        "CPU memory (default: %(default)s)",
    )
    eng.add_argument(
        "--swap-space",
        type=float,
        default=4.0,
        help="GiB of CPU memory for swapped-out KV blocks, with --preemption-mode swap (default: %(default)s)",
    )
    eng.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton", "flash_attn", "cpu"],
        help="attention kernels: triton (pagoda's own, the default on CUDA), flash_attn (the flash-attn package "
        "or vLLM's build of it, when installed), cpu (pagoda's C kernels, built with the system compiler on first "
        "use: the default on the CPU), torch (plain PyTorch, the reference) (default: %(default)s)",
    )
    eng.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never replay CUDA graphs (slower; for debugging)",
    )
    eng.add_argument(
        "--fa4-prefill-min-tokens",
        type=int,
        default=2048,
        help="with the triton backend on Hopper, prompt steps whose longest prompt chunk has at least this many "
        "tokens attend through flash-attn-4 when it is installed: level at 2k tokens, faster beyond (0: never) "
        "(default: %(default)s)",
    )
    eng.add_argument(
        "--max-prefill-graph-tokens",
        type=int,
        default=1024,
        help="steps with prompt tokens, up to this many tokens in all, replay CUDA graphs captured in pieces "
        "between the attention calls (0: never) (default: %(default)s)",
    )
    eng.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch each step while the previous one still runs on the GPU, so the host's work "
        "per step overlaps the device's (requests with repetition/presence/frequency penalties wait instead) "
        "(default: on with CUDA, off on the CPU)",
    )
    eng.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        help="seconds a request may wait to be scheduled; beyond it, it is answered 503 (default: no limit)",
    )
    eng.add_argument(
        "--block-size", type=_positive_int, default=16, help="tokens per KV-cache block, a power of 2 (default: 16)"
    )
    eng.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory for weights, activations and the KV cache (default: %(default)s)",
    )
    eng.add_argument(
        "--num-gpu-blocks-override",
        type=_positive_int,
        default=None,
        help="fix the number of KV-cache blocks instead of sizing the pool from memory (on the CPU: 2 GiB)",
    )
    serve.set_defaults(run=serve_command)
    _add_bench_parser(commands)
    return parser


def _model_dir(model: str) -> str:
    """A directory as given; anything else is looked up as a model id in the local Hugging Face cache."""
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, local_files_only=True)
    except Exception:  # not a valid id, or not downloaded: both mean the same to the user
        raise SystemExit(
            f"pagoda serve: {model} is neither a model directory nor a model in the local "
            "Hugging Face cache (pagoda does not download models)"
        ) from None


def _engine_config(args: argparse.Namespace, model_dir: str | None):
    from engine.config import EngineConfig

    return EngineConfig(
        model=model_dir,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        seed=args.seed,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        queue_timeout=args.queue_timeout,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        max_prefill_graph_tokens=args.max_prefill_graph_tokens,
        fa4_prefill_min_tokens=args.fa4_prefill_min_tokens,
        async_scheduling=args.async_scheduling,
    )


def serve_command(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.default_model import DEFAULT_MODEL_NAME
    from server.api import ServerSettings, build_app
    from server.ratelimit import RateLimiter

    if args.model and args.model_flag and args.model != args.model_flag:
        raise SystemExit("pagoda serve: give the model once (MODEL or --model)")
    args.model = args.model or args.model_flag
    model_dir = _model_dir(args.model) if args.model else None
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    api_keys = args.api_key or ([os.environ["PAGODA_API_KEY"]] if os.environ.get("PAGODA_API_KEY") else [])
    args.api_key_required = bool(api_keys)
    try:
        config = _engine_config(args, model_dir)
        engine = AsyncEngine(config)  # loads the model and sizes the KV cache; logs both
        settings = ServerSettings(
            names,
            engine.engine.model_dir,
            api_keys,
            args.max_waiting_requests,
            RateLimiter(args.rate_limit_requests_per_minute, args.rate_limit_tokens_per_minute),
        )
        app = build_app(engine, settings)
    except (ValueError, RuntimeError, OSError) as exc:  # a configuration the model or machine cannot take
        raise SystemExit(f"pagoda serve: {exc}") from None
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    capacity = engine.engine.block_manager.num_blocks * config.block_size
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully, which would end
    # the process "killed by SIGTERM"; with no-op handlers underneath, a drained stop exits 0.
    # (Set only now: until the server runs, the default handlers stop a model load at once.)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: None)
    asyncio.run(_serve(server, names[0], capacity, engine.max_model_len, args))
    return 0 if engine.error is None else 1


async def _serve(server, name: str, capacity: int, max_model_len: int, args: argparse.Namespace) -> None:
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        host = "localhost" if args.host in ("0.0.0.0", "::") else args.host
        log.info(
            "serving %s at http://%s:%d/v1 (KV cache: %d tokens, max_model_len %d%s)",
            name,
            host,
            args.port,
            capacity,
            max_model_len,
            ", API key required" if args.api_key_required else "",
        )
    await task


def bench_command(args: argparse.Namespace) -> int:
    # The benchmark modules parse their own flags (and import their plotting libraries) only when run.
    if args.benchmark == "throughput":
        from bench import throughput as module
    else:
        from bench import latency as module
    return module.main(args.bench_args)


def _add_bench_parser(commands) -> None:
    bench = commands.add_parser(
        "bench",
        help="benchmarks: offline throughput sweep, online latency under load",
        description="pagoda bench throughput ...: offline sweep of pagoda (and transformers, vLLM) over batch size x "
        "input x output length, CSV + PNG. pagoda bench serve ...: drive any OpenAI-compatible server with "
        "concurrent streams or Poisson arrivals and report TTFT, TPOT, ITL and E2E as vllm bench serve does. "
        "Each takes --help.",
    )
    bench.add_argument("benchmark", choices=["throughput", "serve"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    bench.set_defaults(run=bench_command)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
