"""Faults inside the engine, injected through the test-only hook (engine/faults.py): the requests they hit fail
with an error, every other request finishes as it would have, no KV block leaks, and a fault that does not go
away ends the engine with EngineFailedError instead of a hang."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.faults import FaultInjector
from engine.llm_engine import MAX_CONSECUTIVE_STEP_FAILURES, EngineFailedError
from tests.conftest import KV_BYTES

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = {f"req-{i}": [5 + i, 17, 33 + 2 * i, 90, 7 * i + 1] for i in range(5)}


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        # On CUDA, with decode graphs and async scheduling: a fault leaves launched steps on the device.
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
    ],
)
def llm(request, tiny_model_dir):
    # Two running at a time: with five requests, three wait while the first step runs.
    device_kwargs = {"cpu_kv_cache_bytes": KV_BYTES} if request.param == "cpu" else {"num_gpu_blocks_override": 256}
    return LLM(str(tiny_model_dir("qwen3")), dtype="float32", device=request.param, max_num_seqs=2, **device_kwargs)


@pytest.fixture(scope="module")
def baseline(llm):
    """Each request's tokens with no fault."""
    return {rid: _run(llm, {rid: prompt})[rid].outputs[0].token_ids for rid, prompt in PROMPTS.items()}


def _run(llm: LLM, prompts: dict, params: SamplingParams | dict = GREEDY, faults: str | None = None, max_steps=500):
    """Run `prompts` (id -> prompt) to the end under `params` (one, or id -> params) and `faults`."""
    engine = llm.engine
    engine.faults = FaultInjector.parse(faults) if faults else None
    try:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params[rid] if isinstance(params, dict) else params)
        finished = {}
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in finished, f"{out.request_id} finished twice"
                    finished[out.request_id] = out
        assert set(finished) == set(prompts), "a request never finished"
        _assert_no_leak(llm)
        return finished
    finally:
        engine.faults = None


def _assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    engine.step()  # the empty step after the last finish
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    sched = engine.scheduler
    assert not sched.running and not sched.waiting and not sched.swapped
    assert engine.in_flight is None and engine.prelaunched is None


@pytest.mark.parametrize("kind", ["step", "oom"])
def test_failed_step_fails_its_requests_others_finish(llm, baseline, kind):
    finished = _run(llm, PROMPTS, faults=f"{kind}:req-0")
    failed = {rid for rid, out in finished.items() if out.error is not None}
    # req-0's first forward fails, and with it the other request of that step; the three waiting go on.
    assert "req-0" in failed and len(failed) == 2, failed
    for rid, out in finished.items():
        if rid in failed:
            assert {o.finish_reason for o in out.outputs} == {"error"}
            expected = "ran out of device memory" if kind == "oom" else "failed (InjectedFault)"
            assert expected in out.error
        else:
            assert out.outputs[0].token_ids == baseline[rid], rid
    assert llm.engine.consecutive_step_failures == 0


def test_nan_logits_fail_one_sequence_alone(llm, baseline):
    finished = _run(llm, PROMPTS, faults="nan:req-2")
    assert "non-finite logits" in finished["req-2"].error
    assert finished["req-2"].outputs[0].finish_reason == "error"
    for rid, out in finished.items():
        if rid != "req-2":
            assert out.error is None and out.outputs[0].token_ids == baseline[rid], rid


def test_nan_in_a_later_step_keeps_the_tokens_before(llm, baseline):
    # Fires on req-1's third sampled row: its first two tokens stand, the others are untouched.
    engine = llm.engine
    engine.faults = injector = FaultInjector.parse("nan:req-1")
    injector.rules[0].skip = 2  # two sampling rows pass before the fault fires
    engine.add_request("req-1", PROMPTS["req-1"], GREEDY)
    engine.add_request("req-3", PROMPTS["req-3"], GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    engine.faults = None
    _assert_no_leak(llm)
    assert finished["req-1"].error is not None
    assert finished["req-1"].outputs[0].token_ids == baseline["req-1"][:2]
    assert finished["req-3"].outputs[0].token_ids == baseline["req-3"]


def test_detokenizer_error_fails_one_sequence_of_n(default_model_dir):
    # The default model has a tokenizer (the tiny ones do not); n = 3: the request fails whole, the other
    # request does not notice.
    llm = LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=256, cpu_kv_cache_bytes=KV_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    clean = _run(llm, {"other": "The capital of France is"}, params)["other"]
    sampled = SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=8, ignore_eos=True)
    finished = _run(
        llm,
        {"victim": "Once upon a time", "other": "The capital of France is"},
        {"victim": sampled, "other": params},
        faults="detokenize:victim",
    )
    victim = finished["victim"]
    assert "detokenizing the output failed" in victim.error
    assert {o.finish_reason for o in victim.outputs} == {"error"} and len(victim.outputs) == 3
    assert finished["other"].error is None and finished["other"].outputs[0].text == clean.outputs[0].text


def test_repeated_step_failures_are_fatal(llm):
    engine = llm.engine
    engine.faults = FaultInjector.parse("step:*:always")
    try:
        with pytest.raises(EngineFailedError, match=f"{MAX_CONSECUTIVE_STEP_FAILURES} steps failed in a row"):
            for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
                engine.add_request(f"doomed-{i}", PROMPTS["req-0"], GREEDY)
                outs = engine.step()
                assert [o.error is not None for o in outs] == [True]
    finally:
        engine.faults = None
        engine.consecutive_step_failures = 0
        for rid in list(engine.requests):
            engine.abort_request(rid)


def test_fault_spec_is_checked():
    with pytest.raises(ValueError, match="KIND:MATCH"):
        FaultInjector.parse("explode:x")
    rule = FaultInjector.parse("nan:abc:always, step:*").rules
    assert [(r.kind, r.match, r.times) for r in rule] == [("nan", "abc", None), ("step", "*", 1)]
