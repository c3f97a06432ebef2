"""AsyncEngine: the background loop streams outputs, aborts free blocks, errors reach the caller."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, EngineConfig, InvalidParameter, SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError
from tests.conftest import KV_BYTES


def started_engine(tiny_model_dir):
    engine = AsyncEngine(
        EngineConfig(model=str(tiny_model_dir("llama")), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES)
    )
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def async_engine(tiny_model_dir):
    """One engine for the module's tests: each leaves it idle with every block free."""
    yield from started_engine(tiny_model_dir)


@pytest.fixture
def own_async_engine(tiny_model_dir):
    """A fresh engine, for a test that shuts it down."""
    yield from started_engine(tiny_model_dir)


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams):
    outs = [out async for out in engine.generate(request_id, prompt, params)]
    return outs


def test_concurrent_streams_equal_offline_greedy(async_engine, tiny_model_dir):
    prompts = [list(range(1, 1 + n)) for n in (4, 30, 11, 60)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(async_engine, f"r{i}", p, params) for i, p in enumerate(prompts)))

    streams = asyncio.run(main())
    offline = LLM(str(tiny_model_dir("llama")), dtype="float32", device="cpu", cpu_kv_cache_bytes=KV_BYTES).generate(
        prompts, params, use_tqdm=False
    )
    for outs, ref in zip(streams, offline):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths) and len(outs) == 20  # one output per token, growing
        assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids


def test_leaving_a_stream_aborts_and_frees_blocks(async_engine):
    engine = async_engine.engine

    async def main():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        async for out in async_engine.generate("leaver", list(range(1, 50)), params):
            if len(out.outputs[0].token_ids) >= 3:
                break
        for _ in range(200):  # the abort is applied by the loop thread
            if engine.block_manager.num_free_blocks == engine.block_manager.num_blocks:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
    assert not engine.has_unfinished_requests()


def test_invalid_request_raises_before_queueing(async_engine):
    async def main():
        with pytest.raises(InvalidParameter) as err:
            await collect(async_engine, "bad", [1] * 10_000, SamplingParams())
        return err.value.param

    assert asyncio.run(main()) == "prompt"
    assert async_engine.is_alive


def test_shutdown_ends_in_flight_streams_with_an_error(own_async_engine):
    async_engine = own_async_engine

    async def main():
        stream = async_engine.generate("long", list(range(1, 10)), SamplingParams(max_tokens=200, ignore_eos=True))
        first = await stream.__anext__()
        assert not first.finished
        await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await collect(async_engine, "late", [1, 2], SamplingParams(max_tokens=2))

    asyncio.run(main())
    assert not async_engine.is_alive
