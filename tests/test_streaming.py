"""server/streaming.py and the stream chunks of server/render.py, on a real AsyncEngine (the default
model on the CPU, so tokens have text) and Starlette's Request driven by ASGI messages, as uvicorn does."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.sequence import CompletionOutput, RequestOutput
from server.metrics import Metrics
from server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
)
from server.render import ChatChunker, CompletionChunker, Job
from server.streaming import Admission, Generation, engine_requests, sse_events
from tests.conftest import KV_BYTES

TEXTS = ["", "plain", ' "quoted" \\ back', "new\nline\ttab\r\x00\x01\x1f\x7f", "é 漢字 🦀", "\u2028\u2029", "</script>"]
PROMPT = [504, 3575, 282, 4649, 314]  # "The capital of France is"


def started_engine(default_model_dir):
    engine = AsyncEngine(
        EngineConfig(
            model=str(default_model_dir), dtype="float32", device="cpu", max_model_len=512, cpu_kv_cache_bytes=KV_BYTES
        )
    )
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def async_engine(default_model_dir):
    """One engine for the module's tests: each leaves it idle with every block free."""
    yield from started_engine(default_model_dir)


@pytest.fixture
def own_async_engine(default_model_dir):
    """A fresh engine, for a test that shuts it down."""
    yield from started_engine(default_model_dir)


class Client:
    """The ASGI side of one HTTP request: the body is read; `leave()` sends the disconnect."""

    def __init__(self):
        self.gone = asyncio.Event()
        self.request = Request(
            {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, self._receive
        )

    async def _receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def leave(self):
        self.gone.set()


def make(engine: AsyncEngine, client: Client, max_tokens: int, prompts: int = 1) -> tuple[Generation, Job, Metrics]:
    metrics = Metrics("m", 64, 256)
    job = Job("cmpl-1", 1, "m", [PROMPT] * prompts, 1, False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = engine_requests(engine, job.id, job.prompts, params, 0)
    generation = Generation(client.request, engine, requests, Admission(None), metrics)
    return generation, job, metrics


async def wait_ready(generation: Generation, count: int) -> None:
    """Until `count` outputs wait unread (the reader has fallen behind the engine)."""
    while len(generation._ready) < count:
        await asyncio.sleep(0.01)


def events(writes: list[str]) -> list[dict | str]:
    return [json.loads(e[6:]) if e != "data: [DONE]" else e for w in writes for e in w.split("\n\n") if e]


def test_outputs_queued_together_are_one_write_with_every_token_once_in_order(async_engine, default_model_dir):
    async def main():
        client = Client()
        generation, job, _ = make(async_engine, client, 12)
        await wait_ready(generation, 3)
        stream = sse_events(generation, CompletionChunker(job, async_engine.tokenizer), True, lambda exc: None)
        return [w async for w in stream]

    writes = asyncio.run(main())
    assert writes[0].count("data: ") >= 3  # the outputs that waited: one write, one event each
    got = events(writes)
    assert got[-1] == "data: [DONE]"
    deltas = [e for e in got[:-1] if e["choices"]]
    ref = (
        LLM(str(default_model_dir), dtype="float32", device="cpu", max_model_len=512, cpu_kv_cache_bytes=KV_BYTES)
        .generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
    )
    assert "".join(e["choices"][0]["text"] for e in deltas) == ref.text
    assert [e["choices"][0]["finish_reason"] for e in deltas][-1] == "length"
    assert got[-2]["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


def test_outputs_of_several_prompts_are_all_read_each_in_order(async_engine):
    async def main():
        generation, _, _ = make(async_engine, Client(), 6, prompts=3)
        return [item async for item in generation.outputs()]

    items = asyncio.run(main())
    for i in range(3):
        lengths = [len(out.outputs[0].token_ids) for j, out in items if j == i]
        assert lengths == list(range(1, 7))  # every token once, in order, the last one finished
        assert [out.finished for j, out in items if j == i] == [False] * 5 + [True]


def test_disconnect_aborts_the_unfinished_request_and_ends_the_stream(async_engine):
    async def main():
        client = Client()
        generation, job, metrics = make(async_engine, client, 200)
        stream = sse_events(generation, CompletionChunker(job, async_engine.tokenizer), True, lambda exc: None)
        first = await anext(stream)
        client.leave()
        rest = [w async for w in stream]
        for _ in range(200):  # the abort reaches the engine thread
            if not async_engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return first, rest, metrics

    first, rest, metrics = asyncio.run(main())
    assert first.startswith("data: ")
    assert rest == []  # nobody listens: no usage, no [DONE]
    assert not async_engine.engine.has_unfinished_requests()
    assert async_engine.engine.block_manager.num_free_blocks == async_engine.engine.block_manager.num_blocks
    aborted = metrics.registry.get_sample_value(
        "pagoda:request_success_total", {"model_name": "m", "finished_reason": "abort"}
    )
    assert aborted == 1


def test_an_engine_that_stops_is_told_after_the_outputs_before_it(own_async_engine):
    async_engine = own_async_engine

    async def main():
        generation, _, _ = make(async_engine, Client(), 200)
        await wait_ready(generation, 2)
        await asyncio.to_thread(async_engine.shutdown)
        seen = []
        with pytest.raises(EngineDeadError):
            async for batch in generation.batches():
                seen.append(batch)
        return seen

    seen = asyncio.run(main())
    lengths = [len(out.outputs[0].token_ids) for batch in seen for _, out in batch]
    assert len(lengths) >= 2 and lengths == list(range(1, len(lengths) + 1))


def output(request_id: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    choice = CompletionOutput(0, text, list(tokens), "length" if finished else None)
    return RequestOutput(request_id, None, [7, 8, 9], [choice], finished)


@pytest.mark.parametrize("text", TEXTS)
def test_templated_chunks_are_the_bytes_pydantic_writes(text):
    job = Job("cmpl-abc", 123, 'model "x" \\ é', [[1]], 2, False)
    completion = CompletionChunker(job, None)
    completion.last[0] = output("r", [1])
    out = RequestOutput("r", None, [1], [CompletionOutput(1, text, [5], None)], False)
    expected = Completion(
        id=job.id,
        created=job.created,
        model=job.model,
        choices=[CompletionChoice(index=1, text=text, logprobs=None, finish_reason=None)],
    )
    assert completion.update(0, out) == ([expected.model_dump_json()] if text else [])

    chat = ChatChunker(job, None)
    expected = ChatCompletionChunk(
        id=job.id,
        created=job.created,
        model=job.model,
        choices=[ChatChunkChoice(index=1, delta=Delta(content=text), logprobs=None)],
    )
    assert chat.update(0, out) == ([expected.model_dump_json()] if text else [])


def test_admission_counts_sequences_not_requests(async_engine):
    async def main():
        admission = Admission(10)
        params = SamplingParams(n=3, temperature=1.0, max_tokens=2, ignore_eos=True)
        requests = engine_requests(async_engine, "adm", [PROMPT] * 2, params, 0)
        generation = Generation(Client().request, async_engine, requests, admission, Metrics("m", 64, 256))
        queued, fits = admission.queued, (admission.fits(4), admission.fits(5))
        _ = [item async for item in generation.outputs()]
        return queued, fits, admission.queued

    assert asyncio.run(main()) == (6, (True, False), 0)
