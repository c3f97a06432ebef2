"""AsyncEngine: runs LLMEngine.step() on a background thread and streams each request's outputs.

The engine loop owns the LLMEngine; callers on the asyncio side only put commands (add, abort)
on a thread-safe queue and receive their request's outputs in an OutputSink. A request is validated
once, on the caller's side (new_request), so an invalid one raises there and the loop only enqueues.
Outputs of one step are handed to the event loop in a single call, so a step costs the event loop one
wake-up, not one per request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, StepStats
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.sequence import Request, RequestOutput

log = logging.getLogger("pagoda.async_engine")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a fatal error or shutdown); no request can be served."""


class RequestFailed(RuntimeError):
    """The engine failed this request (RequestOutput.error: a failed step, non-finite logits, a detokenizer
    error); the engine itself goes on with the others."""


@dataclass
class _Add:
    request: Request  # validated by new_request()
    sink: OutputSink


@dataclass
class _Abort:
    request_id: str


class OutputSink(Protocol):
    """Where one request's outputs go on the asyncio side. `put` is called on `loop`, with each
    RequestOutput in order, then, only if the request ended without a finished output, None (it was
    aborted) or the exception that ended it (RequestFailed, EngineDeadError)."""

    loop: asyncio.AbstractEventLoop

    def put(self, item: RequestOutput | BaseException | None) -> None: ...


class _Stream:
    """The sink of one generate() call: a queue its caller reads."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self.finished = False  # nothing more will come: no abort needed when the caller leaves

    def put(self, item: RequestOutput | BaseException | None) -> None:
        if not isinstance(item, RequestOutput) or item.finished:
            self.finished = True
        self.queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, OutputSink] = {}  # owned by the loop thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._closed = False  # set once by the loop thread as it exits, under _lock
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        # Called on the engine thread after every step (e.g. to update Prometheus metrics).
        self.on_step: Callable[[StepStats], None] | None = None

    # ----- life cycle -----

    def start(self) -> None:
        if self.engine.config.device == "cpu":
            # The model was loaded on this thread; from now on the engine thread computes alone.
            from engine.cpu_ops import release_openmp_threads

            release_openmp_threads()
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

    def new_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        queue_timeout: float | None = None,
    ) -> Request:
        """A validated request (prompt already tokenized), arriving now, for submit(): the one check of it.

        Raises InvalidParameter if it cannot be served; nothing is queued. Any thread may call it.
        """
        return self.engine.new_request(request_id, prompt, params, priority, time.monotonic(), queue_timeout)

    def submit(self, request: Request, sink: OutputSink) -> None:
        """Queue a request from new_request() (not checked again); its outputs go to `sink` on the sink's loop.

        Raises EngineDeadError if the loop has stopped. Whoever stops listening before the end must call abort().
        """
        with self._lock:  # against the loop thread closing between the check and the put
            if not self.is_alive:
                raise EngineDeadError("the engine is not running")
            self._commands.put(_Add(request, sink))

    def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        sink: OutputSink,
        priority: int = 0,
        queue_timeout: float | None = None,
    ) -> None:
        """new_request() then submit(): raises InvalidParameter (nothing queued) if the request cannot be
        served, EngineDeadError if the loop has stopped."""
        self.submit(self.new_request(request_id, prompt, params, priority, queue_timeout), sink)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (an unknown or finished one is ignored); its sink gets None."""
        self._commands.put(_Abort(request_id))

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
        stream = _Stream(asyncio.get_running_loop())
        self.add(request_id, prompt, params, stream, priority, queue_timeout)
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
                self.abort(request_id)

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
            sink = self._sinks.pop(command.request_id, None)
            if sink is not None:
                self._deliver(sink, None)
            return
        try:
            self.engine.enqueue(command.request)
        except Exception as exc:  # e.g. a duplicate request id: that request fails, the loop goes on
            self._deliver(command.sink, exc)
            return
        self._sinks[command.request.request_id] = command.sink

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputSink, RequestOutput | RequestFailed]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            item = out if out.error is None else RequestFailed(out.error)
            by_loop.setdefault(sink.loop, []).append((sink, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, sink: OutputSink, item: BaseException | None) -> None:
        sink.loop.call_soon_threadsafe(_put_all, [(sink, item)])

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
                self._sinks[command.request.request_id] = command.sink
        for sink in self._sinks.values():
            try:
                self._deliver(sink, error)
            except RuntimeError:  # that event loop is closed already
                pass
        self._sinks.clear()


def _put_all(items: list[tuple[OutputSink, RequestOutput | BaseException | None]]) -> None:
    for sink, item in items:
        try:
            sink.put(item)
        except Exception:
            log.exception("delivering an output of %s failed", getattr(item, "request_id", "a request"))
