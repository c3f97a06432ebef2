r"""Online speculative decoding, pagoda beside vLLM: each server configuration in turn, driven by `pagoda bench
serve` (bench/latency.py) with the prompt-lookup-friendly workload (`--dataset-name repeat`, bench/spec_workload.py).

    python -m bench.spec_online run MODEL_DIR [--configs pagoda-none,pagoda-ngram,...] [--concurrency 1,8,32] \
        [--rounds 1] [--output-len 128] [--prompts-per-concurrency 4] [--num-prompts 8] [--num-warmups 4] [--k 4] \
        [--dtype bfloat16] [--max-model-len 2048] [--device cuda] [--out FILE] [--logs DIR]
    python -m bench.spec_online summary FILE... [--md OUT.md]

A configuration is SERVER-SPEC: SERVER pagoda (`python -m server.cli serve`) or vllm (`python -m
vllm.entrypoints.openai.api_server`), SPEC none, ngram ({"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": 2, "prompt_lookup_max": 4}) or draft (the served model drafting for itself:
{"model": MODEL_DIR, "num_speculative_tokens": k, "method": "draft_model"}). Both servers get the same
--speculative-config JSON, --dtype and --max-model-len. Each configuration's server is started, waited for
(/health), swept over the concurrencies (greedy, ignore_eos, exactly --output-len tokens a request, the same
prompts for every configuration), and stopped. Every request is a chat request, so both servers apply the
model's own chat template.

--rounds R runs the configurations R times over, interleaved (none, ngram, none, ngram, ...), each
configuration's server started afresh every round: drift of the machine over the call then falls on every
configuration alike, and a configuration's spread across rounds shows how far one measurement can be trusted.

Environment: SPEC_PAGODA_PYTHONPATH / SPEC_VLLM_PYTHONPATH (each server's PYTHONPATH; default: inherited),
VLLM_PYTHON (default: this python), PAGODA_ARGS / VLLM_ARGS (more flags), SERVER_WAIT (seconds, default 600).
--stop-after S starts no configuration once S seconds have passed (a device call has a hard time limit); those
left get a row saying so.

`run` appends one JSON line per configuration, concurrency and round to --out: output tok/s, TPOT/TTFT
medians, the acceptance read from the server's /metrics (acceptance rate: accepted / proposed draft tokens;
acceptance length: tokens per verify step), the server's start-up seconds, the round; a configuration whose
server does not come up gets one line with its error and the end of its log. After the last round it appends
one `"aggregate": true` line per configuration and concurrency (aggregate()): the output tok/s median, min and
max across the rounds, and for a speculative configuration its ratio to the same server's `none` in the same
round (median, min, max over the rounds where both ran). `summary` prints the table from the per-round rows
(of any number of run files; a round is a run's start date and round number, and a later row of the same
round, configuration and concurrency replaces an earlier one): per concurrency and speculation, both
servers' output tok/s (median and min-max over rounds) and the ratio of the medians, each server's speedup
over its own run without speculation (the per-round ratios' median and min-max), the acceptance rates, and
per server and method the crossover: the lowest concurrency measured at which speculation no longer pays
(median speedup < 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SERVERS = ("pagoda", "vllm")
SPECS = ("none", "ngram", "draft")
DEFAULT_CONFIGS = [f"{server}-{spec}" for spec in SPECS for server in SERVERS]


def speculative_config(spec: str, model_dir: str, k: int) -> dict | None:
    """The --speculative-config both servers get for `spec`."""
    if spec == "none":
        return None
    if spec == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    if spec == "draft":
        return {"model": model_dir, "num_speculative_tokens": k, "method": "draft_model"}
    raise ValueError(f"unknown speculation {spec!r}: one of {', '.join(SPECS)}")


def server_command(server: str, args: argparse.Namespace, port: int, spec: dict | None) -> list[str]:
    if server == "pagoda":
        cmd = [sys.executable, "-m", "server.cli", "serve", args.model, "--device", args.device]
        cmd += ["--disable-uvicorn-access-log", *shlex.split(os.environ.get("PAGODA_ARGS", ""))]
    elif server == "vllm":
        cmd = [os.environ.get("VLLM_PYTHON", sys.executable), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", args.model, "--disable-uvicorn-access-log", *shlex.split(os.environ.get("VLLM_ARGS", ""))]
    else:
        raise ValueError(f"unknown server {server!r}: one of {', '.join(SERVERS)}")
    cmd += ["--port", str(port), "--served-model-name", "spec", "--dtype", args.dtype]
    cmd += ["--max-model-len", str(args.max_model_len)]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def server_env(server: str) -> dict[str, str]:
    env = dict(os.environ)
    path = os.environ.get(f"SPEC_{server.upper()}_PYTHONPATH")
    if path:
        env["PYTHONPATH"] = path
    if server == "vllm":
        # flashinfer is not carried to the GPU machine; greedy requests never reach its sampler (peers README).
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (vLLM's engine core is a child process), then SIGKILL if need be; returns
    once no process of the group is left, so the next server finds the GPU's memory free."""
    for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()  # reaps the leader, which would otherwise linger as a zombie of this group
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_config(config: str, args: argparse.Namespace, meta: dict) -> list[dict]:
    """Serve one configuration, sweep it with the online client, stop it: its rows (`meta` carries the round)."""
    server, _, spec_name = config.partition("-")
    spec = speculative_config(spec_name, args.model, args.k)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(server, args, port, spec)
    log = Path(args.logs) / (f"{config}.log" if meta["round"] == 1 else f"{config}.round{meta['round']}.log")
    base = {**meta, "config": config, "server": server, "speculation": spec_name, "speculative_config": spec}
    print(f"=== {config}: {shlex.join(cmd)}", flush=True)
    t0 = time.monotonic()
    with log.open("w") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=server_env(server), start_new_session=True
        )
    try:
        if not wait_healthy(proc, url, float(os.environ.get("SERVER_WAIT", "600"))):
            error = f"server did not come up (exit {proc.poll()})"
            print(f"{config}: {error}\n{tail(log)}", flush=True)
            return [{**base, "error": error, "log_tail": tail(log)}]
        startup = time.monotonic() - t0
        with tempfile.TemporaryDirectory() as tmp:
            result_file = Path(tmp) / "result.json"
            client = [sys.executable, "-m", "bench.latency", "--base-url", url, "--endpoint", "/v1/chat/completions"]
            client += ["--dataset-name", "repeat", "--output-len", str(args.output_len)]
            client += ["--sweep-concurrency", args.concurrency, "--num-prompts", str(args.num_prompts)]
            client += ["--prompts-per-concurrency", str(args.prompts_per_concurrency)]
            client += ["--num-warmups", str(args.num_warmups), "--label", config, "--disable-tqdm"]
            client += ["--result-file", str(result_file)]
            try:
                done = subprocess.run(client, capture_output=True, text=True, timeout=args.client_timeout)
            except subprocess.TimeoutExpired:
                return [{**base, "error": f"the client ran past --client-timeout {args.client_timeout} s"}]
            print(done.stdout[-3000:], done.stderr[-2000:], sep="\n", flush=True)
            if not result_file.exists():
                return [{**base, "error": f"client exit {done.returncode}", "client_tail": done.stderr[-2000:]}]
            result = json.loads(result_file.read_text())
    finally:
        stop(proc)
    rows = []
    for run in result["runs"]:
        m, sd = run["metrics"], run.get("spec_decode") or {}
        rows.append(
            {
                **base,
                "concurrency": run["max_concurrency"],
                "num_requests": run["num_requests"],
                "completed": m["completed"],
                "failed": m["failed"],
                "errors": run["errors"],
                "output_tokens": m["total_output_tokens"],
                "usage_vs_max_tokens_mismatches": m["usage_vs_max_tokens_mismatches"],
                "duration_s": round(m["duration"], 3),
                "output_tok_s": round(m["output_throughput"], 2),
                "median_tpot_ms": m.get("median_tpot_ms"),
                "median_ttft_ms": m.get("median_ttft_ms"),
                "acceptance_rate": sd.get("acceptance_rate"),
                "acceptance_length": sd.get("acceptance_length"),
                "per_position_acceptance": sd.get("per_position_acceptance"),
                "drafts": sd.get("drafts"),
                "startup_s": round(startup, 1),
                "server_version": result["server"].get("version"),
            }
        )
    return rows


