"""The FastAPI app: OpenAI-compatible routes over an AsyncEngine, auth, and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import hmac
import html
import logging
import math
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_engine import AsyncEngine, EngineDeadError, RequestFailed
from engine.pooling_params import PoolingParams
from engine.sampling_params import InvalidParameter, SamplingParams
from server import render
from server.chat import ChatOptions, OutputParser, plan_tools, template_messages, with_defaults
from server.config import ServerConfig
from server.metrics import Metrics, cache_config_labels
from server.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingList,
    EmbeddingRequest,
    ErrorBody,
    ErrorInfo,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from server.ratelimit import RateLimiter
from server.responses import (
    DeletedResponse,
    ResponseObject,
    ResponsesAPI,
    ResponsesError,
    ResponsesRequest,
    ResponseStore,
)
from server.streaming import (
    Admission,
    ClientDisconnected,
    Generation,
    QueueTimeout,
    ServerStopping,
    engine_requests,
    sse_events,
)

log = logging.getLogger("pagoda.server")

# Paths that answer without an API key: probes and scrapers carry none, and the playground page asks for the
# key itself (its API calls carry it).
_OPEN_PATHS = frozenset({"/health", "/metrics", "/"})
_PLAYGROUND = Path(__file__).parent / "static" / "playground.html"
_RETRY_AFTER_S = 1  # queue full: a request finishes every few steps, so retry soon
_DEAD_RETRY_AFTER_S = 30  # engine dead: this process will not recover; wait for a restart
# A token is rarely more than a few characters (a long run of one repeated character can make one of ~16), so a
# text over max_model_len x 64 characters cannot fit the context: it is refused without being tokenized, which
# for megabytes of text takes seconds.
_MAX_CHARS_PER_TOKEN = 64
# A request whose body is bigger than this is tokenized on its own thread, so the many small ones (a millisecond
# each) never wait behind its seconds.
_LARGE_BODY_BYTES = 64 * 1024


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_dir: str
    api_keys: list[str] = field(default_factory=list)  # empty: no auth
    max_waiting_requests: int | None = None  # None: unbounded
    rate_limiter: RateLimiter = field(default_factory=RateLimiter)  # default: no limits
    chat: ChatOptions = field(default_factory=ChatOptions)  # tools, reasoning, template, generation defaults
    max_stored_responses: int = ServerConfig.max_stored_responses  # /v1/responses kept for previous_response_id
    metrics_prefix: str = ServerConfig.metrics_prefix
    # An opentelemetry TracerProvider: a span per request goes to it (server/tracing.py). None: no tracing,
    # and opentelemetry is never imported.
    tracer_provider: Any = None
    http: ServerConfig = field(default_factory=ServerConfig)  # read here for CORS, the root path and the docs


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> ErrorBody:
        return ErrorBody(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def json_response(body: BaseModel, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    # pydantic writes a non-finite float (a -inf logprob) as null; json.dumps would write invalid JSON.
    return Response(body.model_dump_json(), status_code=status, headers=headers, media_type="application/json")


def as_api_error(exc: Exception) -> APIError:
    """The OpenAI-shaped error for an exception; unexpected ones become a 500 that says nothing inside."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidParameter):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, ResponsesError):
        return APIError(exc.status, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ServerStopping):
        return APIError(503, str(exc), "server_error", code="server_shutting_down")
    if isinstance(exc, QueueTimeout):
        return APIError(
            503, str(exc), "server_error", code="queue_timeout", headers={"Retry-After": str(_RETRY_AFTER_S)}
        )
    if isinstance(exc, EngineDeadError):
        return APIError(
            503,
            f"the engine is not running: {exc}",
            "server_error",
            code="engine_dead",
            headers={"Retry-After": str(_DEAD_RETRY_AFTER_S)},
        )
    if isinstance(exc, RequestFailed):  # the engine logged why; the others' requests go on
        return APIError(500, f"the engine failed this request: {exc}", "server_error", code="engine_error")
    log.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, "internal server error; the server log has the details", "server_error")


