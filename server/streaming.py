"""Running one HTTP request's engine requests, and streaming their chunks as Server-Sent Events."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel
from starlette.requests import Request

from engine.async_engine import AsyncEngine, RequestFailed
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sequence import Request as EngineRequest
from engine.sequence import RequestOutput
from server.metrics import Metrics, RequestTracker

if TYPE_CHECKING:  # imported only when tracing is on
    from server.tracing import RequestTracer

log = logging.getLogger("pagoda.server")

_END = object()  # every engine request has ended
_DISCONNECTED = object()
# Numbers the HTTP requests this process has handed to the engine: the last part of every engine request id.
_serials = itertools.count()


class ClientDisconnected(Exception):
    """The client went away before its response was complete; its engine requests were aborted."""


class QueueTimeout(Exception):
    """A request waited longer than the engine's queue timeout without being scheduled."""


class ServerStopping(Exception):
    """The server is shutting down and its drain time is up: the request was cut off."""


@dataclass
class Admission:
    """Sequences handed to the engine that have no token yet (queued or in prefill), and their bound.

    Sequences, not HTTP requests: one request of many prompts, or with a large n, queues as much work as
    that many requests."""

    limit: int | None
    queued: int = 0

    def fits(self, sequences: int) -> bool:
        """Whether `sequences` more may queue now."""
        return self.limit is None or self.queued + sequences <= self.limit


def engine_requests(
    engine: AsyncEngine,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams | PoolingParams,
    priority: int,
) -> list[EngineRequest]:
    """The engine requests of one HTTP request, one per prompt, each validated (the only check it gets) and
    none queued: an InvalidParameter for any prompt leaves no other prompt running.

    Their ids are `request_id` (the client's X-Request-Id, which two requests may share), the prompt's index
    when there are several, and this process's serial number of the HTTP request, always last: the serial
    alone tells two HTTP requests apart, the index two prompts of one, so no two engine ids are equal."""
    serial = next(_serials)
    return [
        engine.new_request(
            f"{request_id}-{serial}" if len(prompts) == 1 else f"{request_id}-{i}-{serial}", prompt, params, priority
        )
        for i, prompt in enumerate(prompts)
    ]


class _Prompt:
    """One engine request of a Generation, and the sink its outputs arrive at (on the event loop)."""

    def __init__(self, generation: Generation, index: int, request: EngineRequest, tracker: RequestTracker):
        self.generation = generation
        self.loop = generation.loop
        self.index = index
        self.engine_id = request.request_id
        self.params = request.params
        self.arrival = request.arrival_time
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.tracker = tracker
        self.last: RequestOutput | None = None  # the latest output, for the request's log line
        self.sequences = request.params.n  # counted in Admission until its first output (or its end)
        self.queued = True
        self.done = False  # no more outputs will come, or none are wanted

    def put(self, item: RequestOutput | BaseException | None) -> None:
        self.generation._arrive(self, item)


