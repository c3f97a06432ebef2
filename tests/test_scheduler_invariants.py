"""Block manager and scheduler invariants under random workloads (property-based, real tiny model)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, PoolingParams, SamplingParams
from engine.block_manager import BlockManager
from engine.sequence import Request, Sequence, SequenceStatus


def check_invariants(engine: LLMEngine) -> None:
    bm = engine.block_manager
    live = [s for r in engine.requests.values() for s in r.seqs if not s.is_finished]
    holders = Counter(b for s in live for b in s.block_table)
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] == holders[block], f"block {block}: ref count disagrees with the tables"
    free = list(bm.free_blocks)
    assert len(free) == len(set(free)), "a block is on the free list twice"
    assert set(free) == {b for b in range(bm.num_blocks) if bm.ref_counts[b] == 0}
    # The prefix cache: names and blocks correspond one to one; free named blocks stay findable.
    assert {b for b in range(bm.num_blocks) if bm.block_names[b] is not None} == set(bm.cache.values())
    assert all(bm.block_names[b] == name for name, b in bm.cache.items())
    assert all(bm.block_names[b] is not None for b in bm.cached_free)
    assert all(bm.block_names[b] is None for b in bm.empty_blocks)
    for s in live:
        held = s.swapped_blocks if s.status is SequenceStatus.SWAPPED else s.block_table
        assert len(held) * bm.block_size >= s.num_computed_tokens
        if s.status is SequenceStatus.WAITING:
            assert s.block_table == [] and s.num_computed_tokens == 0
        if s.status is SequenceStatus.SWAPPED:
            assert s.block_table == []
    # Running sums of mean pooling belong to live sequences only.
    assert set(engine.runner.pooler.sums) <= {s.seq_id for s in live}
    sched = engine.scheduler
    assert len(sched.running) <= sched.max_num_seqs
    queues = [sched.running, sched.waiting, sched.swapped]
    assert sorted(s.seq_id for q in queues for s in q) == sorted(s.seq_id for s in live)
    if sched.swap_pool is not None:
        held = [b for s in sched.swapped for b in s.swapped_blocks]
        assert len(held) == len(set(held)) and not set(held) & set(sched.swap_pool.free)
        assert len(held) + sched.swap_pool.num_free_blocks == sched.swap_pool.num_blocks


@pytest.fixture(scope="module")
def engine_factory(tiny_model_dir):
    model_dir = str(tiny_model_dir("llama"))

    def make(
        num_blocks: int,
        max_num_seqs: int,
        budget: int,
        chunked: bool,
        prefix_caching: bool,
        swap: bool = False,
        async_scheduling: bool = False,
    ) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=model_dir,
                dtype="float32",
                device="cpu",
                num_gpu_blocks_override=num_blocks,
                block_size=4,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=64,
                enable_chunked_prefill=chunked,
                enable_prefix_caching=prefix_caching,
                preemption_mode="swap" if swap else "recompute",
                swap_space=0.0005,
                async_scheduling=async_scheduling,
            )
        )

    return make


request_strategy = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 40),
        "family": st.integers(0, 2),  # requests of a family share their leading tokens (prefix-cache hits)
        "max_tokens": st.integers(1, 20),
        "n": st.integers(1, 3),
        "priority": st.integers(0, 2),
        "abort_at": st.one_of(st.none(), st.integers(0, 30)),
        "arrive_at": st.integers(0, 10),
        "temperature": st.sampled_from([0.0, 1.0]),
        "pooling": st.sampled_from([None, None, "last", "mean"]),  # an embedding request, or a generating one
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=12),
    num_blocks=st.integers(16, 40),
    max_num_seqs=st.integers(1, 8),
    budget=st.sampled_from([8, 16, 64]),
    chunked=st.booleans(),
    prefix_caching=st.booleans(),
    swap=st.booleans(),
    async_scheduling=st.booleans(),
)
def test_random_workloads_finish_and_free_everything(
    engine_factory, requests, num_blocks, max_num_seqs, budget, chunked, prefix_caching, swap, async_scheduling
):
    engine = engine_factory(
        num_blocks, max_num_seqs, 64 if not chunked else budget, chunked, prefix_caching, swap, async_scheduling
    )
    finished: dict[str, object] = {}
    step = 0
    pending = sorted(enumerate(requests), key=lambda x: x[1]["arrive_at"])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1]["arrive_at"] <= step:
            i, r = pending.pop(0)
            params = SamplingParams(
                n=min(r["n"], max_num_seqs),
                max_tokens=min(r["max_tokens"], 63 - r["prompt_len"]),
                temperature=r["temperature"],
                ignore_eos=True,
                seed=i,
            )
            if r["pooling"] is not None:
                params = PoolingParams(pooling_type=r["pooling"])
            engine.add_request(
                f"r{i}",
                [(r["family"] * 7 + j) % 500 + 1 for j in range(r["prompt_len"])],
                params,
                priority=r["priority"],
            )
        for i, r in enumerate(requests):
            if r["abort_at"] == step and f"r{i}" in engine.requests:
                engine.abort_request(f"r{i}")
                finished[f"r{i}"] = "aborted"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        check_invariants(engine)
        step += 1
        assert step < 2000, "the workload did not finish"
    assert len(finished) == len(requests)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_counts)
    for i, r in enumerate(requests):
        out = finished[f"r{i}"]
        if out == "aborted":
            continue
        if r["pooling"] is not None:
            assert len(out.embedding) == engine.hidden_size and out.outputs[0].finish_reason == "stop"
            continue
        assert len(out.outputs) == min(r["n"], max_num_seqs)
        for o in out.outputs:
            assert len(o.token_ids) == min(r["max_tokens"], 63 - r["prompt_len"])
            assert o.finish_reason == "length"


def _seq(seq_id: int, prompt_len: int) -> Sequence:
    request = Request(f"r{seq_id}", None, list(range(prompt_len)), SamplingParams())
    return Sequence(seq_id, request, 0, 0, list(range(prompt_len)))


def test_copy_on_write_gives_a_private_block_before_a_shared_one_is_written():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = _seq(0, 6), _seq(1, 6)
    bm.allocate(parent, 6)
    parent.num_computed_tokens = 6
    bm.fork(parent, child)
    child.num_computed_tokens = 6
    assert bm.ref_counts[parent.block_table[1]] == 2
    copies = bm.allocate(child, 1)  # the child's 7th token lands in the shared, half-full block
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert bm.ref_counts[parent.block_table[1]] == 1 and bm.ref_counts[child.block_table[1]] == 1
    assert bm.allocate(parent, 1) == []  # the parent now owns its block alone: written in place
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_freeing_twice_is_caught():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(0, 4)
    bm.allocate(seq, 4)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(AssertionError):
        bm.free(seq)


@pytest.mark.slow  # a soak: 3 x 1000 requests through a tiny pool
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_a_thousand_requests_with_aborts_priorities_and_a_tiny_pool(engine_factory, seed):
    rng = random.Random(seed)
    engine = engine_factory(24, 16, 48, True, True, swap=seed % 2 == 0, async_scheduling=seed % 3 != 0)
    live: list[str] = []
    done = 0
    for i in range(1000):
        params = SamplingParams(
            n=rng.choice([1, 1, 1, 2]),
            max_tokens=rng.randint(1, 8),
            ignore_eos=True,
            temperature=rng.choice([0.0, 1.0]),
            seed=i,
        )
        family = rng.randint(0, 4)
        prompt = [(family * 11 + j) % 500 + 1 for j in range(rng.randint(1, 30))]
        engine.add_request(f"q{i}", prompt, params, priority=rng.randint(0, 3))
        live.append(f"q{i}")
        if rng.random() < 0.1:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        if i % 4 == 0:
            done += sum(o.finished for o in engine.step())
            check_invariants(engine)
    while engine.has_unfinished_requests():
        engine.step()
        check_invariants(engine)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.scheduler.swapped
