"""The HTTP/1.1 connection: uvicorn's h11 protocol with a deadline on the request head.

uvicorn times out an idle keep-alive connection, but not one that is sending a request
head: a client that opens a connection and trickles its headers (or sends nothing, or
one byte after a response) holds a connection and its buffers for as long as it likes.
Here a request head must be complete within ``timeout_s`` of the connection opening, or
of the first byte of the next request on a kept-alive connection; past that the server
answers 408 (the same JSON error as a late body, ``limits.read_body``) and closes.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def head_timeout_protocol(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class whose connections give a request head ``timeout_s``
    seconds (``uvicorn.Config(http=...)``)."""

    class HeadTimeoutH11(H11Protocol):
        head_timeout_s = timeout_s

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # a head under way (or awaited)
                self._arm_head_timer()
            else:
                self._disarm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.our_state is not h11.IDLE:  # a response still being written
                return
            self.transport.write(late_head_response(self.head_timeout_s))
            self.transport.close()

    return HeadTimeoutH11


def late_head_response(timeout_s: float) -> bytes:
    """The raw 408 (h11 sends no response before a request head: written as bytes)."""
    body = json.dumps({"error": {
        "message": f"the request head did not arrive within {timeout_s:g} s",
        "type": "invalid_request_error", "param": None, "code": "head_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body
