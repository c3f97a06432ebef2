"""Structured outputs at full load: W2 with every request held to a JSON schema, pagoda and vLLM.

    python bench/structured.py model DIR                     # Qwen3-0.6B shape + a 151,643-token tokenizer
    python bench/structured.py run DIR --engine pagoda [--plain]   # a JSON line, appended to $OUT/structured.jsonl
    python bench/structured.py run DIR --engine pagoda --grammar-inline  # the grammar work on the engine thread
    python bench/structured.py run DIR --engine vllm   [--plain]
    python bench/structured.py fills DIR                     # the host cost of a step's grammar work
    python bench/structured.py summary FILE [--md OUT.md]    # the table of structured.jsonl's rows

W2 as everywhere (256 requests, prompt and output lengths U[100, 1024], numpy seed 0, dummy weights,
greedy, ignore_eos), with a tokenizer: grammars are compiled against a vocabulary, and no model hub
is reachable, so `model` writes one of Qwen3's size. It is a byte-level BPE trained on the Jargon File
(bench/data), extended with merges of its own tokens until it has 151,643 regular tokens, plus
Qwen's three special tokens: deterministic, and built from nothing but this repository.

The schema (SCHEMA) asks for at least 400 records, so every request stays under its grammar for its
whole output (dummy weights write whatever the mask leaves them). Both engines use xgrammar and stop
constraining a request once its grammar has terminated (ignore_eos runs on past the end). It has no
string maxLength: xgrammar checks such a string's tokens one by one (~340 us a row per step on this
tokenizer, against ~5 us without), a cost both engines would pay alike.

Every run's outputs are checked the same way for both engines (check_outputs): a complete one (finish
"stop") must validate against SCHEMA with jsonschema, one cut at max_tokens ("length") must be a prefix
of a document SCHEMA accepts (an xgrammar matcher of SCHEMA, any whitespace, extra properties allowed,
fed the text). A constrained run with an invalid output, or whose outputs could not be checked, is
flagged in its row (`outputs_ok`) and in `summary`'s table, which then compares no throughput with it.

Reported per run: output tok/s from the tokens each request actually produced (and the tokens
requested, sum of max_tokens), the output check, and for pagoda the grammar compile time and the host
time per step of each phase of the engine's step (`host_ms_per_step`: collect includes the wait for
the device; the phases nest, see _time_phases).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.throughput import ranged_workload  # noqa: E402

QWEN_VOCAB = 151643  # regular tokens; the model's embedding has 151,936 rows
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SCHEMA = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "minItems": 400,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "name": {"type": "string"},
                    "kind": {"type": "string", "enum": ["alpha", "beta", "gamma"]},
                    "score": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["id", "name", "kind", "score", "tags"],
            },
        }
    },
    "required": ["records"],
}


def write_model(path: Path) -> None:
    """Qwen3-0.6B's config and a Qwen-sized byte-level BPE tokenizer in `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    config = json.loads((ROOT / "bench/configs/qwen3-0.6b/config.json").read_text())
    config.update(bos_token_id=QWEN_VOCAB, eos_token_id=QWEN_VOCAB + 2)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=QWEN_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train([str(ROOT / "bench/data/jargon-file-4.4.7.txt")], trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list = data["model"]["merges"]
    learned = [t for t in sorted(vocab, key=vocab.get) if len(t) > 1]
    rng = random.Random(0)
    # Merges of two learned tokens: each new token is a valid BPE result (both halves are tokens).
    while len(vocab) < QWEN_VOCAB:
        a, b = rng.choice(learned), rng.choice(learned)
        if a + b not in vocab and len(a + b) <= 16:
            vocab[a + b] = len(vocab)
            merges.append([a, b])
    data["added_tokens"] = [
        {
            "id": QWEN_VOCAB + i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, s in enumerate(SPECIALS)
    ]
    (path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": None})
    )


def workload(requests: int = 256, low: int = 100, high: int = 1024):
    # The vLLM peer's W2 (numpy seed 0): the same prompts and output lengths (ids below 10,000, any vocabulary).
    return ranged_workload(requests, low, high, 151936, 0)


def check_outputs(outputs: list[tuple[str, str | None]], schema: dict = SCHEMA) -> dict:
    """Count (text, finish_reason) outputs against `schema`: valid (finish "stop", the text a JSON document
    jsonschema accepts), prefix (finish "length", the text a prefix of a document the schema accepts), invalid
    (anything else, the first one's start kept as `invalid_example`). `checked` False says why nothing was.

    The prefix check is an xgrammar matcher of the schema with any whitespace, extra properties and any
    property order allowed (what JSON Schema itself allows), so neither engine's grammar options decide the
    verdict."""
    counts: dict = {"valid": 0, "prefix": 0, "invalid": 0}
    try:
        import jsonschema
        import xgrammar as xgr
    except ImportError as e:  # the device image may lack jsonschema: carry it (structured.sh, XGR_WHEELS)
        return {**counts, "checked": False, "why": f"cannot import {e.name}"}
    # The matcher checks characters, not tokens: a one-token vocabulary is enough to compile against.
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo(["{"])).compile_json_schema(
        json.dumps(schema), any_whitespace=True, strict_mode=False, any_order=True
    )
    for text, finish in outputs:
        if finish == "stop":
            try:
                jsonschema.validate(json.loads(text), schema)
                ok = True
            except (ValueError, jsonschema.ValidationError):  # JSONDecodeError is a ValueError
                ok = False
        else:
            # A byte-level detokenizer may end a cut output in a partial character, decoded as U+FFFD; inside
            # a JSON string (the only place a multi-byte character can be) the matcher takes it as any other.
            ok = finish == "length" and xgr.GrammarMatcher(compiled, terminate_without_stop_token=True).accept_string(
                text
            )
        kind = ("valid" if finish == "stop" else "prefix") if ok else "invalid"
        counts[kind] += 1
        if not ok and "invalid_example" not in counts:
            counts["invalid_example"] = {"finish_reason": finish, "text": text[:200]}
    return {**counts, "checked": True}


def _result(engine: str, outputs: list[tuple[str, str | None, int]], outs: list[int], elapsed: float) -> dict:
    """The fields both engines report: tokens produced (each request's output token ids), tokens requested, out
    tok/s from those produced, and the output check."""
    tokens = sum(n for _, _, n in outputs)
    return dict(
        engine=engine,
        requests=len(outs),
        elapsed_s=elapsed,
        output_tokens=tokens,
        requested_tokens=sum(outs),
        output_tok_s=tokens / elapsed,
        outputs=check_outputs([(text, finish) for text, finish, _ in outputs]),
    )


def run_pagoda(
    model: str,
    constrained: bool,
    grammar_inline: bool = False,
    requests: int = 256,
    lengths: tuple[int, int] = (100, 1024),
    **engine_kwargs,
) -> dict:
    """`engine_kwargs` go to pagoda's LLM over the defaults here (dtype, load_format, max_model_len)."""
    from engine import LLM, SamplingParams
    from engine.sampling_params import Constraint

    prompts, outs = workload(requests, *lengths)
    t0 = time.perf_counter()
    llm = LLM(
        model,
        **{
            "dtype": "bfloat16",
            "load_format": "dummy",
            "max_model_len": 4096,
            "grammar_thread_min_rows": 0 if grammar_inline else 16,  # the engine default is 0 (inline)
            **engine_kwargs,
        },
    )
    load_s = time.perf_counter() - t0
    constraint = Constraint("json", json.dumps(SCHEMA)) if constrained else None
    extra: dict = {}
    if constrained:
        t0 = time.perf_counter()
        llm.engine.compile_constraint(SamplingParams(constraint=constraint))
        extra["grammar_compile_s"] = time.perf_counter() - t0  # incl. xgrammar's one-off vocabulary read
        t0 = time.perf_counter()
        llm.engine.compile_constraint(SamplingParams(constraint=Constraint("json", json.dumps({**SCHEMA, "x": 1}))))
        extra["grammar_compile_warm_s"] = time.perf_counter() - t0  # another schema, vocabulary known
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, constraint=constraint)
    llm.generate([p[:32] for p in prompts[:8]], warm, use_tqdm=False)
    llm.engine.block_manager.reset_prefix_cache()
    phases = _time_phases(llm.engine)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, constraint=constraint) for n in outs]
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps = phases.pop("step")
    extra.update(steps=steps[1], host_ms_per_step={k: round(1e3 * t / steps[1], 3) for k, (t, _) in phases.items()})
    extra["host_ms_per_step"]["step"] = round(1e3 * steps[0] / steps[1], 3)
    if constrained:
        extra["valid_json_prefixes"] = _prefixes_ok(llm, constraint, results)
    outputs = [(r.outputs[0].text, r.outputs[0].finish_reason, len(r.outputs[0].token_ids)) for r in results]
    return dict(**_result("pagoda", outputs, outs, elapsed), xgrammar=version("xgrammar"), load_s=load_s, **extra)


