"""Structured outputs in the engine: constrained sampling through xgrammar, on the default model's tokenizer.

A tiny random Llama with the default model's vocabulary writes whatever its random weights favour, so
every token it emits under a grammar was forced by the mask; the default model itself shows that the
constrained outputs are also what a real model says.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
import torch

from engine import LLM, InvalidParameter, SamplingParams
from engine.faults import FaultInjector
from engine.sampler import Sampler, SamplerRow
from engine.sampling_params import Constraint
from engine.sequence import RequestOutput
from engine.structured import Grammars, apply_mask
from engine.tokenizer import Tokenizer
from tests.conftest import KV_BYTES, TINY

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}


def json_constraint(schema: dict) -> Constraint:
    return Constraint("json", json.dumps(schema), param="response_format")


@pytest.fixture(scope="module")
def random_model_dir(default_model_dir, tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer and vocabulary size."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("random-smol")
    config = LlamaConfig(**{**TINY, "vocab_size": 49152, "max_position_embeddings": 1024}, tie_word_embeddings=True)
    config.eos_token_id, config.bos_token_id = 2, 1
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, path / name)
    return path


def make_llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES, **kw)


@pytest.fixture(scope="module")
def random_llm(random_model_dir):
    return make_llm(random_model_dir)


@pytest.fixture(scope="module")
def smol(default_model_dir):
    return make_llm(default_model_dir, max_model_len=512)


def prefix_ok(llm: LLM, constraint: Constraint, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of `constraint` accepts every token (the output is a prefix of a match)."""
    grammars = llm.engine.grammars
    matcher = grammars.matcher(grammars.compile(constraint))
    return all(matcher.accept_token(t) for t in token_ids)


def test_random_model_under_a_schema_writes_valid_json(random_llm):
    constraint = json_constraint(PERSON)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=120, constraint=constraint)
    outputs = random_llm.generate(["hello", "a b c"], params, use_tqdm=False)
    finished = 0
    for out in outputs:
        for choice in out.outputs:
            assert prefix_ok(random_llm, constraint, choice.token_ids)
            if choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.text), PERSON)
                finished += 1
    # The schema bounds every string and array, so the grammar forces an end well within 120 tokens.
    assert finished == 6


@pytest.mark.parametrize(
    "constraint, check",
    [
        (Constraint("regex", r"[a-z]{3}-\d{2,4}"), lambda text: __import__("re").fullmatch(r"[a-z]{3}-\d{2,4}", text)),
        (Constraint("choice", json.dumps(["alpha", "beta gamma", 'quote " inside'])), None),
        (Constraint("grammar", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'), None),
        (Constraint("grammar", 'start: "<" WORD ">"\nWORD: /[a-z]+/'), None),  # Lark
        (Constraint("json_object"), lambda text: isinstance(json.loads(text), dict)),
    ],
)
def test_random_model_matches_regex_choice_grammar_and_json_object(random_llm, constraint, check):
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=60, constraint=constraint)
    for choice in random_llm.generate(["x"], params, use_tqdm=False)[0].outputs:
        assert prefix_ok(random_llm, constraint, choice.token_ids)
        if constraint.kind == "choice":
            assert choice.finish_reason == "stop"
            assert choice.text in json.loads(constraint.spec)
        elif choice.finish_reason == "stop" and check is not None:
            assert check(choice.text)


def test_default_model_fills_a_schema_greedily(smol):
    params = SamplingParams(temperature=0, max_tokens=100, constraint=json_constraint(PERSON))
    prompt = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person named Ann, aged 31, as JSON."}]
    )
    out = smol.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    jsonschema.validate(value, PERSON)
    assert value["age"] == 31


