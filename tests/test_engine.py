"""The engine end to end on real models: sampling through the scheduler, n > 1, stops, logprobs, limits."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, InvalidParameter, SamplingParams
from tests.conftest import KV_BYTES


@pytest.fixture(scope="module")
def smol(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=512, cpu_kv_cache_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir("qwen3")), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES)


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_seeded_requests_reproduce_whatever_the_batch(tiny):
    target = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=42, max_tokens=24, ignore_eos=True)
    prompt = list(range(5, 25))
    alone = tiny.generate([prompt], target, use_tqdm=False)[0].outputs[0].token_ids
    others = [list(range(30, 30 + n)) for n in (3, 50, 9)]
    noise = SamplingParams(temperature=0.7, seed=None, max_tokens=30, ignore_eos=True)
    mixed = tiny.generate(others[:1] + [prompt] + others[1:], [noise, target, noise, noise], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    chunked = LLM(
        tiny.engine.model_dir, dtype="float32", device="cpu", max_num_batched_tokens=16, cpu_kv_cache_bytes=KV_BYTES
    )
    again = chunked.generate(others + [prompt], [noise] * 3 + [target], use_tqdm=False)[3]
    assert again.outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=43, max_tokens=24, ignore_eos=True)
    assert tiny.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_children_share_the_prompt_blocks_and_differ(tiny):
    engine = tiny.engine
    prompt = list(range(1, 41))  # 2.5 blocks: the last one is shared and half full
    engine.add_request("fork", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, ignore_eos=True))
    engine.step()  # the whole prompt in one chunk: the children fork in this step
    request = engine.requests["fork"]
    assert len(request.seqs) == 3
    tables = [s.block_table for s in request.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert all(engine.block_manager.ref_counts[b] == 3 for b in tables[0])
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    completions = outs[0].outputs
    assert [c.index for c in completions] == [0, 1, 2]
    assert all(len(c.token_ids) == 20 for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) == 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # Greedy children are identical and equal to n = 1.
    greedy = tiny.generate(
        [prompt], SamplingParams(n=2, temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    single = tiny.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == greedy[0].outputs[1].token_ids == single[0].outputs[0].token_ids


def test_stop_strings_stop_token_ids_and_lengths(smol):
    prompt = chat_ids(smol, "Explain in detail why the sky is blue.")
    full = smol.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 40
    stop = full.text[12:16]
    assert full.text.find(stop) == 12
    cut = smol.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
    out = cut.outputs[0]
    assert out.text == full.text[:12] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = smol.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert kept.outputs[0].text == full.text[:16]
    stop_id = full.token_ids[6]
    first = full.token_ids.index(stop_id)
    by_id = smol.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert by_id.token_ids == full.token_ids[: first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id


def test_eos_and_min_tokens(smol):
    prompt = chat_ids(smol, "What is the capital of France?")
    natural = smol.generate([prompt], SamplingParams(temperature=0.0, max_tokens=100), use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] in smol.engine.eos_token_ids
    n = len(natural.token_ids)
    longer = smol.generate([prompt], SamplingParams(temperature=0.0, max_tokens=100, min_tokens=n + 5), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(longer.token_ids) >= n + 5
    assert not any(t in smol.engine.eos_token_ids for t in longer.token_ids[: n + 4])
    ignoring = smol.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=n + 10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(ignoring.token_ids) == n + 10 and ignoring.finish_reason == "length"


def test_logprobs_are_those_of_the_model(smol):
    from transformers import AutoModelForCausalLM

    prompt = chat_ids(smol, "Name a color.")
    out = smol.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=3), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    hf = AutoModelForCausalLM.from_pretrained(smol.engine.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(logits.float(), dim=-1)
    for i, entry in enumerate(out.logprobs):
        assert entry.token_id == out.token_ids[i]
        assert entry.logprob == pytest.approx(ref[i, entry.token_id].item(), abs=1e-4)
        top = ref[i].topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_requests_that_cannot_fit_are_rejected_with_the_param(smol):
    with pytest.raises(InvalidParameter) as err:
        smol.generate([[1] * 512], SamplingParams(max_tokens=1), use_tqdm=False)
    assert err.value.param == "prompt" and "512" in str(err.value)
    with pytest.raises(InvalidParameter) as err:
        smol.generate([[1] * 500], SamplingParams(max_tokens=20), use_tqdm=False)
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidParameter) as err:
        smol.generate([[10**7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidParameter) as err:  # could never be sampled: an error, not a stop condition
        smol.generate([[1, 2]], SamplingParams(max_tokens=2, stop_token_ids=[5, 10**7]), use_tqdm=False)
    assert err.value.param == "stop_token_ids" and str(10**7) in str(err.value)
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(temperature=-1)
    assert err.value.param == "temperature"
    assert not smol.engine.has_unfinished_requests()
    # The engine still serves after the rejections.
    ok = smol.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(ok.outputs[0].token_ids) == 3


def test_max_tokens_none_runs_to_the_context_length(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_model_len=40, cpu_kv_cache_bytes=KV_BYTES
    )
    out = llm.generate([[1] * 30], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_abort_frees_blocks(tiny):
    engine = tiny.engine
    engine.add_request("a", list(range(1, 60)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort_request("a")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()


def test_higher_priority_requests_finish_first_under_contention(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_num_seqs=2, cpu_kv_cache_bytes=KV_BYTES)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    priorities = [3, 2, 1, 0, 3, 2, 1, 0]
    for i, priority in enumerate(priorities):
        engine.add_request(f"p{i}", list(range(1, 10 + i)), params, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    finished_priorities = [priorities[int(r[1:])] for r in order]
    assert finished_priorities == sorted(finished_priorities)


def test_a_request_queued_past_its_timeout_finishes_with_timeout(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_num_seqs=1, cpu_kv_cache_bytes=KV_BYTES)
    engine = llm.engine
    engine.add_request("busy", list(range(1, 20)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("late", list(range(1, 10)), SamplingParams(max_tokens=5, n=1), queue_timeout=0.0)
    engine.add_request("patient", list(range(1, 10)), SamplingParams(max_tokens=5, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["late"].outputs[0].finish_reason == "timeout"
    assert finished["late"].outputs[0].token_ids == []
    assert len(finished["patient"].outputs[0].token_ids) == 5
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_async_scheduling_gives_the_same_outputs(default_model_dir):
    """Scheduling step N+1 before step N's tokens are read changes nothing a client sees: stops,
    EOS, lengths, seeds, n > 1, logprobs, penalties (which fall back to waiting)."""
    llms = [
        LLM(
            str(default_model_dir),
            dtype="float32",
            device="cpu",
            max_model_len=512,
            async_scheduling=a,
            max_num_batched_tokens=64,
            cpu_kv_cache_bytes=KV_BYTES,
        )
        for a in (False, True)
    ]
    prompts = [chat_ids(llms[0], t) for t in ("Count from one to ten.", "Name a color.", "Hi", "Write a poem.")]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, stop=["5."]),
        SamplingParams(temperature=0.0, max_tokens=60),  # ends by EOS
        SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0.8, seed=5, max_tokens=30, stop_token_ids=[13]),
    ]
    runs = [llm.generate(prompts, params, use_tqdm=False) for llm in llms]
    for sync, overlapped in zip(*runs):
        for a, b in zip(sync.outputs, overlapped.outputs):
            assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
                b.token_ids,
                b.text,
                b.finish_reason,
                b.stop_reason,
            )
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs:
                assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
    with_penalty = SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3, presence_penalty=0.5)
    outs = [llm.generate(prompts[:2], with_penalty, use_tqdm=False) for llm in llms]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    assert [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in runs[0]][:2] == [
        ("stop", "5."),
        ("stop", None),
    ]
    for llm in llms:
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks


def test_async_scheduling_defaults_to_on_for_cuda_only():
    from engine.config import EngineConfig

    assert EngineConfig(device="cpu").async_scheduling is False
    assert EngineConfig(device="cuda").async_scheduling is True
    assert EngineConfig(device="cuda", async_scheduling=False).async_scheduling is False
    assert EngineConfig(device="cpu", async_scheduling=True).async_scheduling is True


def test_the_cli_offers_every_attention_backend():
    """The flag's choices come from EngineConfig's field metadata: they must stay the engine's."""
    from engine.attention import BACKENDS
    from engine.config import EngineConfig
    from server.cli import build_parser

    with pytest.raises(ValueError, match="attention_backend must be one of auto, torch"):
        EngineConfig(attention_backend="tpu")
    serve = next(
        a
        for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
        if a.dest == "attention_backend"
    )
    assert list(serve.choices) == ["auto", *BACKENDS]


def test_fa4_prompt_route_is_off_where_it_does_not_apply(tiny_model_dir):
    """flash-attn-4 takes long prompt steps only with triton on a Hopper GPU where it imports: on the
    CPU (even with triton, in its interpreter) the backend is the plain one, and a negative threshold is refused."""
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="fa4_prefill_min_tokens"):
        EngineConfig(fa4_prefill_min_tokens=-1)
    from engine.attention import select_backend

    backend = select_backend("triton", torch.device("cpu"), torch.float32, 16, 64, 16, 8192)
    assert backend.name == "triton"
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", fa4_prefill_min_tokens=16, cpu_kv_cache_bytes=KV_BYTES)
    runner = llm.engine.runner
    assert runner.backend.name == "cpu"
    assert all(attn.backend is runner.backend for attn in runner.model.attention_layers())


def test_a_requests_stop_matcher_is_built_once_for_its_n_sequences(smol):
    engine = smol.engine
    request = engine.new_request("stops", [1, 2, 3], SamplingParams(n=4, stop=["a", "bc"], max_tokens=2))
    seqs = [engine._new_sequence(request, i) for i in range(4)]
    assert request.stop_matcher is not None
    assert all(seq.detokenizer._stops is request.stop_matcher for seq in seqs)
