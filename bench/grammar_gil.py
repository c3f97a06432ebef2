"""What the grammar thread costs the engine thread: a fixed pure-Python workload timed alone, and again
while one step's grammar work (256 matchers of bench/structured.py's SCHEMA advanced by a token each,
then their mask filled) runs on the grammar thread, the way LLMEngine overlaps them.

    .venv/bin/python bench/grammar_gil.py [SWITCH_INTERVAL_S]   # default: engine/structured.py's

One JSON line of medians over 60 repetitions each, in ms: the workload alone (wall), beside the grammar
thread (wall and the engine thread's CPU time), the grammar work inline, and the time until both were
done beside each other against the two done one after the other. The engine thread's CPU time beside
the grammar thread tells its own extra work; the rest of its wall time beside it is waiting, for the GIL
or, on a machine with fewer idle cores than runnable threads, for a core. The tokenizer is the default
model's (SmolLM2, 49,152 tokens).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import engine.structured as structured  # noqa: E402
from bench.structured import SCHEMA  # noqa: E402
from engine.default_model import default_model_dir  # noqa: E402
from engine.sampling_params import Constraint  # noqa: E402

VOCAB = 49152
ROWS = 256
# The scheduler's update of 256 sequences stands in: ~1.2 ms of dict and list work on this machine.
DATA = [{"k": i, "v": [i] * 4} for i in range(2000)]


def engine_work() -> int:
    total = 0
    for _ in range(12):
        for d in DATA:
            total += d["k"] + len(d["v"])
    return total


def main() -> None:
    from transformers import AutoTokenizer

    if len(sys.argv) > 1:
        structured._SWITCH_INTERVAL_S = float(sys.argv[1])
    grammars = structured.Grammars(AutoTokenizer.from_pretrained(str(default_model_dir())), VOCAB, frozenset({2}))
    compiled = grammars.compile(Constraint("json", json.dumps(SCHEMA)))
    matchers = [grammars.matcher(compiled) for _ in range(ROWS)]
    gen = torch.Generator().manual_seed(0)

    def allowed_tokens(mask: structured.StepMask) -> list[int]:
        logits = torch.randn(ROWS, VOCAB, generator=gen)
        structured.apply_mask(logits, mask)
        return logits.argmax(-1).tolist()

    mask = grammars.fill(list(enumerate(matchers)))
    for _ in range(30):  # into the schema's records
        grammars.accept(matchers, allowed_tokens(mask))
        mask = grammars.fill(list(enumerate(matchers)))
    alone, inline, beside, beside_cpu, both = [], [], [], [], []
    for rep in range(120):
        tokens = allowed_tokens(mask)
        work = structured.GrammarWork(
            [(i, m, t) for i, (m, t) in enumerate(zip(matchers, tokens))], [(i, i, m) for i, m in enumerate(matchers)]
        )
        t0 = time.perf_counter()
        if rep % 2:
            engine_work()
            alone.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mask = grammars.run(work).mask
            inline.append(time.perf_counter() - t0)
            continue
        c0 = time.thread_time()
        job = grammars.start(work)
        engine_work()
        beside.append(time.perf_counter() - t0)
        beside_cpu.append(time.thread_time() - c0)
        mask = job.result().mask
        both.append(time.perf_counter() - t0)

    def ms(xs: list[float]) -> float:
        return round(1e3 * statistics.median(xs), 3)

    row = {
        "switch_interval_s": structured._SWITCH_INTERVAL_S,
        "engine_work_alone_ms": ms(alone),
        "engine_work_beside_ms": ms(beside),
        "engine_work_beside_cpu_ms": ms(beside_cpu),
        "grammar_work_inline_ms": ms(inline),
        "both_beside_ms": ms(both),
        "both_one_after_the_other_ms": round(ms(alone) + ms(inline), 3),
    }
    print(json.dumps(row))


if __name__ == "__main__":
    main()
