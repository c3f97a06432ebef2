"""Offline batch-1 decode of the default model (bf16), with or without a second Python thread that
wakes every 25 ms and runs 1 ms of Python (about what the server's event loop spends per token)."""

import statistics
import sys
import threading
import time

import numpy as np

from engine import LLM, SamplingParams

stop = False


def busy(ms):
    while not stop:
        time.sleep(0.025)
        t = time.perf_counter()
        while time.perf_counter() - t < ms / 1000:
            pass


llm = LLM(dtype="bfloat16")
ms = float(sys.argv[1])
th = threading.Thread(target=busy, args=(ms,), daemon=True)
if ms > 0:
    th.start()
rng = np.random.RandomState(0)
res = []
for i in range(10):
    ids = rng.randint(1000, 20000, size=64).tolist()
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    a = time.perf_counter() - t
    ids = rng.randint(1000, 20000, size=64).tolist()
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True), use_tqdm=False)
    b = time.perf_counter() - t
    if i >= 2:
        res.append((b - a) / 32 * 1e3)
stop = True
print(f"busy {ms} ms every 25 ms: decode step median {statistics.median(res):.1f} ms")
