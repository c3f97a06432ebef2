"""64-token prefill (max_tokens=1) and 16-token decode, offline LLM, stepped on the main thread or
inside a plain threading.Thread (no asyncio). argv[1]: main | thread."""

import statistics
import sys
import threading
import time

import numpy as np

from engine import LLM, SamplingParams


def work(res):
    llm = LLM(dtype="bfloat16")
    rng = np.random.RandomState(0)
    p1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    p16 = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
    for i in range(24):
        ids = rng.randint(1000, 20000, size=64).tolist()
        t = time.perf_counter()
        llm.generate([ids], p1, use_tqdm=False)
        a = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([ids], p16, use_tqdm=False)
        b = time.perf_counter() - t
        if i >= 4:
            res.append((a * 1e3, (b - a) / 16 * 1e3))


res = []
if sys.argv[1] == "main":
    work(res)
else:
    th = threading.Thread(target=work, args=(res,))
    th.start()
    th.join()
print(
    sys.argv[1],
    f"prefill ms median {statistics.median(r[0] for r in res):.1f}",
    f"decode step ms median {statistics.median(r[1] for r in res):.1f}",
)