class Generation:
    """The engine requests of one HTTP request, one per prompt, all queued from the start.

    The engine hands their outputs straight to this object on the event loop (no task per prompt):
    metrics and the admission count are updated as they arrive, whether or not anyone is reading
    them (a stream's writer may be blocked or gone), and they wait in one deque that the reader
    drains whole. If the client disconnects, every unfinished engine request is aborted at once,
    which frees its KV blocks.
    """

    def __init__(
        self,
        http_request: Request,
        engine: AsyncEngine,
        requests: list[EngineRequest],
        admission: Admission,
        metrics: Metrics,
        tracer: RequestTracer | None = None,
        log_requests: bool = False,
    ):
        """Queue `requests` (from engine_requests(), in prompt order) and follow their outputs; `tracer`
        records a span of each that finishes; with `log_requests`, a line for each is logged as it ends."""
        self.loop = asyncio.get_running_loop()
        self._http_request = http_request
        self._tracer = tracer
        self._engine = engine
        self._admission = admission
        self._log_requests = log_requests
        # (prompt index, RequestOutput | exception | _DISCONNECTED) in arrival order.
        self._ready: deque[tuple[int, object]] = deque()
        self._waiter: asyncio.Future | None = None
        self._prompts = [
            _Prompt(self, i, request, RequestTracker(metrics, request.params.n)) for i, request in enumerate(requests)
        ]
        self._remaining = len(requests)
        admission.queued += sum(prompt.sequences for prompt in self._prompts)
        self._watcher = asyncio.create_task(self._watch(http_request))
        for prompt, request in zip(self._prompts, requests, strict=True):
            try:
                engine.submit(request, prompt)
            except Exception as exc:  # noqa: BLE001 -- told in order, like any error of that request (the engine died)
                self._arrive(prompt, exc)

    @property
    def running(self) -> bool:
        """Whether some engine request of it has not ended."""
        return self._remaining > 0

    def _arrive(self, prompt: _Prompt, item: RequestOutput | BaseException | None) -> None:
        if prompt.done:  # e.g. the None of an abort we asked for
            return
        if isinstance(item, RequestOutput):
            if item.finished and all(c.finish_reason == "timeout" for c in item.outputs):
                # Not a result to show (no token was made), but a refusal: the client should retry.
                item = QueueTimeout("the request waited too long to be scheduled; the server is overloaded")
            else:
                self._dequeue(prompt)
                prompt.tracker.on_output(item)
                prompt.last = item
                self._push(prompt.index, item)
                if item.finished:
                    if self._tracer is not None:
                        self._tracer.record(item, prompt.params, self._http_request.headers)
                    reasons = dict.fromkeys(c.finish_reason or "abort" for c in item.outputs)
                    self._end(prompt, ",".join(reasons))
                return
        reason = "abort"
        if isinstance(item, QueueTimeout):
            reason = "timeout"
        elif isinstance(item, RequestFailed):
            reason = "error"
        if isinstance(item, BaseException):
            prompt.tracker.on_abort(reason)
            self._push(prompt.index, item)
        self._end(prompt, reason)

    def _push(self, index: int, item: object) -> None:
        self._ready.append((index, item))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _end(self, prompt: _Prompt, reason: str) -> None:
        self._dequeue(prompt)
        prompt.done = True
        self._log_end(prompt, reason)
        self._remaining -= 1
        if self._remaining == 0:
            self._watcher.cancel()
            self._push(-1, _END)  # wakes the reader, which may wait for nothing else

    def _dequeue(self, prompt: _Prompt) -> None:
        if prompt.queued:
            prompt.queued = False
            self._admission.queued -= prompt.sequences

    def _log_end(self, prompt: _Prompt, reason: str) -> None:
        """The request's one log line (unless request logging is off): what it asked and got, how fast."""
        if not self._log_requests:
            return
        out = prompt.last
        first_token = out.times.first_token if out is not None and out.times is not None else None
        finished = out.times.finished if out is not None and out.times is not None else None
        log.info(
            "request %s finished (%s): prompt %d tokens, generated %d tokens, TTFT %s, e2e %.3f s",
            prompt.engine_id,
            reason,
            prompt.num_prompt_tokens,
            sum(len(c.token_ids) for c in out.outputs) if out is not None else 0,
            "-" if first_token is None else f"{first_token - prompt.arrival:.3f} s",
            (finished if finished is not None else time.monotonic()) - prompt.arrival,
        )

    async def _watch(self, http_request: Request) -> None:
        # The body has been read, so the next message the server has for us is the disconnect.
        while (await http_request.receive())["type"] != "http.disconnect":
            pass
        if self._remaining:
            unfinished = ", ".join(p.engine_id for p in self._prompts if not p.done)
            log.info("client disconnected: aborting request(s) %s", unfinished)
        self._push(-1, _DISCONNECTED)  # before cancel() ends the requests: the reader must not see a normal end
        self.cancel()

    def cancel(self) -> None:
        """Abort every engine request that has not ended (their unfinished choices count as aborted)."""
        for prompt in self._prompts:
            if not prompt.done:
                prompt.tracker.on_abort("abort")
                self._engine.abort(prompt.engine_id)
                self._end(prompt, "abort")
        self._watcher.cancel()

    def cut_off(self, error: Exception) -> None:
        """End every unfinished engine request with `error`, which the reader meets after the outputs that
        came before it, and abort it in the engine."""
        for prompt in self._prompts:
            if not prompt.done:
                self._arrive(prompt, error)
                self._engine.abort(prompt.engine_id)

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Every (prompt index, output) that has arrived since the last batch, in order, until all are
        finished: one wake-up per batch, however many outputs the engine delivered meanwhile. Raises
        ClientDisconnected, QueueTimeout or the engine's error (EngineDeadError) where it occurred."""
        try:
            while True:
                if not self._ready:
                    self._waiter = self.loop.create_future()
                    try:
                        await self._waiter
                    finally:
                        self._waiter = None
                batch = []
                while self._ready:
                    i, item = self._ready.popleft()
                    if isinstance(item, RequestOutput):
                        batch.append((i, item))
                        continue
                    if batch:  # what came before it is delivered first
                        self._ready.appendleft((i, item))
                        break
                    if item is _END:
                        return
                    if item is _DISCONNECTED:
                        raise ClientDisconnected()
                    raise item
                if batch:
                    yield batch
        finally:
            self.cancel()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, until all are finished; raises as batches() does."""
        async for batch in self.batches():
            for item in batch:
                yield item


class Chunker(Protocol):
    """Renders a stream's chunks as JSON bodies (see server/render.py)."""

    def start(self) -> list[str]: ...

    def update(self, prompt_index: int, out: RequestOutput) -> list[str]: ...

    def usage_chunk(self) -> str: ...


def sse(body: str) -> str:
    return f"data: {body}\n\n"


async def sse_events(
    generation: Generation, chunker: Chunker, include_usage: bool, error_body: Callable[[Exception], BaseModel]
) -> AsyncIterator[str]:
    """The whole event stream: opening chunks, deltas, the usage chunk if asked, then [DONE].

    The opening chunks (chat's assistant role, completions' echo) go out in one write with the first
    outputs, never before: clients time the first chunk as the time to the first token, as vLLM streams it.
    Outputs that arrived together (the reader fell a step behind) are written together: still one
    event per chunk, but one write, since each write costs the event loop more than its rendering.
    An error after the headers are sent can only be told in the stream: it becomes an error event.
    """
    try:
        opening = "".join(sse(chunk) for chunk in chunker.start())
        async for batch in generation.batches():
            events = "".join(sse(chunk) for prompt_index, out in batch for chunk in chunker.update(prompt_index, out))
            if opening + events:
                yield opening + events
            opening = ""
        if include_usage:
            yield sse(chunker.usage_chunk())
    except ClientDisconnected:
        return
    except Exception as exc:
        yield sse(error_body(exc).model_dump_json())
    finally:
        generation.cancel()
    yield "data: [DONE]\n\n"
