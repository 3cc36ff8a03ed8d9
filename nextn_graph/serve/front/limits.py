"""What a request must pass before it costs anything: the API key, the body size and the
time it takes to arrive (and that it is JSON), and room in the server (rows in the pool
plus a bounded waiting queue)."""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import ClientDisconnect

from ...errors import InputError
from .errors import APIError

API_KEY_ENV = "NEXTN_GRAPH_API_KEY"  # a key kept off the command line (and ps)
ENGINE_HOSTS = ("process", "thread")  # where the engine loop runs (serve/engine/hosts.py)

if TYPE_CHECKING:  # the command line reads the defaults without the web libraries
    from starlette.requests import Request


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 1 << 20  # a request body larger than this is a 413
    max_waiting: int = 64  # requests queued beyond the pool's rows; more is a 429
    retry_after_s: int = 1  # the 429's Retry-After
    shutdown_grace_s: float = 30.0  # SIGTERM: requests in flight get this long to finish
    model_name: str | None = None  # the model id served (default: the checkpoint's name)
    # "process": the engine in its own process (the HTTP side keeps this one's interpreter
    # lock to itself); "thread": on a thread of the server's process
    engine: str = "process"
    # a request still running after this many seconds fails (504, or an error event in
    # its stream) and its engine requests are aborted; None: no limit
    request_timeout_s: float | None = None
    # a request head not all there this many seconds after the connection (or the next
    # request's first byte), or a body not all there this long after its head, is a 408
    # and the connection closes (a client that trickles or under-sends holds nothing)
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_HOSTS:
            raise InputError(f"ServeSettings.engine must be one of {ENGINE_HOSTS}, got "
                             f"{self.engine!r}")
        t = self.request_timeout_s
        if t is not None and not _seconds(t):
            raise InputError(f"ServeSettings.request_timeout_s must be a number of seconds "
                             f"> 0 or None, got {t!r}")
        if not _seconds(self.body_timeout_s):
            raise InputError(f"ServeSettings.body_timeout_s must be a number of seconds > 0, "
                             f"got {self.body_timeout_s!r}")


def _seconds(t: object) -> bool:
    return isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < math.inf


def check_api_key(header: str | None, key: str | None) -> None:
    """``Authorization: Bearer KEY``, compared in constant time; 401 otherwise."""
    if key is None:
        return
    given = (header or "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                       code="invalid_api_key")


async def read_body(request: "Request", limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413 as soon as it passes ``limit`` bytes (a declared
    Content-Length is checked before reading; a chunked body is counted as it comes),
    and with 408 when it is not all there within ``timeout_s`` (the connection closes:
    what is left of the body would be read as the next request)."""
    try:
        return await asyncio.wait_for(_read_body(request, limit), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="body_timeout", headers={"Connection": "close"}) from None


async def _read_body(request: "Request", limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_big = APIError(413, f"the request body exceeds {limit} bytes",
                       code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    parts, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            parts.append(chunk)
    except ClientDisconnect:  # gone before its body was read: nothing to answer, no fault
        raise APIError(499, "the client disconnected before its body was read",
                       code="client_closed") from None
    return b"".join(parts)


async def read_json(request: "Request", settings: ServeSettings) -> object:
    """The body (within the settings' size and time limits) parsed as JSON; 400 when it
    is not JSON."""
    raw = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # (nesting deeper than the parser goes)
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None


class Admission:
    """Engine requests in flight on the server (a request's choices: prompts x n; asyncio
    side only, so no lock): at most the pool's rows plus ``max_waiting``; past that a
    429 with ``Retry-After``. A request larger than that is let in alone (nothing else in
    flight): its choices queue in the engine, as any others would."""

    def __init__(self, rows: int, max_waiting: int, retry_after_s: int):
        self.capacity = rows + max_waiting
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    def enter(self, count: int = 1) -> None:
        if self.in_flight and self.in_flight + count > self.capacity:
            raise APIError(429, f"the server is full ({self.in_flight} requests in flight); "
                                f"retry later", code="queue_full",
                           headers={"Retry-After": str(self.retry_after_s)})
        self.in_flight += count

    def leave(self, count: int = 1) -> None:
        self.in_flight -= count
