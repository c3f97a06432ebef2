"""Running one HTTP request's engine requests, and streaming their chunks as Server-Sent Events."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from pydantic import BaseModel
from starlette.requests import Request

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput
from server.metrics import Metrics, RequestTracker

log = logging.getLogger("pagoda.server")

_END = object()  # one engine request has no more outputs
_DISCONNECTED = object()


class ClientDisconnected(Exception):
    """The client went away before its response was complete; its engine requests were aborted."""


class QueueTimeout(Exception):
    """A request waited longer than the engine's queue timeout without being scheduled."""


@dataclass
class Admission:
    """Requests handed to the engine that have no token yet (queued or in prefill), and their bound."""

    limit: int | None
    queued: int = 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.queued >= self.limit


class Generation:
    """The engine requests of one HTTP request, one per prompt, running as tasks from the start.

    Their outputs arrive on one queue as (prompt index, RequestOutput). If the client disconnects,
    every task is cancelled at once, which aborts its engine request and frees its KV blocks,
    whether or not anyone is reading the outputs (a stream's writer may be blocked or gone).
    """

    def __init__(
        self,
        http_request: Request,
        engine: AsyncEngine,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        priority: int,
        admission: Admission,
        metrics: Metrics,
    ):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._admission = admission
        self._queued = [True] * len(prompts)
        self._tasks: list[asyncio.Task] = []
        for i, prompt in enumerate(prompts):
            engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            tracker = RequestTracker(metrics, params.n)
            admission.queued += 1
            task = asyncio.create_task(self._pump(i, engine.generate(engine_id, prompt, params, priority), tracker))
            # A done callback runs even for a task cancelled before it started, so nothing leaks.
            task.add_done_callback(partial(self._done, i, tracker))
            self._tasks.append(task)
        self._remaining = len(self._tasks)
        self._watcher = asyncio.create_task(self._watch(http_request))

    async def _pump(self, i: int, source: AsyncIterator[RequestOutput], tracker: RequestTracker) -> None:
        async for out in source:
            if out.finished and all(c.finish_reason == "timeout" for c in out.outputs):
                # Not a result to show (no token was made), but a refusal: the client should retry.
                raise QueueTimeout("the request waited too long to be scheduled; the server is overloaded")
            self._dequeue(i)
            tracker.on_output(out)
            self._queue.put_nowait((i, out))

    def _dequeue(self, i: int) -> None:
        if self._queued[i]:
            self._queued[i] = False
            self._admission.queued -= 1

    def _done(self, i: int, tracker: RequestTracker, task: asyncio.Task) -> None:
        self._dequeue(i)
        error = None if task.cancelled() else task.exception()
        if task.cancelled() or error is not None:
            tracker.on_abort("timeout" if isinstance(error, QueueTimeout) else "abort")
        self._queue.put_nowait((i, error or _END))
        self._remaining -= 1
        if self._remaining == 0:
            self._watcher.cancel()

    async def _watch(self, http_request: Request) -> None:
        # The body has been read, so the next message the server has for us is the disconnect.
        while (await http_request.receive())["type"] != "http.disconnect":
            pass
        if self._remaining:
            log.info("client disconnected: aborting %d request(s)", self._remaining)
        self.cancel()
        self._queue.put_nowait((-1, _DISCONNECTED))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._watcher.cancel()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they come, until all are finished. Raises ClientDisconnected,
        or the engine's error (EngineDeadError)."""
        remaining = len(self._tasks)
        try:
            while remaining:
                i, item = await self._queue.get()
                if item is _DISCONNECTED:
                    raise ClientDisconnected()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            self.cancel()


class Chunker(Protocol):
    def start(self) -> list[BaseModel]: ...

    def update(self, prompt_index: int, out: RequestOutput) -> list[BaseModel]: ...

    def usage_chunk(self) -> BaseModel: ...


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def sse_events(
    generation: Generation, chunker: Chunker, include_usage: bool, error_body: Callable[[Exception], BaseModel]
) -> AsyncIterator[str]:
    """The whole event stream: opening chunks, deltas, the usage chunk if asked, then [DONE].

    An error after the headers are sent can only be told in the stream: it becomes an error event.
    """
    try:
        for chunk in chunker.start():
            yield sse(chunk)
        async for prompt_index, out in generation.outputs():
            for chunk in chunker.update(prompt_index, out):
                yield sse(chunk)
        if include_usage:
            yield sse(chunker.usage_chunk())
    except ClientDisconnected:
        return
    except Exception as exc:
        yield sse(error_body(exc))
    finally:
        generation.cancel()
    yield "data: [DONE]\n\n"