def _param_path(loc: tuple) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in ("str", "int", "constrained-str") and not part.startswith(
            ("list[", "function-")
        ):  # union tags
            path += f".{part}" if path else part
    return path or None


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    param = _param_path(tuple(first.get("loc", ())))
    kind = first.get("type")
    if kind == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if kind == "missing" and tuple(first.get("loc", ())) == ("body",):
        return APIError(400, "the request needs a JSON body")
    if kind == "finite_number":
        value = first.get("input")
        what = "is not a number (NaN)" if isinstance(value, float) and math.isnan(value) else "must be finite"
        return APIError(400, f"{param} {what}", param=param)
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unrecognized request argument: {param}", param=param)
    return APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)


def _route_path(scope: Scope) -> str:
    """The path without --root-path's prefix, as the routes match it: /api/health and /health are both /health."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root + "/") else path


class APIKeyMiddleware:
    """Bearer-token check on every path but the probes. A plain ASGI middleware, so it answers before
    the body is even parsed and leaves streaming responses alone."""

    def __init__(self, app: ASGIApp, api_keys: list[str]):
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _route_path(scope) not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Constant-time, and every key compared, so no key can be guessed byte by byte from
            # response times.
            matches = [hmac.compare_digest(given, key) for key in self.expected]
            if not any(matches):
                error = APIError(
                    401, "missing or incorrect API key (send 'Authorization: Bearer <key>')", code="invalid_api_key"
                )
                await error.response()(scope, receive, send)
                return
            # The client the rate limits charge: which key, never the header's text itself.
            scope.setdefault("state", {})["client_key"] = f"key {matches.index(True)}"
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """Every request gets an id (request.state.request_id): the client's X-Request-Id, or a new one. The
    response carries it back in the same header; the request's engine request ids and log lines begin with it."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1").strip()
        request_id = given or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Reads a request's body whole before the app parses it, refusing one over `limit` bytes with 413: at
    once if its Content-Length says so, else (a chunked body) as soon as that much has arrived. Records its
    size in request.state.body_bytes."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            await self._too_large().response()(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large().response()(scope, receive, send)
                return
            more = message.get("more_body", False)
        scope.setdefault("state", {})["body_bytes"] = size
        body: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal body
            message, body = body, None
            return message if message is not None else await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"the request body is larger than this server's limit of {self.limit} bytes",
            param=None,
            code="request_too_large",
        )


