"""Embedding requests in the engine: the pooled vector equals transformers' final hidden states (after the
final norm) on the same weights, whatever the chunking, prefix cache, preemption or batch around it."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, InvalidParameter, PoolingParams, SamplingParams
from tests.conftest import KV_BYTES

RAW_LAST = PoolingParams(pooling_type="last", normalize=False)
RAW_MEAN = PoolingParams(pooling_type="mean", normalize=False)


def prompts_of(lengths: list[int], vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * n) % (vocab - 1) + 1 for i in range(n)] for n in lengths]


def hf_hidden(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' last hidden state (after the final norm) of each prompt, run alone, in float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def assert_close(got: list[float], want: torch.Tensor) -> None:
    got = torch.tensor(got)
    assert got.shape == want.shape
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=0).item()
    assert cosine > 0.9999, cosine
    assert (got - want).abs().max().item() < 2e-5 * max(1.0, want.abs().max().item())


def vectors(llm: LLM, prompts, params: PoolingParams | None = None) -> list[list[float]]:
    return [out.embedding for out in llm.embed(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def smol(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=512, cpu_kv_cache_bytes=KV_BYTES)


def check_against_transformers(llm: LLM, model_dir, lengths: list[int]) -> None:
    prompts = prompts_of(lengths, llm.engine.runner.vocab_size)
    hidden = hf_hidden(model_dir, prompts)
    # One batch: the prompts share steps, of different lengths.
    for got, h in zip(vectors(llm, prompts, RAW_LAST), hidden):
        assert_close(got, h[-1])
    for got, h in zip(vectors(llm, prompts, RAW_MEAN), hidden):
        assert_close(got, h.mean(0))
    # The default: the last token's, L2-normalized.
    for got, h in zip(vectors(llm, prompts), hidden):
        assert_close(got, torch.nn.functional.normalize(h[-1], dim=0))
        assert abs(torch.tensor(got).norm().item() - 1.0) < 1e-5


def test_default_model_equals_transformers(smol, default_model_dir):
    check_against_transformers(smol, default_model_dir, [1, 5, 17, 40, 100])


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_tiny_architectures_equal_transformers(tiny_model_dir, arch):
    llm = LLM(str(tiny_model_dir(arch)), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES)
    check_against_transformers(llm, tiny_model_dir(arch), [1, 3, 16, 33, 70])


def test_chunked_prefill_and_prefix_cache_give_the_same_vector(smol, default_model_dir):
    prompts = prompts_of([90, 41], smol.engine.runner.vocab_size)
    chunked = LLM(
        str(default_model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=512,
        max_num_batched_tokens=16,  # 90 tokens: six chunks
        cpu_kv_cache_bytes=KV_BYTES,
    )
    for params in (RAW_LAST, RAW_MEAN):
        whole = vectors(smol, prompts, params)
        bm = chunked.engine.block_manager
        hits = bm.prefix_hit_tokens
        in_chunks = vectors(chunked, prompts, params)
        for a, b in zip(whole, in_chunks):
            assert_close(a, torch.tensor(b))
        # The same prompts again: last pooling starts after the cached blocks; mean pooling recomputes them.
        again = vectors(chunked, prompts, params)
        assert (bm.prefix_hit_tokens > hits + 80) == (params is RAW_LAST)
        for a, b in zip(in_chunks, again):
            assert_close(a, torch.tensor(b))


def test_embeddings_beside_generation_change_no_greedy_output(smol):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gen_prompts = prompts_of([9, 30, 4], smol.engine.runner.vocab_size)
    embed_prompts = prompts_of([25, 60, 2], smol.engine.runner.vocab_size)
    alone = [o.outputs[0].token_ids for o in smol.generate(gen_prompts, greedy, use_tqdm=False)]
    embedded_alone = vectors(smol, embed_prompts, RAW_MEAN)
    engine = smol.engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"gen-{i}", p, greedy)
    engine.step()  # the generating requests are decoding when the embedding requests arrive
    for i, p in enumerate(embed_prompts):
        engine.add_request(f"emb-{i}", p, RAW_MEAN)
    outs = {o.request_id: o for o in engine.step() if o.finished}
    # One step: the three decodes and the three embedding prompts, which finish in it.
    assert engine.last_step.num_batched_tokens == 3 + sum(map(len, embed_prompts))
    assert sorted(outs) == ["emb-0", "emb-1", "emb-2"]
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert [outs[f"gen-{i}"].outputs[0].token_ids for i in range(3)] == alone
    for i, want in enumerate(embedded_alone):
        out = outs[f"emb-{i}"]
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
        assert_close(out.embedding, torch.tensor(want))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_embedding_requests_give_the_same_vector(tiny_model_dir, mode, async_scheduling):
    model_dir = str(tiny_model_dir("qwen3"))
    prompts = prompts_of([60, 45, 50], 512)
    reference = LLM(model_dir, dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES)
    cases = [
        (f"{i}-{kind}", p, params)
        for i, p in enumerate(prompts)
        for kind, params in (("last", RAW_LAST), ("mean", RAW_MEAN))
    ]
    want = {request_id: vectors(reference, [p], params)[0] for request_id, p, params in cases}
    # 8 blocks of 16 tokens, which the two generating requests fill as they grow: the embedding requests,
    # which arrived later and take several steps of 16 tokens, are preempted mid-prompt.
    tight = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        num_gpu_blocks_override=8,
        max_model_len=128,
        max_num_batched_tokens=16,
        preemption_mode=mode,
        swap_space=0.01,
        async_scheduling=async_scheduling,
    )
    engine = tight.engine
    for i in range(2):
        engine.add_request(f"gen-{i}", [i + 1] * 20, SamplingParams(max_tokens=60, ignore_eos=True))
    for request_id, p, params in cases:
        engine.add_request(request_id, p, params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.scheduler.num_preemptions[mode] > 0
    for request_id, vector in want.items():
        assert_close(outs[request_id].embedding, torch.tensor(vector))
    assert not engine.runner.pooler.sums


def test_an_aborted_embedding_request_frees_its_blocks_and_its_sum(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=16,
        cpu_kv_cache_bytes=KV_BYTES,
    )
    engine = llm.engine
    engine.add_request("long", list(range(1, 100)), RAW_MEAN)
    engine.step()
    assert engine.runner.pooler.sums  # a running sum after the first chunk
    engine.abort_request("long")
    assert not engine.runner.pooler.sums and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_embedding_prompts_are_validated(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")), dtype="float32", device="cpu", max_model_len=64, cpu_kv_cache_bytes=KV_BYTES
    )
    for bad in ([], [1, 2, 10**6], [1] * 65):
        with pytest.raises(InvalidParameter) as err:
            llm.embed([bad], use_tqdm=False)
        assert err.value.param == "prompt"
    # Nothing is generated, so a prompt may fill the whole context.
    assert len(llm.embed([[1] * 64], use_tqdm=False)[0].embedding) == llm.engine.hidden_size
    with pytest.raises(InvalidParameter) as err:
        PoolingParams(pooling_type="max")
    assert err.value.param == "pooling_type"
