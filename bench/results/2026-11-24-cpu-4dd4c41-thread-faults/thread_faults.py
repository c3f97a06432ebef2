"""64-token prefill (max_tokens=1), offline LLM, stepped on the main thread or in a threading.Thread:
per prefill, wall ms, this thread's user/sys CPU ms and minor page faults (getrusage RUSAGE_THREAD)."""

import resource
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
    for i in range(16):
        ids = rng.randint(1000, 20000, size=64).tolist()
        r0 = resource.getrusage(resource.RUSAGE_THREAD)
        t = time.perf_counter()
        llm.generate([ids], p1, use_tqdm=False)
        wall = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_THREAD)
        if i >= 4:
            res.append(
                (
                    wall * 1e3,
                    (r1.ru_utime - r0.ru_utime) * 1e3,
                    (r1.ru_stime - r0.ru_stime) * 1e3,
                    r1.ru_minflt - r0.ru_minflt,
                )
            )


res = []
if sys.argv[1] == "main":
    work(res)
else:
    th = threading.Thread(target=work, args=(res,))
    th.start()
    th.join()
med = [statistics.median(r[i] for r in res) for i in range(4)]
print(f"{sys.argv[1]} wall {med[0]:.1f} ms  user {med[1]:.1f}  sys {med[2]:.1f}  minflt {med[3]:.0f}")