def _time_phases(engine) -> dict[str, list[float]]:
    """Wrap the engine's step phases in host timers: {phase: [seconds, calls]}, filled as it runs.

    collect includes the wait for the device (the step's tokens); launch is schedule + enqueue, and with
    the grammar thread the step after a deferred one is scheduled and enqueued outside launch (schedule and
    enqueue count both ways); grammar_fill is the masks filled on the engine thread for a step whose
    constrained rows have no token in flight; grammar_work the matchers advanced and the next masks filled
    (on the grammar thread; inline below grammar_thread_min_rows rows or where no step waits for a mask);
    grammar_wait the engine thread's wait for the grammar thread."""
    totals: dict[str, list[float]] = {}

    def timed(owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)
        cell = totals.setdefault(phase, [0.0, 0])

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                cell[0] += time.perf_counter() - start
                cell[1] += 1

        setattr(owner, name, wrapper)

    timed(engine, "step", "step")
    timed(engine, "_complete", "complete")
    timed(engine.runner, "collect", "collect")
    timed(engine.scheduler, "update", "scheduler_update")
    timed(engine, "_launch", "launch")  # _schedule + _enqueue; with the grammar thread the two come apart:
    timed(engine, "_schedule", "schedule")
    timed(engine, "_enqueue", "enqueue")
    timed(engine.runner, "sample", "sample")
    timed(engine, "_mask", "grammar_fill")
    timed(engine, "_grammar_done", "grammar_wait")
    if engine._grammars is not None:  # made by the compile before a constrained run
        timed(engine._grammars, "run", "grammar_work")
    return totals


