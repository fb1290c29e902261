"""The FastAPI application: routes, error answers, and the engine core's lifetime (it delivers
outputs while the app runs and is stopped when the app shuts down)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from replayserve.chat import ChatTemplate
from replayserve.llm import LLM
from replayserve.server.async_engine import AsyncEngine, ThreadCore
from replayserve.server.core_process import ProcessCore
from replayserve.server.errors import ApiError, validation_error
from replayserve.server.generation import Generation
from replayserve.server.metrics import ServerMetrics
from replayserve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, error_body
from replayserve.server.reasoning import REASONING_PARSERS
from replayserve.server.tool_parsers import TOOL_CALL_PARSERS
from replayserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# Bodies above this many bytes get a 413 before they are parsed (a 128k-token prompt is ~1 MB of JSON).
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def create_app(source: LLM | ProcessCore, model_name: str, max_waiting_requests: int = 256,
               api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> FastAPI:
    """An app serving ``source`` under ``model_name``: an engine core process that has been
    launched (`serve`), or an `LLM` whose engine then steps on a thread of this process.
    api_key: every /v1 route then needs ``Authorization: Bearer <api_key>`` (/health and
    /metrics stay open); max_request_bytes: larger bodies are refused with a 413;
    tool_call_parser: the format of the model's tool calls, a name of `TOOL_CALL_PARSERS`;
    reasoning_parser: its reasoning blocks', a name of `REASONING_PARSERS`.
    ``app.state.engine`` is its `AsyncEngine` and ``app.state.metrics`` its `ServerMetrics`;
    ``app.state.draining`` set makes new generation requests answer 503. If the core dies, the
    requests in flight fail, /health answers 503 and ``app.state.on_fatal`` (if set) is called."""
    metrics = ServerMetrics(model_name)
    if isinstance(source, LLM):
        core: ThreadCore | ProcessCore = ThreadCore(source.engine)
        tokenizer, chat_template = source.tokenizer, source.chat_template
    else:
        core = source
        tokenizer, chat_template = Tokenizer.from_dir(source.model), ChatTemplate.from_dir(source.model)
    for name, value, choices in (("tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS),
                                 ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
        if value is not None and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    engine = AsyncEngine(core, tokenizer, metrics, max_waiting_requests)
    generation = Generation(engine, model_name, tokenizer, chat_template,
                            None if tool_call_parser is None else TOOL_CALL_PARSERS[tool_call_parser],
                            None if reasoning_parser is None else REASONING_PARSERS[reasoning_parser])
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="replayserve", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.draining = False
    app.state.on_fatal = None
    app.state.loop = None  # the event loop, once the app runs

    def died(why: str) -> None:
        app.state.draining = True
        if app.state.on_fatal is not None:
            app.state.on_fatal()

    engine.on_death = died

    @app.exception_handler(ApiError)
    async def api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        metrics.reject(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        metrics.reject(400)
        return validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: HttpRequest, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error answering %s", request.url.path)
        metrics.reject(500)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_server_error"),
                            status_code=500)

    def check_open() -> None:
        if app.state.draining:
            raise ApiError(503, "the server is shutting down", None, "service_unavailable")

    expected = None if api_key is None else f"Bearer {api_key}".encode()

    def check_key(raw: HttpRequest) -> None:
        given = raw.headers.get("authorization", "").encode()
        if expected is not None and not hmac.compare_digest(given, expected):
            raise ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>' with "
                           "the server's --api-key", None, "invalid_request_error", "invalid_api_key")

    keyed = [Depends(check_key)]

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: CompletionRequest, raw: HttpRequest) -> Response:
        check_open()
        return await generation.completions(body, raw)

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(body: ChatCompletionRequest, raw: HttpRequest) -> Response:
        check_open()
        return await generation.chat(body, raw)

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> ModelList:
        limit = engine.config.resolved_max_model_len
        return ModelList(data=[ModelCard(id=model_name, created=created, max_model_len=limit)])

    @app.get("/health")
    async def health() -> Response:
        alive = engine.is_alive()
        return Response(status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class BodyLimit:
    """ASGI middleware: a request whose body exceeds ``limit`` bytes gets a 413 at once, from its
    Content-Length, or as soon as a chunked body passes the limit, instead of being read whole."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, self._why())
            return message

        await self.app(scope, counted, send)

    def _why(self) -> str:
        return f"the request body is larger than the server's limit of {self.limit} bytes (--max-request-bytes)"

    async def _refuse(self, send: Send) -> None:
        response = JSONResponse(error_body(self._why(), "invalid_request_error"), status_code=413,
                                headers={"connection": "close"})
        await response({"type": "http"}, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}