def cmd_run(args: argparse.Namespace) -> int:
    configs = [c for c in args.configs.split(",") if c]
    for config in configs:  # every name checked before any server starts
        server, _, spec = config.partition("-")
        if server not in SERVERS or spec not in SPECS:
            raise SystemExit(f"unknown configuration {config!r}: SERVER-SPEC, SERVER in {SERVERS}, SPEC in {SPECS}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, not {args.rounds}")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": args.device_name or args.device,
        "model": Path(args.model).name,
        "dtype": args.dtype,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "workload": "repeat (bench/spec_workload.py), /v1/chat/completions, greedy, ignore_eos",
        "command": "python -m bench.spec_online " + shlex.join(sys.argv[1:]),
    }
    ok = True
    start = time.monotonic()
    done: list[dict] = []
    # Round after round of every configuration in the given order: none, ngram, none, ngram, ...
    for round_ in range(1, args.rounds + 1):
        for config in configs:
            at = {**meta, "round": round_}
            if args.stop_after is not None and time.monotonic() - start > args.stop_after:
                # A device call has a hard limit: what is left is recorded as not run rather than cut off midway.
                rows = [{**at, "config": config, "error": f"not started: past --stop-after {args.stop_after:g} s"}]
            else:
                rows = run_config(config, args, at)
            ok &= all("error" not in r and r["failed"] == 0 for r in rows)
            done += rows
            with out.open("a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
                    print("RESULT", json.dumps({k: v for k, v in row.items() if k not in ("command", "log_tail")}))
    with out.open("a") as f:
        for row in aggregate(done):
            f.write(json.dumps({**meta, **row}) + "\n")
            print("AGGREGATE", json.dumps(row))
    return 0 if ok else 1


def _spread(values: list[float]) -> dict[str, float | int]:
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {"median": median, "min": ordered[0], "max": ordered[-1], "n": len(ordered)}


def _rounds(rows: list[dict]) -> dict[tuple, dict]:
    """The rows that ran, by (server, speculation, concurrency, round): a round is (date, round), the run's start
    and its round number (rows from before rounds have neither); a later row of the same key replaces an
    earlier one."""
    latest: dict[tuple, dict] = {}
    for r in rows:
        if "error" not in r and not r.get("aggregate"):
            latest[(r["server"], r["speculation"], r["concurrency"], (r.get("date"), r.get("round")))] = r
    return latest


def aggregate(rows: list[dict]) -> list[dict]:
    """Per server, speculation and concurrency: output tok/s across rounds (median, min, max, n) and, for a
    speculative configuration, its per-round ratio to the same server's `none` (the rounds where both ran)."""
    latest = _rounds(rows)
    groups: dict[tuple, dict] = {}
    for (server, spec, c, round_), r in latest.items():
        groups.setdefault((server, spec, c), {})[round_] = r["output_tok_s"]
    out = []
    for (server, spec, c), by_round in groups.items():
        row: dict = {"aggregate": True, "config": f"{server}-{spec}", "server": server, "speculation": spec}
        row |= {"concurrency": c, "output_tok_s": _spread(list(by_round.values()))}
        base = groups.get((server, "none", c), {})
        ratios = [tok_s / base[k] for k, tok_s in by_round.items() if base.get(k)]
        if spec != "none" and ratios:
            row["speedup_vs_none"] = _spread(ratios)
        out.append(row)
    return out


def summarize(rows: list[dict]) -> str:
    """The markdown table of `summary`, from the per-round rows (aggregate() over them)."""
    stats = {(a["server"], a["speculation"], a["concurrency"]): a for a in aggregate(rows)}
    acc: dict[tuple[str, str, int], float | None] = {}
    for (server, spec, c, _), r in sorted(_rounds(rows).items(), key=lambda kv: (kv[0][3][0] or "", kv[0][3][1] or 0)):
        acc[(server, spec, c)] = r.get("acceptance_rate")  # the latest round's
    errors: dict[str, str] = {}  # config -> its last error, unless a later row of it ran (rounds in run order)
    for r in rows:
        if r.get("aggregate"):
            continue
        if "error" in r:
            errors[r["config"]] = r["error"]
        else:
            errors.pop(r["config"], None)
    concurrencies = sorted({c for _, _, c in stats})

    def fmt(v: float | None, digits: int = 2) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    def spread(s: dict | None, digits: int) -> str:
        if s is None:
            return "-"
        if s["n"] == 1:
            return fmt(s["median"], digits)
        return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"

    def tok_s(server: str, spec: str, c: int) -> dict | None:
        return stats[(server, spec, c)]["output_tok_s"] if (server, spec, c) in stats else None

    def speedup(server: str, spec: str, c: int) -> dict | None:
        if spec == "none":
            return {"median": 1.0, "min": 1.0, "max": 1.0, "n": 1} if (server, spec, c) in stats else None
        return stats.get((server, spec, c), {}).get("speedup_vs_none")

    lines = [
        "| concurrency | speculation | pagoda out tok/s | vLLM out tok/s | pagoda / vLLM | pagoda speedup | "
        "vLLM speedup | pagoda acceptance | vLLM acceptance | rounds (pagoda, vLLM) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in concurrencies:
        for spec in SPECS:
            p, v = tok_s("pagoda", spec, c), tok_s("vllm", spec, c)
            if p is None and v is None:
                continue
            ratio = p["median"] / v["median"] if p is not None and v else None
            rounds = f"{p['n'] if p else 0}, {v['n'] if v else 0}"
            lines.append(
                f"| {c} | {spec} | {spread(p, 1)} | {spread(v, 1)} | {fmt(ratio)} | "
                f"{spread(speedup('pagoda', spec, c), 2)} | {spread(speedup('vllm', spec, c), 2)} | "
                f"{fmt(acc.get(('pagoda', spec, c)), 3)} | {fmt(acc.get(('vllm', spec, c)), 3)} | {rounds} |"
            )
    lines.append("")
    lines.append(
        "Out tok/s: median (min-max) over the rounds. Speedup: output tok/s over the same server without"
        " speculation in the same round, median (min-max) over the rounds where both ran."
    )
    lines.append("Crossover (the lowest concurrency measured where speculation no longer pays, by the median):")
    for server in SERVERS:
        for spec in SPECS[1:]:
            measured = [(c, s) for c in concurrencies if (s := speedup(server, spec, c)) is not None]
            if not measured:
                continue
            losing = [c for c, s in measured if s["median"] < 1.0]
            where = f"concurrency {losing[0]}" if losing else f"none up to concurrency {measured[-1][0]}"
            lines.append(
                f"- {server} {spec}: {where} (" + ", ".join(f"c{c} {s['median']:.2f}x" for c, s in measured) + ")"
            )
    if errors:
        lines += ["", "Configurations whose latest round did not run:", *(f"- {c}: {e}" for c, e in errors.items())]
    return "\n".join(lines)


def cmd_summary(args: argparse.Namespace) -> int:
    rows = [json.loads(line) for path in args.files for line in Path(path).read_text().splitlines() if line.strip()]
    table = summarize(rows)
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="serve and measure configurations")
    run.add_argument("model", help="HF directory with its tokenizer (both servers load it)")
    run.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="SERVER-SPEC,... in order")
    run.add_argument("--concurrency", default="1,8,32", help="C1,C2,...: one run per concurrency")
    run.add_argument("--output-len", type=int, default=128, help="tokens out per request (ignore_eos)")
    run.add_argument("--rounds", type=int, default=1, help="run the configurations this many times over, interleaved")
    run.add_argument("--prompts-per-concurrency", type=int, default=4, help="at least K x C requests a run")
    run.add_argument("--num-prompts", type=int, default=8, help="at least this many requests a run")
    run.add_argument("--num-warmups", type=int, default=4, help="warm-up requests per server, not counted")
    run.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    run.add_argument("--dtype", default="bfloat16")
    run.add_argument("--max-model-len", type=int, default=2048)
    run.add_argument("--device", default="cuda", help="pagoda's --device (vLLM takes its own platform's)")
    run.add_argument("--device-name", default=None, help="recorded in each row (default: --device)")
    run.add_argument("--out", default="spec_online.jsonl")
    run.add_argument("--logs", default=".", help="directory for each server's log, CONFIG.log")
    run.add_argument("--stop-after", type=float, default=None, help="start no configuration after these seconds")
    run.add_argument("--client-timeout", type=float, default=300.0, help="seconds for one configuration's sweep")
    summary = sub.add_parser("summary", help="the table of one or more run files")
    summary.add_argument("files", nargs="+")
    summary.add_argument("--md", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    return cmd_run(args) if args.cmd == "run" else cmd_summary(args)


if __name__ == "__main__":
    sys.exit(main())
