"""The FastAPI app: OpenAI's completions and chat completions, models, health, metrics,
and vLLM's /tokenize and /detokenize (``tokens``).

Every refusal is an ``APIError`` rendered in OpenAI's error shape (unknown routes, a
wrong method with its ``Allow``, and unexpected exceptions too: a client never sees a
traceback). ``/openapi.json`` is FastAPI's schema, each POST route's body described by
``schema.py`` (it documents; the routes parse their bodies themselves). The engine lives
in its own process or on a thread (a ``messages.Host``, held by the ``worker``), started
with the app and stopped after its last request.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ...runtime.request_checks import RequestLimits
from ..messages import Host
from .errors import APIError
from .fields import CHAT, COMPLETIONS
from .limits import Admission, ServeSettings, check_api_key, read_json
from .metrics import ServeMetrics
from .model_info import ModelInfo
from .protocol import parse_request
from .responses import DONE, Shaper, sse
from .schema import CHAT_TYPES, COMPLETION_TYPES, object_schema, openapi_body, with_bearer
from .session import Session
from .tokens import add_token_routes
from .worker import EngineWorker

log = logging.getLogger(__name__)


class ServerState:
    """Everything one app instance owns (no module globals)."""

    def __init__(self, settings: ServeSettings, host: Host,
                 describe: Callable[[RequestLimits], ModelInfo], rows: int, on_failed):
        self.settings = settings
        self.metrics = ServeMetrics()
        self.worker = EngineWorker(host, describe, self.metrics, on_failed)
        self.admission = Admission(rows, settings.max_waiting, settings.retry_after_s)
        self.draining = False

    def begin_drain(self) -> None:
        """SIGTERM: admit nothing more; requests in flight get the grace period."""
        if self.draining:  # a second signal does not extend the grace
            return
        self.draining = True
        self.worker.drain(self.settings.shutdown_grace_s)

    def info(self) -> ModelInfo:
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.worker.dead:
            raise APIError(503, self.worker.dead)
        if self.worker.failed:  # (its reason names the server's files: the log has it)
            raise APIError(503, "the engine failed to start (the server's log says why)")
        if self.worker.info is None:
            raise APIError(503, "the engine is starting (capturing its graphs); retry shortly",
                           headers={"Retry-After": "1"})
        return self.worker.info


class _Streamed(StreamingResponse):
    """A streamed response that always runs ``on_end``, even if its body never started
    (a client that left before the first chunk)."""

    def __init__(self, content, on_end: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_end()


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def create_app(settings: ServeSettings, host: Host,
               describe: Callable[[RequestLimits], ModelInfo], rows: int,
               on_failed: Callable[[], None] = lambda: None) -> FastAPI:
    """``host`` builds and runs the engine (``serve.engine.hosts``); ``describe`` makes the
    served ``ModelInfo`` of its limits; ``rows``: its pool's rows; ``on_failed`` runs (on
    the host's thread) when the engine could not start."""
    state = ServerState(settings, host, describe, rows, on_failed)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        yield
        await asyncio.to_thread(state.worker.stop)

    app = FastAPI(lifespan=lifespan, title="nextn_graph", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.serve = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if 400 <= exc.status < 499:  # refusals (not a client gone, a fault, a stop)
            state.metrics.rejected.labels(str(exc.status)).inc()
        return _error(exc)

    @app.exception_handler(HTTPException)  # the router's 404, and 405 with its Allow
    async def http_error(request: Request, exc: HTTPException):
        return _error(APIError(exc.status_code, str(exc.detail), headers=exc.headers or {}))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.error("unexpected error serving %s", request.url.path, exc_info=exc)
        state.metrics.internal_errors.inc()
        return _error(APIError(500, f"internal error: {type(exc).__name__}"))

    @app.get("/health")
    async def health():
        try:
            state.info()
        except APIError as exc:
            return JSONResponse({"status": "unavailable", "reason": exc.message}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        state.metrics.in_flight.set(state.admission.in_flight)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request.headers.get("authorization"), settings.api_key)
        info = state.info()
        return {"object": "list", "data": [{"id": info.name, "object": "model", "created": 0,
                                            "owned_by": "nextn_graph",
                                            "max_model_len": info.limits.max_context}]}

    @app.post("/v1/completions", openapi_extra=openapi_body(
        object_schema(COMPLETIONS, COMPLETION_TYPES, ("prompt",))))
    async def completions(request: Request):
        return await _generate(state, request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(
        object_schema(CHAT, CHAT_TYPES, ("messages",))))
    async def chat_completions(request: Request):
        return await _generate(state, request, chat=True)

    add_token_routes(app, state)
    if settings.api_key is not None:
        plain_schema = app.openapi

        def openapi() -> dict:  # FastAPI's, built once, with the key's scheme
            if app.openapi_schema is None:
                app.openapi_schema = with_bearer(plain_schema())
            return app.openapi_schema

        app.openapi = openapi
    return app


async def _generate(state: ServerState, request: Request, chat: bool):
    settings = state.settings
    check_api_key(request.headers.get("authorization"), settings.api_key)
    info = state.info()
    req = parse_request(await read_json(request, settings), info, chat)
    count = len(req.prompts) * req.n  # engine requests: the admission counts them
    state.admission.enter(count)
    sess = Session(req, state.worker, state.metrics, info.tokenizer,
                   lambda: state.admission.leave(count), request.is_disconnected,
                   settings.request_timeout_s)
    shaper = Shaper(req, info.name, info.tokenizer)
    sess.submit()
    if req.stream:
        try:
            await sess.first_event()
        except BaseException:
            sess.close()
            raise
        sess.stop_polling()  # streaming: a client that leaves cancels the body's task
        return _Streamed(_events(sess, shaper), sess.close)
    try:
        return shaper.whole([p async for p in sess.pieces()], sess.usage)
    finally:
        sess.close()


async def _events(sess: Session, shaper: Shaper):
    """Server-sent events: a chunk per committed piece of a choice, the usage in the last
    (and in every one with continuous_usage_stats), [DONE]; a failure of any choice
    mid-stream is an ``error`` event (what OpenAI's clients raise on), the end."""
    try:
        if shaper.chat:
            for chunk in shaper.role_chunks():
                yield chunk
        async for piece in sess.pieces():
            every = sess.done or sess.req.continuous_usage
            yield shaper.chunk(piece, sess.usage if every else None)
        if sess.req.include_usage:
            yield shaper.usage_chunk(sess.usage)
        yield DONE
    except APIError as exc:
        yield sse(exc.body())
    finally:
        sess.close()
