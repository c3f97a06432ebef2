"""`pagoda bench ...`: the benchmarks as a `pagoda` command.

pyproject.toml registers `register` in the entry point group `pagoda.commands`, which server/cli.py reads,
so the server's code never imports bench. The benchmark modules are imported (with their own flags parsed)
only when a benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

BENCH_EXTRA = "pip install -e '.[bench]'"


def register(commands) -> None:
    """Add `pagoda bench` to the subparsers of `pagoda`."""
    bench = commands.add_parser(
        "bench",
        help="benchmarks: offline throughput sweep, online latency under load",
        description="pagoda bench throughput ...: offline sweep of pagoda (and transformers, vLLM) over batch size x "
        "input x output length, CSV + PNG. pagoda bench serve ...: drive any OpenAI-compatible server with "
        "concurrent streams or Poisson arrivals and report TTFT, TPOT, ITL and E2E as vllm bench serve does. "
        "Each takes --help. Plots need the bench extra: " + BENCH_EXTRA.replace("%", "%%") + ".",
    )
    bench.add_argument("benchmark", choices=["throughput", "serve"])
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # `pagoda` logs at INFO, where httpx and openai log every request: thousands of lines in a benchmark.
    for name in ("httpx", "httpcore", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.benchmark == "throughput":
        from bench import throughput as module
    else:
        from bench import latency as module
    return module.main(args.bench_args)


def require_plotting() -> None:
    """Exit with one line naming the extra to install when the plotting library is missing (call it before
    a run that ends in plots, not after)."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit(f"pagoda bench: plots need matplotlib, which the bench extra installs: {BENCH_EXTRA}")