class CatchAllMiddleware:
    """Any exception no handler took becomes a logged 500 with an OpenAI-shaped body and no traceback.

    (Starlette's own catch-all re-raises after answering, so the server would log it a second time.)
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_and_note(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as exc:
            error = as_api_error(exc)
            if not started and scope["type"] == "http":
                await error.response()(scope, receive, send)


class _Server:
    """What the routes share: the engine, its tokenizer thread, metrics and the admission count."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings):
        if engine.tokenizer is None:
            raise ValueError("the server needs a model with a tokenizer")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.settings = settings
        self.model_name = settings.served_model_names[0]
        self.metrics = Metrics(
            self.model_name,
            engine.engine.config.max_num_batched_tokens,
            engine.max_model_len,
            settings.metrics_prefix,
            # The speculative-decoding counters, for an engine that speculates (k draft positions).
            spec_decode=getattr(engine.engine.config.speculative_config, "num_speculative_tokens", 0),
        )
        self.metrics.set_cache_config(cache_config_labels(engine.engine))
        self.tracer = None
        if settings.tracer_provider is not None:
            from server.tracing import RequestTracer

            self.tracer = RequestTracer(settings.tracer_provider, self.model_name)
        self.admission = Admission(settings.max_waiting_requests)
        self.strings = render.TokenStrings(self.tokenizer)
        # Tokenizing and templating run here, off the event loop, so a long prompt never stalls the
        # streams. One thread for small requests (a millisecond or so each) and one for large ones (see
        # is_large), so a small one never queues behind seconds of tokenizing; more threads would only
        # compete with the engine for the cores (the tokenizer releases the GIL while it works).
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-tokenize")
        self.large_tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="pagoda-tokenize-large")
        self.max_prompt_chars = engine.max_model_len * _MAX_CHARS_PER_TOKEN
        # Grammar compiles: a complex schema can take a second; xgrammar runs its own threads inside.
        self.grammar_pool = ThreadPoolExecutor(2, thread_name_prefix="pagoda-grammar")
        self.created = int(time.time())
        self.generations: weakref.WeakSet[Generation] = weakref.WeakSet()  # those that may still be running
        self.stopping = False  # the drain time is up: no request is taken any more

    def cut_off(self, timeout: float) -> int:
        """The shutdown's drain time (`timeout` s) is up: end every request still running with a 503 error
        (an error event and [DONE] in a stream), so each response ends properly instead of being cancelled.
        Returns how many were cut off."""
        self.stopping = True
        running = [g for g in self.generations if g.running]
        if running:
            log.warning("shutdown timeout (%g s) expired: cutting off %d request(s)", timeout, len(running))
        error = ServerStopping(f"the server is shutting down and its drain time of {timeout:g} s is up")
        for generation in running:
            generation.cut_off(error)
        return len(running)

    async def in_thread(self, fn, *args, large: bool = False) -> Any:
        """fn(*args) in the tokenizer thread; `large`: in the one for large requests."""
        pool = self.large_tokenize_pool if large else self.tokenize_pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    @staticmethod
    def is_large(request: Request) -> bool:
        """Whether the request's body is big enough for its tokenizing to take long."""
        return getattr(request.state, "body_bytes", 0) > _LARGE_BODY_BYTES

    def check_length(self, text: str, param: str) -> None:
        """Refuse a text too long for the context whatever its tokens, before paying for tokenizing it."""
        if len(text) > self.max_prompt_chars:
            raise APIError(
                400,
                f"{param} has {len(text)} characters; this model's context length of {self.engine.max_model_len} "
                f"tokens takes at most {self.max_prompt_chars} ({_MAX_CHARS_PER_TOKEN} per token)",
                param=param.split("[")[0],
            )

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """The text's token ids, unless check_length() refuses it."""
        self.check_length(text, param)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.settings.served_model_names:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves {', '.join(self.settings.served_model_names)}",
                param="model",
                code="model_not_found",
            )

    def check_sequences(self, prompts: int, n: int, prompt_param: str = "prompt") -> None:
        """Refuse, before any tokenizing, a request of `prompts` prompts x `n` that no wait could let in
        (`prompt_param`: the prompts' field in the request, which the error names when n is 1).

        A 400, not a 503: the openai SDK retries a 503 (after its Retry-After), and this request would be
        refused again however long it waited; vLLM, too, answers a request that can never run with 400."""
        sequences = prompts * n
        param = "n" if n > 1 else prompt_param
        cap = self.settings.http.max_sequences_per_request
        if sequences > cap:
            raise APIError(
                400,
                f"the request asks for {sequences} sequences ({prompts} prompts x n={n}); at most {cap} are allowed",
                param=param,
            )
        limit = self.admission.limit
        if limit is not None and sequences > limit:
            raise APIError(
                400,
                f"the request asks for {sequences} sequences ({prompts} prompts x n={n}); this server queues at "
                f"most {limit}",
                param=param,
            )

    def admit(self, prompts: int, n: int) -> None:
        """Let `prompts` x `n` more sequences queue, or refuse them: a 400 if they never could, a 503 to retry
        later if they cannot now."""
        self.check_sequences(prompts, n)
        if not self.engine.is_alive:
            raise EngineDeadError(str(self.engine.error or "stopped"))
        if self.stopping:
            raise ServerStopping("the server is shutting down")
        if not self.admission.fits(prompts * n):
            raise APIError(
                503,
                f"the server is at capacity: {self.admission.queued} sequences are waiting; retry later",
                "server_error",
                code="queue_full",
                headers={"Retry-After": str(_RETRY_AFTER_S)},
            )

    def charge(self, request: Request, prompts: list[list[int]], params: SamplingParams | PoolingParams) -> None:
        """Rate limits, per client: its validated API key when the server has keys, else its address (the
        connection's peer, or the forwarded-for address a trusted proxy gives: --forwarded-allow-ips). Never
        the Authorization header without keys: anyone could send a new one with each request."""
        limiter = self.settings.rate_limiter
        if not limiter.enabled:
            return
        client = getattr(request.state, "client_key", None)
        if client is None:
            client = f"address {request.client.host}" if request.client else "address unknown"
        max_len = self.engine.max_model_len
        tokens = sum(map(len, prompts))
        if isinstance(params, SamplingParams):  # an embedding request generates nothing
            tokens += sum(
                params.n * (params.max_tokens if params.max_tokens is not None else max_len - len(p)) for p in prompts
            )
        wait, limit = limiter.acquire(client, tokens)
        if wait > 0:
            raise APIError(
                429,
                f"rate limit reached for {limit} per minute; retry in {wait:.1f} s",
                type=limit,
                code="rate_limit_exceeded",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        param: str = "messages",
    ) -> list[int]:
        """The templated prompt's token ids (call it in the tokenizer thread); `param` names the messages'
        field in the request, for an error."""
        conversation = template_messages(messages)
        try:
            text = self.tokenizer.render_chat(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                chat_template=self.settings.chat.chat_template,
                **(template_kwargs or {}),
            )
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise APIError(400, f"the chat template rejected the messages: {exc}", param=param) from None
        # The template writes every special token itself (BOS included); adding them again would double them.
        return self.encode(text, False, param)

    def ends_in_reasoning(self, prompt: list[int]) -> bool:
        """Whether the rendered prompt leaves a <think> block open (the template opened it)."""
        return self.tokenizer.decode(prompt[-4:], skip_special_tokens=False).rstrip().endswith("<think>")

    async def compile(self, params: SamplingParams) -> None:
        """Compile the request's grammar before it is queued (the engine then finds it cached): off the
        event loop and the tokenizer thread, so a slow schema delays only its own request."""
        if params.constraint is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.grammar_pool, self.engine.engine.compile_constraint, params)

    def text_prompts(
        self, prompt: str | list, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[list[int]]:
        """Completions' prompt (or embeddings' input, `param`) in any of its four shapes, as token id lists
        (call it in the tokenizer thread)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, f"{param} is empty", param=param)
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], list):
            return [list(p) for p in prompt]
        return [self.tokenizer.encode(p, add_special_tokens=add_special_tokens) for p in prompt]

    def check_text_prompts(self, prompt: str | list, param: str = "prompt") -> None:
        """check_length() of each text prompt of text_prompts(), on the event loop: a refusal waits for no
        tokenizing."""
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        for i, text in enumerate(texts):
            self.check_length(text, param if isinstance(prompt, str) else f"{param}[{i}]")


def _reject_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    name = body.unsupported()
    if name is not None:
        raise APIError(400, f"'{name}' is not supported by pagoda yet", param=name, code="unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")


def build_app(engine: AsyncEngine, settings: ServerSettings) -> FastAPI:
    """The app for an AsyncEngine. The app starts the engine loop when it starts and stops it when it stops."""
    server = _Server(engine, settings)
    engine.on_step = server.metrics.on_step

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        # After uvicorn has drained the in-flight requests (or given up waiting).
        await asyncio.to_thread(engine.shutdown)
        server.tokenize_pool.shutdown(wait=False)
        server.large_tokenize_pool.shutdown(wait=False)
        server.grammar_pool.shutdown(wait=False)

    http = settings.http
    # FastAPI's /docs and /redoc load their scripts from a CDN, which an offline machine cannot reach;
    # /docs is served below as a plain page instead (unless --disable-fastapi-docs).
    openapi = {"openapi_url": None} if http.disable_fastapi_docs else {}
    app = FastAPI(
        title="pagoda",
        version=version("pagoda"),
        lifespan=lifespan,
        root_path=http.root_path or "",
        docs_url=None,
        redoc_url=None,
        **openapi,
    )
    app.state.cut_off = server.cut_off  # for `pagoda serve`, when the shutdown's drain time is up
    generate_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            vocab, hidden = engine.engine.runner.vocab_size, engine.engine.hidden_size
            app.openapi_schema = _true_schema(generate_openapi(), bool(settings.api_keys), _OPEN_PATHS, vocab, hidden)
        return app.openapi_schema

    app.openapi = openapi
    app.add_middleware(CatchAllMiddleware)
    # Added before the API-key check, so it runs after it: no body is read for a request without a key.
    app.add_middleware(BodyLimitMiddleware, limit=http.max_request_body_bytes)
    if settings.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=settings.api_keys)
    # Added after the API-key check, so it runs before it: a browser's preflight carries no API key, and a
    # 401 needs CORS headers for the page to read it.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=http.allowed_origins,
        allow_methods=http.allowed_methods,
        allow_headers=http.allowed_headers,
        allow_credentials=http.allow_credentials,
    )
    app.add_middleware(RequestIdMiddleware)  # added last, so it runs first: even a 401 carries the id

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> Response:
        # Routing's 404 and 405 say which endpoint was asked for, as OpenAI's "Invalid URL (POST /v1/x)" does.
        endpoint = f"{request.method} {request.url.path}"
        headers = exc.headers
        if exc.status_code == 405:
            # Starlette names the methods of the first route of the path only (GET, where DELETE is one too).
            methods = sorted(
                {
                    method
                    for route in app.routes
                    if isinstance(route, Route) and route.matches(request.scope)[0] is Match.PARTIAL
                    for method in route.methods or ()
                }
            )
            headers = {**(headers or {}), "Allow": ", ".join(methods)}
        allowed = (headers or {}).get("Allow", "another method")
        message = {
            404: f"Invalid URL ({endpoint}): this server has no such endpoint",
            405: f"Invalid method ({endpoint}): the endpoint takes {allowed}",
        }.get(exc.status_code, str(exc.detail))
        return APIError(exc.status_code, message, headers=headers).response()

    @app.exception_handler(ClientDisconnected)
    async def _on_disconnect(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody is listening; the status is for the access log

    async def _on_error(request: Request, exc: Exception) -> Response:
        return as_api_error(exc).response()

    for exc_type in (
        APIError,
        InvalidParameter,
        ResponsesError,
        EngineDeadError,
        RequestFailed,
        QueueTimeout,
        ServerStopping,
    ):
        app.add_exception_handler(exc_type, _on_error)

    playground = _PLAYGROUND.read_bytes()

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return HTMLResponse(playground)

    @app.get(
        "/health",
        response_class=Response,
        responses={200: {"description": "The engine is running (no body)", "content": {}}, **_errors(503)},
    )
    async def health() -> Response:
        if engine.is_alive:
            return Response(status_code=200)
        return as_api_error(EngineDeadError(str(engine.error or "stopped"))).response()

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {
                "description": "Prometheus metrics, in its text exposition format",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics() -> Response:
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if not http.disable_fastapi_docs:

        @app.get("/docs", include_in_schema=False)
        async def docs() -> HTMLResponse:
            return HTMLResponse(docs_page(app.openapi()))

    @app.get("/version")
    async def get_version() -> VersionResponse:
        return VersionResponse(version=version("pagoda"))

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, created=server.created, root=settings.model_dir, max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(name) for name in settings.served_model_names])

    @app.get("/v1/models/{model:path}", responses=_errors(404))
    async def get_model(model: str) -> ModelCard:
        server.check_model(model)
        return model_card(model)

    @app.post("/tokenize", responses=_errors(400, 404, 413, 503))
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        server.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
            tokens = await server.in_thread(
                server.chat_prompt,
                body.messages,
                body.add_generation_prompt,
                tools,
                body.chat_template_kwargs,
                large=server.is_large(request),
            )
        else:
            server.check_length(body.prompt, "prompt")
            tokens = await server.in_thread(
                server.tokenizer.encode, body.prompt, body.add_special_tokens, large=server.is_large(request)
            )
        return TokenizeResponse(count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens)

    @app.post("/detokenize", responses=_errors(400, 404, 413, 503))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        server.check_model(body.model)
        vocab = engine.engine.runner.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        text = await server.in_thread(server.tokenizer.decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    @app.post("/v1/chat/completions", responses=_generation_responses(ChatCompletion))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        _reject_unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        body = with_defaults(body, settings.chat.generation_defaults)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            plan = plan_tools(body, settings.chat)
            constraint = body.constraint()
            if plan.constraint is not None and constraint is not None:
                raise InvalidParameter(constraint.param, f"tool_choice '{plan.mode}' cannot be combined with it")
            constraint = constraint or plan.constraint
            params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None, constraint)
            prompt = await server.in_thread(
                server.chat_prompt,
                body.messages,
                True,
                plan.tools,
                body.chat_template_kwargs,
                large=server.is_large(request),
            )
            await server.compile(params)
            parser = OutputParser(plan, settings.chat, server.ends_in_reasoning(prompt))
            job = render.Job(
                f"chatcmpl-{uuid.uuid4().hex}",
                int(time.time()),
                server.model_name,
                [prompt],
                body.n,
                body.logprobs,
                parser=parser if parser.active else None,
            )
            generation = start(request, job, params, body.priority)
        except InvalidParameter as exc:
            # The engine names two parameters as completions do; answer with the name the client sent.
            renamed = {"logprobs": "top_logprobs"}
            if body.max_completion_tokens is not None:
                renamed["max_tokens"] = "max_completion_tokens"
            raise InvalidParameter(renamed.get(exc.param, exc.param), str(exc)) from None
        if body.stream:
            chunker = render.ChatChunker(job, server.strings)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return event_stream(generation, chunker, include_usage)
        outputs = {i: out async for i, out in generation.outputs()}
        return json_response(render.chat_completion(job, outputs[0], server.strings))

    @app.post("/v1/completions", responses=_generation_responses(Completion))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        _reject_unsupported(body)
        body = with_defaults(body, settings.chat.generation_defaults)
        params = body.sampling_params(body.max_tokens, body.logprobs, body.constraint())
        server.check_sequences(_prompt_count(body.prompt), params.n)
        server.check_text_prompts(body.prompt)
        prompts = await server.in_thread(server.text_prompts, body.prompt, large=server.is_large(request))
        await server.compile(params)
        echo_texts = None
        if body.echo:
            echo_texts = await server.in_thread(
                _echo_texts, server.tokenizer, body.prompt, prompts, large=server.is_large(request)
            )
        job = render.Job(
            f"cmpl-{uuid.uuid4().hex}",
            int(time.time()),
            server.model_name,
            prompts,
            body.n,
            body.logprobs is not None,
            echo_texts,
        )
        generation = start(request, job, params, body.priority)
        if body.stream:
            chunker = render.CompletionChunker(job, server.strings)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return event_stream(generation, chunker, include_usage)
        outputs = {i: out async for i, out in generation.outputs()}
        return json_response(render.completion(job, outputs, server.strings))

    @app.post("/v1/embeddings", responses={200: {"model": EmbeddingList}, **_errors(400, 404, 413, 429, 503)})
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        server.check_model(body.model)
        size = engine.engine.hidden_size
        if body.dimensions is not None and body.dimensions != size:
            raise APIError(
                400,
                f"dimensions must be {size}, the hidden size of this model, whose embeddings cannot be shortened "
                f"(got {body.dimensions})",
                param="dimensions",
            )
        texts = [body.input] if isinstance(body.input, str) else body.input
        empty = next((i for i, text in enumerate(texts) if text == ""), None)
        if empty is not None:  # OpenAI refuses them too, whatever a tokenizer would make of one
            where = "input" if isinstance(body.input, str) else f"input[{empty}]"
            raise APIError(400, f"{where} is an empty string", param="input")
        server.check_sequences(_prompt_count(body.input), 1, "input")
        server.check_text_prompts(body.input, "input")
        prompts = await server.in_thread(server.text_prompts, body.input, True, "input", large=server.is_large(request))
        job = render.Job(f"embd-{uuid.uuid4().hex}", int(time.time()), server.model_name, prompts, 1, False)
        try:
            generation = start(request, job, PoolingParams(), 0)
        except InvalidParameter as exc:
            raise InvalidParameter("input" if exc.param == "prompt" else exc.param, str(exc)) from None
        outputs = {i: out async for i, out in generation.outputs()}
        return json_response(render.embeddings(job, outputs, body.encoding_format))

    def start(request: Request, job: render.Job, params: SamplingParams | PoolingParams, priority: int) -> Generation:
        # Every prompt is validated here, once (the engine does not check again), and before anything is
        # queued, admitted or charged: a bad prompt in a list is a 400 that leaves no other prompt running.
        requests = engine_requests(engine, request.state.request_id, job.prompts, params, priority)
        server.admit(len(requests), params.n if isinstance(params, SamplingParams) else 1)
        server.charge(request, job.prompts, params)
        generation = Generation(
            request, engine, requests, server.admission, server.metrics, server.tracer, settings.http.log_requests
        )
        server.generations.add(generation)
        return generation

    def event_stream(generation: Generation, chunker, include_usage: bool) -> StreamingResponse:
        return sse_response(sse_events(generation, chunker, include_usage, lambda exc: as_api_error(exc).body()))

    responses = ResponsesAPI(
        server, start, lambda exc: as_api_error(exc).body().error, ResponseStore(settings.max_stored_responses)
    )

    @app.post("/v1/responses", responses=_generation_responses(ResponseObject))
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        result = await responses.create(body, request)
        return json_response(result) if isinstance(result, ResponseObject) else sse_response(result)

    @app.get("/v1/responses/{response_id}", responses={200: {"model": ResponseObject}, **_errors(400, 404)})
    async def retrieve_response(
        response_id: str,
        stream: bool = Query(
            False,
            description="only false: a stored response is not streamed again",
            json_schema_extra={"enum": [False]},
        ),
    ) -> Response:
        return json_response(responses.retrieve(response_id, stream))

    @app.delete("/v1/responses/{response_id}", responses={200: {"model": DeletedResponse}, **_errors(404)})
    async def delete_response(response_id: str) -> Response:
        return json_response(responses.delete(response_id))

    # Not in the OpenAPI document: it can only refuse (pagoda runs no background responses, so none can be
    # cancelled); it answers so that an OpenAI client that calls it learns why.
    @app.post("/v1/responses/{response_id}/cancel", include_in_schema=False)
    async def cancel_response(response_id: str) -> Response:
        raise responses.cancel_refusal(response_id)

    return app


_ERROR_DESCRIPTIONS = {
    400: "The request is invalid: the error's message and param say what is wrong",
    401: "No API key, or a wrong one",
    404: "No such model (or stored response)",
    413: "The body is larger than --max-request-body-bytes",
    429: "Over a --rate-limit-* limit; Retry-After says when to retry",
    503: "The server cannot take the request now (queue full or timed out, shutting down) or its engine is not "
    "running; Retry-After says when to retry",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of these error statuses, each an OpenAI-shaped error body."""
    return {status: {"model": ErrorBody, "description": _ERROR_DESCRIPTIONS[status]} for status in statuses}


def _generation_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A generating route's responses: the body, or with stream=true its Server-Sent Events, and its errors."""
    events: dict[str, Any] = {"text/event-stream": {}}  # each event's data is a JSON chunk, then [DONE]
    return {200: {"model": model, "content": events}, **_errors(400, 404, 413, 429, 503)}


def _true_schema(schema: dict, api_keys: bool, open_paths: frozenset[str], vocab_size: int, hidden_size: int) -> dict:
    """FastAPI's OpenAPI document made to say what the server does: its 400 where FastAPI writes 422 (pagoda
    answers validation errors with 400, in OpenAI's error shape), 401 where an API key is needed, the
    vocabulary's bound on token ids and the one embedding size."""
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            responses = operation["responses"]
            if "422" in responses:
                del responses["422"]
                # A path parameter is any string; a body or query parameter can be invalid: a 400.
                if "requestBody" in operation or any(p["in"] != "path" for p in operation.get("parameters", ())):
                    responses.setdefault("400", _error_response(400))
            if api_keys and path not in open_paths:
                responses["401"] = _error_response(401)
                operation["security"] = [{"APIKey": []}]
    if api_keys:
        schema.setdefault("components", {}).setdefault("securitySchemes", {})["APIKey"] = {
            "type": "http",
            "scheme": "bearer",
        }
    _fill_model_bounds(schema, vocab_size, hidden_size)
    return schema


def _error_response(status: int) -> dict:
    return {
        "description": _ERROR_DESCRIPTIONS[status],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
    }


_BOUND_KEYWORDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _fill_model_bounds(node: Any, vocab_size: int, hidden_size: int) -> None:
    """The bounds only the model knows: a schema marked x-token-id (protocol.TokenId) gets the vocabulary's as
    its maximum, one marked x-hidden-size (embeddings' dimensions) the hidden size as its one value."""
    if isinstance(node, dict):
        # pydantic writes a bound it checks after a validator as its own name (ge: 0), which JSON Schema ignores.
        for bound, keyword in _BOUND_KEYWORDS.items():
            if bound in node:
                node[keyword] = node.pop(bound)
        if node.pop("x-token-id", False):
            node["minimum"], node["maximum"] = 0, vocab_size - 1
        if node.pop("x-hidden-size", False):
            node["const"] = hidden_size
        for value in node.values():
            _fill_model_bounds(value, vocab_size, hidden_size)
    elif isinstance(node, list):
        for value in node:
            _fill_model_bounds(value, vocab_size, hidden_size)


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    # no-cache and no proxy buffering: each event must reach the client when it is made.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def docs_page(schema: dict) -> str:
    """/docs: the endpoints of the OpenAPI schema as a plain HTML table that needs nothing from the network
    (the full schema, request bodies included, is /openapi.json)."""
    rows = "".join(
        f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
        f"<td>{html.escape(operation.get('summary', ''))}</td></tr>"
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
    )
    title = html.escape(f"{schema['info']['title']} {schema['info']['version']}")
    return (
        f"<!doctype html><meta charset=utf-8><title>{title}</title><h1>{title}</h1>"
        "<p>An OpenAI-compatible API. The full schema, with every request and response body: "
        '<a href="/openapi.json">/openapi.json</a>.</p>'
        f"<table><tr><th>method</th><th>path</th><th></th></tr>{rows}</table>"
    )


def _prompt_count(prompt: str | list) -> int:
    """How many prompts completions' prompt holds, in any of its four shapes."""
    return len(prompt) if prompt and isinstance(prompt, list) and not isinstance(prompt[0], int) else 1


def _echo_texts(tokenizer, prompt: str | list, prompts: list[list[int]]) -> list[str]:
    """The text each prompt echoes: as given, or decoded from its token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    return [tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
