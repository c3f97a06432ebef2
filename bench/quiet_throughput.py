"""Offline CPU throughput on a shared 2-core machine: one engine per process, bench/throughput.py's own
engines, prompts and warm-up, each timed run kept only if the machine was otherwise quiet.

    python bench/quiet_throughput.py --engine pagoda --dtype bfloat16 --nums 16,64 --out RESULTS.jsonl
    # vLLM-CPU: run with the python of its venv and its environment (../shared/peers/vllm_cpu.sh),
    # PYTHONPATH=<repo>, --engine vllm --model <HF dir of the default model>


Each timed repeat is kept only if the rest of the machine (every process outside this one's tree) used
< --max-other of one core on average while it ran; otherwise it is retried (up to --max-tries per point).
Rows are bench/throughput.py's JSON lines plus loadavg_before/after, other_cpu_pct, attempt.
"""

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import bench.throughput as T  # noqa: E402
from engine.loader import read_hf_config  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def proc_table():
    t = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                s = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
                t[int(p)] = (int(s[1]), int(s[11]) + int(s[12]))  # ppid, utime+stime
            except Exception:
                pass
    return t


def mine(t):
    own = {os.getpid()}
    changed = True
    while changed:
        changed = False
        for p, (pp, _) in t.items():
            if pp in own and p not in own:
                own.add(p)
                changed = True
    return own


def others_ticks(t, own):
    return {p: c for p, (_, c) in t.items() if p not in own}


def other_cpu(a, b, dt):
    return sum(c - a.get(p, c) for p, c in b.items()) / HZ / dt * 100  # % of one core


def wait_quiet(max_other, limit=1200):
    t0 = time.time()
    while True:
        la = os.getloadavg()[0]
        t = proc_table()
        own = mine(t)
        a = others_ticks(t, own)
        time.sleep(3)
        b = others_ticks(proc_table(), own)
        oc = other_cpu(a, b, 3)
        if la <= 1.5 and oc < max_other:
            return
        if time.time() - t0 > limit:
            print(f"  still busy after {limit}s (load {la:.2f}, others {oc:.0f}%)", file=sys.stderr)
            return
        print(f"  {time.strftime('%T')} load {la:.2f} others {oc:.0f}%: waiting", file=sys.stderr, flush=True)
        time.sleep(20)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--nums", default="16,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tries", type=int, default=8)
    ap.add_argument("--max-other", type=float, default=10.0)
    ap.add_argument("--max-model-len", type=int, default=192)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.model is None:
        from engine.default_model import default_model_dir

        a.model = str(default_model_dir())
    vocab = read_hf_config(a.model)["vocab_size"]
    setup = T.Setup(a.model, a.dtype, "cpu", "auto", 0, a.max_model_len, 0.9)
    eng = T.ENGINES[a.engine](setup)
    version = eng.version
    if a.engine == "vllm" and version == "unknown":
        version = T._package_version("vllm-cpu")
    t0 = time.perf_counter()
    eng.load()
    load_s = time.perf_counter() - t0
    print(f"{a.engine} {a.dtype} loaded in {load_s:.1f}s", file=sys.stderr, flush=True)
    for n in [int(x) for x in a.nums.split(",")]:
        prompts = T.random_prompts(n, 64, vocab, 0)
        eng.generate(prompts, [T.WARM_UP_TOKENS] * n)
        kept = 0
        for attempt in range(1, a.max_tries + 1):
            if kept == a.reps:
                break
            wait_quiet(a.max_other)
            la0 = os.getloadavg()
            t = proc_table()
            own = mine(t)
            before = others_ticks(t, own)
            w0 = time.perf_counter()
            timing = eng.generate(prompts, [128] * n)
            w1 = time.perf_counter()
            after = others_ticks(proc_table(), own)
            oc = other_cpu(before, after, w1 - w0)
            la1 = os.getloadavg()
            ok = oc < a.max_other
            row = {
                "engine": a.engine,
                "version": version,
                "elapsed_s": timing.elapsed_s,
                "output_tokens": timing.output_tokens,
                "load_s": load_s,
                "output_tok_s": timing.output_tokens / timing.elapsed_s,
                "model": os.path.basename(a.model),
                "dtype": a.dtype,
                "device": "cpu",
                "device_name": T._device_name("cpu"),
                "torch_threads": torch.get_num_threads(),
                "num_prompts": n,
                "input_len": 64,
                "len_range": None,
                "output_len": 128,
                "commit": T._commit(),
                "date": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": "python bench/quiet_throughput.py " + " ".join(sys.argv[1:]),
                "loadavg_before": [round(x, 2) for x in la0],
                "loadavg_after": [round(x, 2) for x in la1],
                "other_cpu_pct": round(oc, 1),
                "attempt": attempt,
                "kept": ok,
            }
            print(json.dumps(row), flush=True)
            if ok:
                kept += 1
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            else:
                with open(a.out + ".rejected", "a") as f:
                    f.write(json.dumps(row) + "\n")
    eng.close()


if __name__ == "__main__":
    main()
