"""Prefix caching: identical outputs with it on and off, hits counted, LRU eviction, chained names."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.sequence import Request, Sequence
from tests.conftest import KV_BYTES


def shared_prefix_prompts(seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(1, 500, (37,), generator=gen).tolist()  # 2 full blocks + 5 tokens
    prompts = [system + torch.randint(1, 500, (n,), generator=gen).tolist() for n in (1, 9, 20, 40)]
    return prompts + [system[:32], system[:33], prompts[2]]  # block-aligned, one past, exact repeat


def run(model_dir: str, prompts, params, **kwargs) -> tuple[list, LLM]:
    llm = LLM(model_dir, dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES, **kwargs)
    outs = []
    for p, sp in zip(prompts, params):  # one after another, so later ones can hit earlier ones' blocks
        outs.append(llm.generate([p], sp, use_tqdm=False)[0])
    outs += llm.generate(prompts, params, use_tqdm=False)  # and all at once
    return [[c.token_ids for c in o.outputs] for o in outs], llm


def test_outputs_equal_with_and_without_prefix_caching(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))
    prompts = shared_prefix_prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 4 + [
        SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    ]
    cached, llm = run(model_dir, prompts, params)
    plain, _ = run(model_dir, prompts, params, enable_prefix_caching=False)
    assert cached == plain
    bm = llm.engine.block_manager
    assert bm.prefix_hit_tokens >= 32 * 10, "the shared 2-block prefix should have been reused"
    assert bm.num_free_blocks == bm.num_blocks
    # With a pool so small that cached blocks are evicted and requests preempted, still the same.
    tiny_pool, small = run(model_dir, prompts, params, num_gpu_blocks_override=14, max_model_len=104, block_size=8)
    assert tiny_pool == plain
    assert small.engine.scheduler.num_preemptions["recompute"] > 0


def test_default_model_outputs_equal_with_and_without_prefix_caching(default_model_dir):
    llm = LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=512, cpu_kv_cache_bytes=KV_BYTES)
    tok = llm.tokenizer
    system = (
        "You are a terse assistant who answers in one short sentence. Never use lists, never use "
        "headings, never apologise, and never repeat the question back to the user."
    )
    prompts = [
        tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
        for q in ("What is the capital of France?", "Name a large ocean.", "What color is grass?")
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    cached = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    common = next(i for i, (a, b, c) in enumerate(zip(*prompts)) if not a == b == c)
    assert common >= 32
    assert llm.engine.block_manager.prefix_hit_tokens == 2 * (common // 16) * 16
    plain_llm = LLM(
        str(default_model_dir),
        dtype="float32",
        device="cpu",
        max_model_len=512,
        enable_prefix_caching=False,
        cpu_kv_cache_bytes=KV_BYTES,
    )
    plain = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, params, use_tqdm=False)]
    assert cached == plain


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    request = Request(f"r{seq_id}", None, tokens, SamplingParams())
    return Sequence(seq_id, request, 0, 0, list(tokens))


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """What a step does to the pool: allocate the rest of the sequence and name its full blocks."""
    num_new = len(seq.token_ids) - seq.num_computed_tokens
    bm.allocate(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.name_full_blocks(seq, seq.num_computed_tokens, num_new)


def test_hits_need_the_whole_chain_not_just_the_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.take_cached_prefix(a)
    _compute(bm, a)
    same_second_block = _seq(1, [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert bm.take_cached_prefix(same_second_block) == 0  # block 2 matches only after block 1 does
    repeat = _seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.take_cached_prefix(repeat) == 8
    assert repeat.block_table == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    exact_blocks = _seq(3, [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.take_cached_prefix(exact_blocks) == 4  # the last token is always computed


def test_freed_blocks_stay_cached_until_evicted_least_recent_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    first = _seq(0, [1, 2, 3, 4, 5])
    bm.take_cached_prefix(first)
    _compute(bm, first)  # 3 blocks, 2 named
    bm.free(first)
    assert bm.num_free_blocks == 4 and len(bm.cache) == 2
    other = _seq(1, [7, 7, 7, 7, 7])
    bm.take_cached_prefix(other)
    _compute(bm, other)  # needs 3 blocks: the empty one, then evicts [3, 4] (the tail) before [1, 2]
    assert len(bm.cache) == 1 + 2
    again = _seq(2, [1, 2, 3, 4, 5])
    assert bm.take_cached_prefix(again) == 2


def test_simultaneous_requests_compute_a_shared_prefix_once(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir("llama")),
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=512,
        cpu_kv_cache_bytes=KV_BYTES,
    )
    engine = llm.engine
    system = list(range(1, 49))  # 3 full blocks
    prompts = [system + [100 + i, 200 + i, 300 + i] for i in range(8)]
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    computed = 0
    while engine.has_unfinished_requests():
        engine.step()
        computed += engine.last_step.num_prefill_tokens
    assert computed == 48 + 8 * 3, "the shared 48 tokens should be computed by one request only"
    assert engine.block_manager.prefix_hit_tokens == 7 * 48