def _prefixes_ok(llm, constraint, results) -> int:
    """How many outputs a fresh matcher accepts up to its grammar's end (the mask really held them)."""
    grammars = llm.engine.grammars
    compiled = grammars.compile(constraint)
    ok = 0
    for r in results:
        matcher = grammars.matcher(compiled)
        ok += all(matcher.is_terminated() or matcher.accept_token(t) for t in r.outputs[0].token_ids)
    return ok


def run_vllm(model: str, constrained: bool, requests: int = 256, lengths: tuple[int, int] = (100, 1024)) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    prompts, outs = workload(requests, *lengths)
    t0 = time.perf_counter()
    # vLLM 0.26 offline takes the schema as SamplingParams.structured_outputs = StructuredOutputsParams(json=...)
    # (vllm/sampling_params.py; its OpenAI server maps response_format {"type": "json_schema"} onto the same
    # field, vllm/entrypoints/openai/engine/protocol.py structured_outputs_from_response_format). The
    # backend is named, not "auto": auto falls back to guidance or outlines for a schema xgrammar rejects, and
    # pagoda uses xgrammar. vLLM's xgrammar compiles JSON schemas with any_whitespace unless
    # disable_any_whitespace; pagoda compiles with any_whitespace=False, so both compile the same grammar.
    so_config = {"backend": "xgrammar", "disable_any_whitespace": True}
    llm = LLM(
        model=model,
        load_format="dummy",
        dtype="bfloat16",
        seed=0,
        max_model_len=4096,
        gpu_memory_utilization=0.9,
        structured_outputs_config=so_config,
    )
    load_s = time.perf_counter() - t0

    def sp(n: int) -> SamplingParams:
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, structured_outputs=so)

    llm.generate([{"prompt_token_ids": p[:32]} for p in prompts[:8]], [sp(8)] * 8, use_tqdm=False)
    t0 = time.perf_counter()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], [sp(n) for n in outs], use_tqdm=False)
    elapsed = time.perf_counter() - t0
    outputs = [(r.outputs[0].text, r.outputs[0].finish_reason, len(r.outputs[0].token_ids)) for r in results]
    return dict(
        **_result("vllm", outputs, outs, elapsed),
        vllm_version=vllm.__version__,
        xgrammar=version("xgrammar"),
        structured_outputs_config=so_config,
        load_s=load_s,
    )