def test_max_tokens_mid_object_ends_with_length(smol):
    params = SamplingParams(temperature=0, max_tokens=5, constraint=json_constraint(PERSON))
    out = smol.generate(["Describe a person:"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 5 and out.text.startswith("{")
    assert prefix_ok(smol, json_constraint(PERSON), out.token_ids)


def test_bad_constraints_name_their_field(random_llm):
    cases = [
        Constraint("json", '{"type": "objec"}', param="response_format"),
        Constraint("json", "not json", param="guided_json"),
        Constraint("regex", "a(", param="structured_outputs.regex"),
        Constraint("grammar", "root ::= undefined_rule", param="guided_grammar"),
    ]
    for constraint in cases:
        with pytest.raises(InvalidParameter) as info:
            random_llm.generate(["x"], SamplingParams(max_tokens=4, constraint=constraint), use_tqdm=False)
        assert info.value.param == constraint.param
        assert "cannot be compiled" in str(info.value) and "/project/" not in str(info.value)
    with pytest.raises(InvalidParameter):
        Constraint("yaml", "x")
    # The engine is unharmed: a plain request still runs.
    assert random_llm.generate(["x"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)


def test_neighbours_of_constrained_rows_are_unchanged(random_llm):
    """Constrained and unconstrained sequences in one batch: the unconstrained ones sample exactly as alone."""
    plain = SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True)
    alone = random_llm.generate(["one two"], plain, use_tqdm=False)[0].outputs[0].token_ids
    constrained = SamplingParams(temperature=0.9, seed=6, max_tokens=20, constraint=json_constraint(PERSON))
    mixed = random_llm.generate(["zz", "one two", "q"], [constrained, plain, constrained], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


def small_llm(random_model_dir, preemption_mode: str = "recompute", grammar_thread_min_rows: int = 1) -> LLM:
    # 12 blocks of 16 tokens for 8 requests (10 sequences) of ~40-token prompts: they preempt each other.
    # The grammar thread takes every step's grammar work (by default only steps of 16 rows or more).
    return make_llm(
        random_model_dir,
        num_gpu_blocks_override=12,
        block_size=16,
        preemption_mode=preemption_mode,
        swap_space=0.01,
        async_scheduling=True,
        max_model_len=160,
        grammar_thread_min_rows=grammar_thread_min_rows,
    )


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_constrained_outputs_survive_preemption_and_async_scheduling(random_model_dir, random_llm, preemption_mode):
    """A 12-block pool under 8 concurrent constrained requests preempts; the deferred sampling of async
    scheduling fills masks after the tokens in flight. Every output equals the same request run alone."""
    constraint = json_constraint(PERSON)
    params = [
        SamplingParams(temperature=0.8, seed=100 + i, max_tokens=48, constraint=constraint if i % 4 else None)
        for i in range(8)
    ]
    prompts = [f"request {i} " * 6 for i in range(8)]
    alone = [random_llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    small = small_llm(random_model_dir, preemption_mode)
    together = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone
    assert sum(small.engine.scheduler.num_preemptions.values()) > 0


def test_mask_fills_only_allowed_tokens(random_llm):
    """The sampler draws only tokens the grammar allows, and greedy takes the best allowed one."""
    grammars: Grammars = random_llm.engine.grammars
    choices = ["yes", "no"]
    compiled = grammars.compile(Constraint("choice", json.dumps(choices)))
    vocab = random_llm.engine.runner.vocab_size
    sampler = Sampler(vocab, frozenset({2}), torch.device("cpu"))
    logits = torch.randn(6, vocab)
    rows = [SamplerRow(SamplingParams(temperature=1.0 if i % 2 else 0.0), i, [1], []) for i in range(6)]
    mask = grammars.fill([(1, grammars.matcher(compiled)), (2, grammars.matcher(compiled))])
    bits = mask.bitmask[0]
    allowed = {t for t in range(vocab) if (bits[t // 32].item() >> (t % 32)) & 1}
    # Exactly the tokens that begin a choice.
    tokenizer: Tokenizer = random_llm.tokenizer
    for t in allowed:
        text = tokenizer.decode([t])
        assert text and any(c.startswith(text) for c in choices), text
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in allowed
    drawn = set()
    for step in range(50):
        for r in rows:
            r.num_output_tokens = step
        out = sampler(logits, rows, mask)
        drawn |= {out.token_ids[1].item(), out.token_ids[2].item()}
        assert out.token_ids[0].item() == logits[0].argmax().item()  # unconstrained rows untouched
    assert drawn <= allowed and drawn
    best = max(allowed, key=lambda t: logits[2, t].item())
    assert sampler(logits, rows, mask).token_ids[2].item() == best


def test_batch_advance_matches_one_matcher_at_a_time(random_llm):
    """Masks filled for a batch on xgrammar's threads and matchers advanced in one call agree with one
    matcher at a time; refused() names exactly the rows whose token the mask forbade; a matcher that
    takes its stop token terminates (and, as the engine drops it, leaves the batch)."""
    engine = random_llm.engine
    grammars: Grammars = engine.grammars
    # A long grammar, and a short one whose matchers take the stop token and terminate early.
    compiled = [grammars.compile(Constraint("json", json.dumps(PERSON))), grammars.compile(Constraint("regex", "[ab]"))]
    eos = min(engine.eos_token_ids)
    ours = [grammars.matcher(compiled[i % 2]) for i in range(150)]
    reference = [grammars.matcher(compiled[i % 2]) for i in range(150)]
    gen = torch.Generator().manual_seed(0)
    vocab = engine.runner.vocab_size
    for _ in range(12):
        live = [i for i, m in enumerate(reference) if not m.is_terminated()]
        mask = grammars.fill([(i, ours[i]) for i in live])
        expected = torch.zeros_like(mask.bitmask)
        for k, i in enumerate(live):
            reference[i].fill_next_token_bitmask(expected, k)
        assert torch.equal(mask.bitmask, expected) and mask.rows == live
        # A random allowed token per row (the stop token where allowed in every seventh row), but in
        # every tenth row a forbidden one.
        logits = torch.randn(len(ours), vocab, generator=gen)
        logits[::7, eos] = 1e4
        apply_mask(logits, mask)
        tokens = logits.argmax(-1).tolist()
        forbidden = [i for i in live if i % 10 == 0]
        for i in forbidden:
            k = live.index(i)
            tokens[i] = next(t for t in range(vocab) if not (mask.bitmask[k, t // 32].item() >> (t % 32)) & 1)
        assert mask.refused(tokens) == set(forbidden)
        accepted = [i for i in live if i not in forbidden]
        grammars.accept([ours[i] for i in accepted], [tokens[i] for i in accepted])
        for i in accepted:
            assert reference[i].accept_token(tokens[i])
            assert ours[i].is_terminated() == reference[i].is_terminated() == (tokens[i] == eos)
    assert any(m.is_terminated() for m in reference) and not all(m.is_terminated() for m in reference)


def test_ignore_eos_runs_on_unconstrained_past_the_grammars_end(random_llm):
    """With ignore_eos a sequence outlives its grammar: once the grammar has taken the stop token, the
    rest is sampled unconstrained (before, the grammar allowed nothing but the stop token)."""
    eos = min(random_llm.engine.eos_token_ids)
    params = SamplingParams(max_tokens=8, ignore_eos=True, constraint=Constraint("regex", "[ab]"))
    out = random_llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    # Greedy under "[ab]": one letter, then only the stop token is allowed.
    assert random_llm.tokenizer.decode(out.token_ids[:1]) in ("a", "b") and out.token_ids[1] == eos
    assert set(out.token_ids[2:]) - {eos}


# ----- the grammar thread (async scheduling): the same outputs as the synchronous path -----

OVERLAP_PROMPTS = {f"r{i}": f"request {i} " * 6 for i in range(8)}


def overlap_params(rid: str) -> SamplingParams:
    """Mixed kinds: a schema (n = 2, random), a schema greedy with a stop string, a regex cut short by
    max_tokens, a choice, and unconstrained neighbours."""
    i = int(rid[1:])
    person = json_constraint(PERSON)
    return [
        SamplingParams(temperature=0.8, seed=100 + i, n=2, max_tokens=48, constraint=person),
        SamplingParams(temperature=0.0, max_tokens=48, constraint=person, stop=['"tags"']),
        SamplingParams(temperature=0.9, seed=100 + i, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=100 + i, max_tokens=6, constraint=Constraint("regex", r"[a-z]{4,30}")),
        SamplingParams(temperature=0.0, max_tokens=12, constraint=Constraint("choice", '["alpha", "beta"]')),
        SamplingParams(temperature=0.8, seed=100 + i, n=2, max_tokens=48, constraint=person),
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=0.8, seed=100 + i, max_tokens=48, constraint=person),
    ][i]


def drive(llm: LLM, prompts: dict, abort: dict | None = None, faults: str | None = None, max_steps=2000) -> dict:
    """Run `prompts` (id -> prompt) through the engine step by step; `abort` (id -> steps) aborts a
    request after that many steps. Every request's final RequestOutput (an aborted one's as it was left),
    by id; no KV block leaks."""
    engine = llm.engine
    engine.faults = FaultInjector.parse(faults) if faults else None
    abort = dict(abort or {})
    finished = {}
    try:
        requests = {rid: engine.add_request(rid, prompt, overlap_params(rid)) for rid, prompt in prompts.items()}
        for step in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            for rid, when in list(abort.items()):
                if step == when:
                    engine.abort_request(rid)
                    finished[rid] = RequestOutput.of(requests[rid])
                    del abort[rid]
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in finished, f"{out.request_id} finished twice"
                    finished[out.request_id] = out
    finally:
        engine.faults = None
    engine.step()  # the empty step after the last finish
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "KV blocks leaked"
    return finished


@pytest.fixture(scope="module")
def synchronous_outputs(random_llm):
    """Each request alone, on the synchronous path (no async scheduling: the grammar work runs inline)."""
    assert not random_llm.engine.config.async_scheduling
    return {rid: drive(random_llm, {rid: p})[rid] for rid, p in OVERLAP_PROMPTS.items()}


def outputs_of(out) -> list[tuple[list[int], str | None]]:
    return [(o.token_ids, o.finish_reason) for o in out.outputs]


@pytest.mark.parametrize("preemption_mode, min_rows", [("recompute", 1), ("swap", 1), ("recompute", 0)])
def test_grammar_thread_matches_the_synchronous_path(random_model_dir, synchronous_outputs, preemption_mode, min_rows):
    """Constrained (n = 2, stop strings, max_tokens) and unconstrained requests in one batch of a small pool,
    with async scheduling: masks filled on the grammar thread while the engine schedules (or inline, with
    grammar_thread_min_rows 0), preemption, and every output (tokens and finish reason) equal to the
    request's alone on the synchronous path."""
    llm = small_llm(random_model_dir, preemption_mode, min_rows)
    together = drive(llm, OVERLAP_PROMPTS)
    for rid, out in together.items():
        assert outputs_of(out) == outputs_of(synchronous_outputs[rid]), rid
        constraint = overlap_params(rid).constraint
        for choice in out.outputs:
            if constraint is not None:
                assert prefix_ok(llm, constraint, choice.token_ids)
            if constraint is not None and constraint.kind == "json" and choice.finish_reason == "stop":
                if choice.stop_reason is None:  # ended by the grammar, not by the stop string
                    jsonschema.validate(json.loads(choice.text), PERSON)
    reasons = {o.finish_reason for out in together.values() for o in out.outputs}
    assert {"stop", "length"} <= reasons
    assert together["r1"].outputs[0].stop_reason == '"tags"'
    assert together["r3"].outputs[0].finish_reason == "length"  # max_tokens mid-match
    assert sum(llm.engine.scheduler.num_preemptions.values()) > 0
    assert bool(llm.engine.grammars._worker._threads) == (min_rows > 0), "the grammar thread ran, or not"


def test_abort_of_a_constrained_request_leaves_the_others(random_model_dir, synchronous_outputs):
    """Requests aborted mid-generation while constrained (their next mask already being filled) end with
    "abort"; every other request finishes as it would have."""
    llm = small_llm(random_model_dir)
    together = drive(llm, OVERLAP_PROMPTS, abort={"r0": 6, "r7": 9})
    for rid, out in together.items():
        if rid in ("r0", "r7"):
            assert {o.finish_reason for o in out.outputs} == {"abort"} and out.error is None
        else:
            assert outputs_of(out) == outputs_of(synchronous_outputs[rid]), rid
    assert len(together["r7"].outputs[0].token_ids) > 0  # it was generating


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failing_grammar_fails_its_request_only(random_model_dir, synchronous_outputs, async_scheduling):
    """A matcher that raises when advanced (an injected fault; on the grammar thread with async scheduling,
    inline without) fails its request with an error; every other request finishes as it would have."""
    llm = small_llm(random_model_dir) if async_scheduling else make_llm(random_model_dir)
    together = drive(llm, OVERLAP_PROMPTS, faults="grammar:r5")
    for rid, out in together.items():
        if rid == "r5":
            assert {o.finish_reason for o in out.outputs} == {"error"}
            assert "the structured-output grammar failed: injected fault" in out.error
        else:
            assert outputs_of(out) == outputs_of(synchronous_outputs[rid]), rid
