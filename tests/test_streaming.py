"""server/streaming.py and the stream chunks of server/render.py, without a model: a fake engine
hands outputs to a Generation the way AsyncEngine does, several at once when the reader is behind."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.sampling_params import SamplingParams
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
from server.streaming import Admission, Generation, sse_events

TEXTS = ["", "plain", ' "quoted" \\ back', "new\nline\ttab\r\x00\x01\x1f\x7f", "é 漢字 🦀", "\u2028\u2029", "</script>"]


class FakeEngine:
    """AsyncEngine's add/abort; the test delivers the outputs itself through the sinks."""

    def __init__(self):
        self.sinks = {}
        self.aborted: list[str] = []

    def add(self, request_id, prompt, params, sink, priority=0, queue_timeout=None):
        self.sinks[request_id] = sink

    def abort(self, request_id):
        self.aborted.append(request_id)


class FakeRequest:
    """The HTTP request: receive() blocks until the test disconnects the client."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}


def output(request_id: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    text = "".join(f"<{t}>" for t in tokens)
    choice = CompletionOutput(0, text, list(tokens), "length" if finished else None)
    return RequestOutput(request_id, None, [7, 8, 9], [choice], finished)


def make(engine: FakeEngine, request: FakeRequest, prompts: int = 1) -> tuple[Generation, Job, Metrics]:
    metrics = Metrics("m", 64)
    job = Job("cmpl-1", 1, "m", [[7, 8, 9]] * prompts, 1, False)
    generation = Generation(request, engine, job.id, job.prompts, SamplingParams(max_tokens=4), 0,
                            Admission(None), metrics)
    return generation, job, metrics


def events(writes: list[str]) -> list[dict | str]:
    return [json.loads(e[6:]) if e != "data: [DONE]" else e for w in writes for e in w.split("\n\n") if e]


def test_outputs_queued_together_are_one_write_with_every_token_once_in_order():
    async def main():
        engine, request = FakeEngine(), FakeRequest()
        generation, job, _ = make(engine, request)
        sink = engine.sinks["cmpl-1"]
        # Three steps' outputs arrive before the reader first runs, then the last one on its own.
        for n in (1, 2, 3):
            sink.loop.call_soon(sink.put, output("cmpl-1", list(range(1, n + 1))))
        writes = []
        stream = sse_events(generation, CompletionChunker(job, None), True, lambda exc: None)
        writes.append(await anext(stream))
        sink.put(output("cmpl-1", [1, 2, 3, 4], finished=True))
        writes += [w async for w in stream]
        return writes, engine

    writes, engine = asyncio.run(main())
    assert writes[0].count("data: ") == 3  # one write, three events
    got = events(writes)
    assert got[-1] == "data: [DONE]"
    assert [e["choices"][0]["text"] for e in got[:4]] == ["<1>", "<2>", "<3>", "<4>"]
    assert [e["choices"][0]["finish_reason"] for e in got[:4]] == [None, None, None, "length"]
    assert got[4]["choices"] == [] and got[4]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                             "total_tokens": 7}
    assert engine.aborted == []  # it finished: nothing to abort


def test_outputs_of_several_prompts_keep_their_order_and_all_are_read():
    async def main():
        engine, request = FakeEngine(), FakeRequest()
        generation, _, _ = make(engine, request, prompts=2)
        for n in (1, 2):
            for i in (0, 1):
                engine.sinks[f"cmpl-1-{i}"].put(output(f"cmpl-1-{i}", list(range(1, n + 1)), finished=n == 2))
        return [item async for item in generation.outputs()]

    items = asyncio.run(main())
    assert [(i, len(out.outputs[0].token_ids)) for i, out in items] == [(0, 1), (1, 1), (0, 2), (1, 2)]


def test_disconnect_aborts_unfinished_requests_and_ends_the_stream():
    async def main():
        engine, request = FakeEngine(), FakeRequest()
        generation, job, metrics = make(engine, request, prompts=2)
        engine.sinks["cmpl-1-0"].put(output("cmpl-1-0", [1, 2], finished=True))
        engine.sinks["cmpl-1-1"].put(output("cmpl-1-1", [1]))
        stream = sse_events(generation, CompletionChunker(job, None), True, lambda exc: None)
        first = await anext(stream)
        request.gone.set()
        rest = [w async for w in stream]
        return first, rest, engine, metrics

    first, rest, engine, metrics = asyncio.run(main())
    assert first.count("data: ") == 2  # prompt 0's whole text with its finish reason, prompt 1's first token
    assert rest == []  # nobody listens: no usage, no [DONE]
    assert engine.aborted == ["cmpl-1-1"]
    aborted = metrics.registry.get_sample_value("pagoda:request_success_total",
                                                {"model_name": "m", "finished_reason": "abort"})
    assert aborted == 1


def test_reader_gone_with_error_raises_in_order():
    async def main():
        engine, request = FakeEngine(), FakeRequest()
        generation, _, _ = make(engine, request)
        sink = engine.sinks["cmpl-1"]
        sink.put(output("cmpl-1", [1]))
        sink.put(RuntimeError("engine died"))
        seen = []
        with pytest.raises(RuntimeError, match="engine died"):
            async for batch in generation.batches():
                seen.append(batch)
        return seen

    seen = asyncio.run(main())
    assert [[len(out.outputs[0].token_ids) for _, out in batch] for batch in seen] == [[1]]


@pytest.mark.parametrize("text", TEXTS)
def test_templated_chunks_are_the_bytes_pydantic_writes(text):
    job = Job("cmpl-abc", 123, 'model "x" \\ é', [[1]], 2, False)
    completion = CompletionChunker(job, None)
    completion.last[0] = output("r", [1])
    out = RequestOutput("r", None, [1], [CompletionOutput(1, text, [5], None)], False)
    expected = Completion(id=job.id, created=job.created, model=job.model,
                          choices=[CompletionChoice(index=1, text=text, logprobs=None, finish_reason=None)])
    assert completion.update(0, out) == ([expected.model_dump_json()] if text else [])

    chat = ChatChunker(job, None)
    expected = ChatCompletionChunk(id=job.id, created=job.created, model=job.model,
                                   choices=[ChatChunkChoice(index=1, delta=Delta(content=text), logprobs=None)])
    assert chat.update(0, out) == ([expected.model_dump_json()] if text else [])
