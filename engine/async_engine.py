"""AsyncEngine: runs LLMEngine.step() on a background thread and streams each request's outputs.

The engine loop owns the LLMEngine; callers on the asyncio side only put commands (add, abort)
on a thread-safe queue and read their request's asyncio.Queue. Outputs of one step are handed to
the event loop in a single call, so a step costs the event loop one wake-up, not one per request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, StepStats
from engine.sampling_params import SamplingParams
from engine.sequence import RequestOutput

log = logging.getLogger("pagoda.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a fatal error or shutdown); no request can be served."""


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    queue_timeout: float | None
    stream: "_Stream"


@dataclass
class _Abort:
    request_id: str


class _Stream:
    """The asyncio side of one request: outputs, then None at the end, or an exception."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self.finished = False


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # owned by the loop thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # set once by the loop thread as it exits, under _lock
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        # Called on the engine thread after every step (e.g. to update Prometheus metrics).
        self.on_step: Callable[[StepStats], None] | None = None

    # ----- life cycle -----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and not self._closed and self.error is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop: in-flight requests are aborted and their streams ended with EngineDeadError."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # ----- the asyncio side -----

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        priority: int = 0,
        queue_timeout: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request (prompt already tokenized) and yield its outputs until it finishes.

        Raises InvalidParameter before anything is queued if the request cannot be served.
        Leaving the iteration early (a client disconnect) aborts the request and frees its blocks.
        """
        self.engine.check_request(prompt, params)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:  # against the loop thread closing between the check and the put
            if not self.is_alive:
                raise EngineDeadError("the engine is not running")
            self._commands.put(_Add(request_id, prompt, params, priority, time.monotonic(), queue_timeout, stream))
        try:
            while True:
                item = await stream.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self._commands.put(_Abort(request_id))

    # ----- the engine thread -----

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                # Block only when idle; otherwise take whatever arrived since the last step.
                self._apply(self._commands.get() if not engine.has_unfinished_requests() else None)
                while True:
                    try:
                        self._apply(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if self._stopping:
                    break
                if not engine.has_unfinished_requests():
                    # An abort can leave the engine idle with no step to come: an empty step reports
                    # the state it left (blocks freed), so metrics do not show the last busy step forever.
                    engine.step()
                    if self.on_step is not None and engine.last_step is not None:
                        self.on_step(engine.last_step)
                    continue
                outputs = engine.step()
                self._publish(outputs)
                if self.on_step is not None and engine.last_step is not None:
                    self.on_step(engine.last_step)
        except BaseException as exc:  # a fatal engine error: every stream must hear of it
            log.exception("engine loop died")
            self.error = exc
        self._fail_all(self.error or EngineDeadError("the engine was shut down"))

    def _apply(self, command: _Add | _Abort | None) -> None:
        if command is None:
            return
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            stream = self._streams.pop(command.request_id, None)
            if stream is not None:
                self._deliver(stream, [None])
            return
        try:
            self.engine.add_request(
                command.request_id, command.prompt, command.params, command.priority, command.arrival_time,
                command.queue_timeout,
            )
        except Exception as exc:  # e.g. a duplicate request id: that request fails, the loop goes on
            self._deliver(command.stream, [exc])
            return
        self._streams[command.request_id] = command.stream

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                stream.finished = True
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, stream: _Stream, items: list) -> None:
        stream.finished = True
        stream.loop.call_soon_threadsafe(_put_all, [(stream, item) for item in items])

    def _fail_all(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"the engine stopped: {exc!r}")
        # Requests queued but never added fail too, so no caller waits forever.
        with self._lock:
            self._closed = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._streams[command.request_id] = command.stream
        for stream in self._streams.values():
            try:
                self._deliver(stream, [error])
            except RuntimeError:  # that event loop is closed already
                pass
        self._streams.clear()


def _put_all(items: list) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