def fill_costs(model: str) -> dict:
    """Host cost of one step's grammar work at W2's batch: 256 matchers of SCHEMA, each advanced by a
    random walk of 1-300 allowed tokens, filled by xgrammar's batch matcher at several thread counts,
    and advanced by one token each in one call. Milliseconds, the best (and for the accept the median) of 20."""
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = 151936
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[tokenizer.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(256)]
    bitmask = xgr.allocate_token_bitmask(256, vocab)
    walks = [rng.randint(1, 300) for _ in matchers]
    for step in range(max(walks)):
        xgr.BatchGrammarMatcher("auto").batch_fill_next_token_bitmask(matchers, bitmask)
        logits = torch.randn(256, vocab, generator=gen)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        tokens = logits.argmax(-1).tolist()
        for m, t, n in zip(matchers, tokens, walks):
            if step < n:
                assert m.accept_token(t)
    row: dict = {"cpus": os.cpu_count()}
    for threads in (1, 2, 4, 8, "auto"):
        batch = xgr.BatchGrammarMatcher(threads)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
            times.append(time.perf_counter() - start)
        row[f"fill_ms_threads_{threads}"] = round(1e3 * min(times), 3)
    times = []
    for _ in range(20):
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        logits = torch.randn(256, vocab, generator=gen)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        tokens = logits.argmax(-1).tolist()
        start = time.perf_counter()
        xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        times.append(time.perf_counter() - start)
    row["accept_ms"] = round(1e3 * min(times), 3)
    row["accept_ms_median"] = round(1e3 * sorted(times)[len(times) // 2], 3)
    return row


def _status(row: dict) -> str:
    """ok, or why a row's throughput must not be compared: invalid outputs, or outputs never checked."""
    if "error" in row:
        return f"did not run: {row['error']}"
    check = row.get("outputs")
    if check is None:
        return "outputs unchecked (a row from before the check)"
    if not check.get("checked"):
        return f"outputs unchecked ({check.get('why')})"
    if row["constrained"] and check["invalid"]:
        return f"INVALID OUTPUTS: {check['invalid']} of {row.get('requests', '?')}"
    return "ok"


def summarize(rows: list[dict]) -> str:
    """The markdown table of `summary`: per engine and run kind the out tok/s of every row (median, min-max), the
    tokens produced against those requested, the output check, and the ratios of constrained runs, each only
    between kinds all of whose rows are ok (an unconstrained run's outputs are checked but never held to the
    schema)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        kind = (
            r["engine"]
            + ("" if r.get("constrained", True) else "-plain")
            + ("-inline" if r.get("grammar_inline") else "")
        )
        groups.setdefault(kind, []).append(r)

    def median(xs: list[float]) -> float:
        xs = sorted(xs)
        return (xs[len(xs) // 2] + xs[(len(xs) - 1) // 2]) / 2

    lines = [
        "| run | rows | out tok/s median (min-max) | tokens produced / requested | valid / prefix / invalid | status |",
        "|---|---|---|---|---|---|",
    ]
    tok_s: dict[str, float] = {}
    clean: dict[str, bool] = {}
    for kind, rs in groups.items():
        ran = [r for r in rs if "error" not in r]
        statuses = sorted({_status(r) for r in rs})
        clean[kind] = statuses == ["ok"]
        speeds = [r["output_tok_s"] for r in ran]
        if speeds:
            tok_s[kind] = median(speeds)
        speed = f"{tok_s[kind]:,.0f} ({min(speeds):,.0f}-{max(speeds):,.0f})" if speeds else "-"
        produced = "; ".join(
            f"{r['output_tokens']:,} / {r['requested_tokens']:,}" for r in ran if "requested_tokens" in r
        )
        checks = "; ".join(
            f"{c['valid']} / {c['prefix']} / {c['invalid']}"
            for r in ran
            if (c := r.get("outputs")) and c.get("checked")
        )
        lines.append(f"| {kind} | {len(rs)} | {speed} | {produced or '-'} | {checks or '-'} | {'; '.join(statuses)} |")
    lines += ["", "Ratios of medians (only where every row of both runs is ok):"]
    pairs = [(p, "vllm") for p in ("pagoda", "pagoda-inline")] + [(e, f"{e}-plain") for e in ("pagoda", "vllm")]
    for a, b in pairs:
        if a not in groups or b not in groups:
            continue
        if clean[a] and clean[b] and a in tok_s and b in tok_s:
            lines.append(f"- {a} / {b}: {tok_s[a] / tok_s[b]:.3f}")
        else:
            bad = ", ".join(k for k in (a, b) if not clean[k])
            lines.append(f"- {a} / {b}: not compared ({bad} not ok)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["model", "run", "fills", "summary"])
    parser.add_argument("dir", help="the model directory (summary: the structured.jsonl file)")
    parser.add_argument("--md", default=None, help="summary: also write the table here")
    parser.add_argument("--engine", choices=["pagoda", "vllm"], default="pagoda")
    parser.add_argument("--plain", action="store_true", help="the same workload without a schema")
    parser.add_argument(
        "--grammar-inline",
        action="store_true",
        help="pagoda: the grammar work on the engine thread (no grammar thread)",
    )
    args = parser.parse_args()
    if args.what == "model":
        write_model(Path(args.dir))
        return
    if args.what == "summary":
        table = summarize([json.loads(line) for line in Path(args.dir).read_text().splitlines() if line.strip()])
        print(table)
        if args.md:
            Path(args.md).write_text(table + "\n")
        return
    if args.what == "fills":
        print(json.dumps({"what": "fill_costs", **fill_costs(args.dir)}), flush=True)
        return
    if args.engine == "pagoda":
        result = run_pagoda(args.dir, not args.plain, args.grammar_inline)
    else:
        result = run_vllm(args.dir, not args.plain)
    row = {"workload": "w2", "constrained": not args.plain, "grammar_inline": args.grammar_inline, **result}
    row["outputs_ok"] = _status(row) == "ok"
    print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "/tmp")) / "structured.jsonl"
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
