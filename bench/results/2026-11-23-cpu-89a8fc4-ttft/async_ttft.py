"""TTFT of a 64-token prompt at one user: AsyncEngine (engine thread, no HTTP) vs the same engine
stepped on the main thread. Default model, bf16, CPU."""

import asyncio
import statistics
import sys
import time

import numpy as np

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.default_model import default_model_dir

eng = AsyncEngine(EngineConfig(model=str(default_model_dir()), dtype="bfloat16", device="cpu"))
rng = np.random.RandomState(0)
params = SamplingParams(temperature=0.0, max_tokens=int(sys.argv[1]) if len(sys.argv) > 1 else 16, ignore_eos=True)


async def main():
    eng.start()
    ttft, itl = [], []
    for i in range(30):
        ids = rng.randint(1000, 20000, size=64).tolist()
        t0 = time.perf_counter()
        first = None
        last = None
        gaps = []
        async for _out in eng.generate(f"r{i}", ids, params):
            now = time.perf_counter()
            if first is None:
                first = now - t0
            else:
                gaps.append(now - last)
            last = now
        if i >= 4:
            ttft.append(first * 1e3)
            itl += [g * 1e3 for g in gaps]
        await asyncio.sleep(0.05)
    print("async engine: TTFT ms median", round(statistics.median(ttft), 1), sorted(round(x, 1) for x in ttft))
    print("              ITL ms median", round(statistics.median(itl), 1))
    eng.shutdown()


asyncio.run(main())
