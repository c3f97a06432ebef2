"""bench/structured.py: every engine's outputs are checked against the schema the same way (check_outputs), a run
with invalid outputs is flagged and never compared (summarize), and a real pagoda run at tiny size on the CPU
reports its check and the tokens it produced."""

from __future__ import annotations

import json

import pytest

from bench import structured
from bench.structured import check_outputs, summarize
from tests.conftest import KV_BYTES
from tests.test_structured import random_model_dir  # noqa: F401 (a fixture, for the test that asks for it)

RECORD = {"id": 1, "name": "a", "kind": "beta", "score": 0.5, "tags": ["x"]}


def test_check_outputs_complete_documents_prefixes_and_garbage():
    full = json.dumps({"records": [RECORD] * 400})
    cases = [
        (full, "stop", "valid"),
        (json.dumps({"records": [RECORD] * 399}), "stop", "invalid"),  # minItems
        (json.dumps({"records": [{**RECORD, "kind": "delta"}] * 400}), "stop", "invalid"),  # enum
        (full[:-1], "stop", "invalid"),  # a cut document that claims to have stopped
        ('{"records": [{"id": 1, "na', "length", "prefix"),
        ('{ "records" :\n [ {"id" : -3.', "length", "invalid"),  # id is an integer
        ('{ "records" :\n [ {"id" : -3', "length", "prefix"),  # any whitespace, whichever engine wrote it
        # Extra properties and properties in any order are allowed, as JSON Schema allows them.
        ('{"records": [{"id": 1, "name": "", "kind": "beta", "x": {"a": [true', "length", "prefix"),
        ('{"records": [{"tags": [], "score": 1, "kind": "alpha", "name": "", "id": 3}, {"name": "', "length", "prefix"),
        ('{"records": [{"id": 1}, ', "length", "invalid"),  # a record without its required properties
        ('{"records": "', "length", "invalid"),
        ("Sure! Here is", "length", "invalid"),
        (full + " trailing", "length", "invalid"),  # a document that went on past its end
        ('{"records": [', None, "invalid"),  # no finish reason: the request did not end
    ]
    got = check_outputs([(text, finish) for text, finish, _ in cases])
    want = {k: sum(kind == k for _, _, kind in cases) for k in ("valid", "prefix", "invalid")}
    assert {k: got[k] for k in want} == want and got["checked"] is True
    assert got["invalid_example"]["text"] == cases[1][0][:200]
    # Each case alone, so a miscount cannot hide behind another.
    for text, finish, kind in cases:
        assert check_outputs([(text, finish)])[kind] == 1, (text[:60], finish, kind)


def row(engine: str, tok_s: float, constrained: bool = True, invalid: int = 0, **kw) -> dict:
    outputs = {"valid": 0, "prefix": 4 - invalid, "invalid": invalid, "checked": True}
    return {"engine": engine, "constrained": constrained, "grammar_inline": False, "requests": 4,
            "output_tok_s": tok_s, "output_tokens": 40, "requested_tokens": 40, "outputs": outputs, **kw}  # fmt: skip


def test_summary_never_compares_a_run_with_invalid_outputs():
    rows = [row("pagoda", 1100.0), row("pagoda", 1300.0), row("vllm", 1000.0), row("vllm", 1800.0, invalid=3)]
    rows += [row("pagoda", 1200.0, constrained=False, invalid=4), row("vllm", 1900.0, constrained=False, invalid=4)]
    lines = summarize(rows).splitlines()
    assert "| pagoda | 2 | 1,200 (1,100-1,300) | 40 / 40; 40 / 40 | 0 / 4 / 0; 0 / 4 / 0 | ok |" in lines
    assert (
        "| vllm | 2 | 1,400 (1,000-1,800) | 40 / 40; 40 / 40 | 0 / 4 / 0; 0 / 1 / 3 | INVALID OUTPUTS: 3 of 4; ok |"
        in lines
    )
    assert "- pagoda / vllm: not compared (vllm not ok)" in lines
    assert "- vllm / vllm-plain: not compared (vllm not ok)" in lines
    # Unconstrained outputs are checked, but not held to the schema.
    assert "- pagoda / pagoda-plain: 1.000" in lines
    # Outputs never checked (no validator, or a row from before the check) are not compared either.
    unchecked = {"valid": 0, "prefix": 0, "invalid": 0, "checked": False, "why": "cannot import jsonschema"}
    table = summarize([row("pagoda", 1100.0), row("vllm", 1000.0, outputs=unchecked)])
    assert "outputs unchecked (cannot import jsonschema)" in table and "not compared (vllm not ok)" in table
    old = {k: v for k, v in row("vllm", 1000.0).items() if k != "outputs"}
    assert "not compared" in summarize([row("pagoda", 1100.0), old])
    assert "- pagoda / vllm: 1.100" in summarize([row("pagoda", 1100.0), row("vllm", 1000.0)])


def test_pagoda_run_checks_its_outputs(random_model_dir):  # noqa: F811
    kw = dict(requests=4, lengths=(8, 24), dtype="float32", device="cpu", load_format="auto")
    kw |= dict(max_model_len=256, cpu_kv_cache_bytes=KV_BYTES)
    r = structured.run_pagoda(str(random_model_dir), constrained=True, **kw)
    # Under the schema (at least 400 records, so never complete here) every output is a prefix of a document.
    assert r["outputs"] == {"valid": 0, "prefix": 4, "invalid": 0, "checked": True}
    _, outs = structured.workload(4, 8, 24)
    assert r["output_tokens"] == r["requested_tokens"] == sum(outs)
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["elapsed_s"])
    # The random model left to itself writes no such prefix, and the check says so.
    plain = structured.run_pagoda(str(random_model_dir), constrained=False, **kw)
    assert plain["outputs"]["checked"] and plain["outputs"]["invalid"] == 4
    assert structured._status({**plain, "constrained": False}) == "ok"
    assert structured._status({**plain, "constrained": True}) == "INVALID OUTPUTS: 4 of 4"
