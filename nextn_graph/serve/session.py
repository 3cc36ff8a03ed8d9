"""One request's life on the asyncio side: its job on the engine thread, the text of
its output as it arrives (stop strings found there), its timings, and its end.

``Session.pieces()`` yields ``Piece``s as the engine commits tokens and ends with a
finish reason; a ``Failure`` from the engine thread becomes an ``APIError``. ``close()``
always runs (the handler's ``finally``): a request that has not ended by then lost its
client, so its engine request is aborted and its row freed at the next round.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from ..checkpoint.tokenizer import CheckpointTokenizer
from .errors import APIError
from .metrics import ServeMetrics
from .protocol import GenRequest
from .worker import EngineWorker, Failure, Job

DISCONNECT_POLL_S = 0.25  # a non-streamed request checks its client this often


class TextStream:
    """Detokenizes an output as it grows; text that might still become a stop string
    (or an incomplete UTF-8 character) is held back until it cannot.

    Incremental, as vLLM's and TGI's detokenizers: a push decodes only the window of ids
    since the prefix offset, ``ids[prefix:read]`` and ``ids[prefix:]``; the difference is
    the text of ``ids[read:]``. When it does not end in U+FFFD (a character still coming)
    it is final: the offsets move on (prefix to read, read to the end) and the window
    shrinks. The prefix keeps a little context before the new ids, for tokenizers whose
    decode of a piece depends on what precedes it. Special tokens, which decoding leaves
    out anyway, never enter the window (a run of EOS under ignore_eos cannot widen it);
    a window only grows while its text keeps ending in U+FFFD (bytes that are no UTF-8).
    Text and stops are exactly as when the whole output was decoded on every push, for
    byte-level tokenizers (the served one: a piece that starts on a character boundary
    decodes alike whatever precedes it; pending text before its trailing U+FFFD is final)."""

    def __init__(self, tokenizer: CheckpointTokenizer | None, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self._skip = tokenizer.special_ids if tokenizer is not None else frozenset()
        self._window: list[int] = []  # ids[prefix:], special tokens left out
        self._read = 0  # the read offset, in the window
        self._unsent = ""  # final text not given out yet
        self._ahead = 0  # characters of the pending text (of ids[read:]) given out already
        self._parts: list[str] = []  # everything given out
        self.decoded = 0  # ids decoded over all pushes (the work; bounded per push)
        self.stopped = False  # a stop string matched: the text ends before it

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def push(self, tokens: list[int], final: bool) -> str:
        """The new text that is safe to send."""
        if self.tokenizer is None:
            return ""
        self._window.extend(t for t in tokens if t not in self._skip)
        pending = self._pending(final)[self._ahead:]  # (this may move text to _unsent)
        view = self._unsent + pending  # the text not given out yet
        # (an earlier match would have been found: hold covers any stop's length - 1)
        found = [i for i in (view.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            return self._give(view, min(found))
        safe = len(view) if final else len(view) - self.hold
        while not final and safe > 0 and view[safe - 1] == "\ufffd":
            safe -= 1  # maybe the first bytes of a character still coming
        return self._give(view, max(safe, 0))

    def _pending(self, final: bool) -> str:
        """Decode the window; move the offsets on when its new text is final (always on
        the last push). Returns the text that is not final yet."""
        window, read = self._window, self._read
        before = self.tokenizer.decode(window[:read])
        text = self.tokenizer.decode(window)
        self.decoded += read + len(window)
        new = text[len(before):]
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return new
        self._unsent += new[self._ahead:]
        self._ahead = 0
        del window[:read]  # the prefix moves to the read offset,
        self._read = len(window)  # the read offset to the end
        return ""

    def _give(self, view: str, end: int) -> str:
        delta = view[:end]
        taken = min(end, len(self._unsent))
        self._unsent = self._unsent[taken:]
        self._ahead += end - taken  # (only with nothing final left unsent)
        self._parts.append(delta)
        return delta


@dataclass(frozen=True)
class Piece:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop | length, on the last piece


class Session:
    def __init__(self, req: GenRequest, worker: EngineWorker, metrics: ServeMetrics,
                 tokenizer: CheckpointTokenizer | None, on_close: Callable[[], None],
                 disconnected: Callable | None = None):
        self.req, self.worker, self.metrics = req, worker, metrics
        self.job = Job(req, asyncio.get_running_loop())
        self.text = TextStream(tokenizer, req.stop)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None  # stop | length | error, once ended
        self._on_close, self._disconnected = on_close, disconnected
        self._closed = False
        self._first = None  # the first event, once ``first_event`` has waited for it
        self.start = self._last = time.perf_counter()

    def submit(self) -> None:
        self.worker.submit(self.job)

    @property
    def usage(self) -> dict:
        n, m = len(self.req.prompt), len(self.tokens)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}

    def stop_polling(self) -> None:
        self._disconnected = None

    async def first_event(self) -> None:
        """Wait for the request's first event (its first tokens, or its refusal) before
        a stream's headers go out, so a refusal keeps its HTTP status (400, 503)."""
        event = self._first = await self._next()
        if isinstance(event, Failure):
            self.finish_reason = "error"
            raise APIError(event.status, event.message)

    async def _next(self):
        if self._first is not None:
            event, self._first = self._first, None
            return event
        if self._disconnected is None:
            return await self.job.events.get()
        while True:  # a non-streamed request: notice a client that went away
            try:
                return await asyncio.wait_for(self.job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await self._disconnected():  # (close() aborts the engine request)
                    raise APIError(499, "the client disconnected", code="client_closed")

    async def pieces(self) -> AsyncIterator[Piece]:
        while self.finish_reason is None:
            event = await self._next()
            if isinstance(event, Failure):
                self.finish_reason = "error"
                raise APIError(event.status, event.message,
                               code="engine_fault" if event.status == 500 else None)
            now = time.perf_counter()
            (self.metrics.itl if self.tokens else self.metrics.ttft).observe(
                now - (self._last if self.tokens else self.start))
            self._last = now
            toks = list(event.new_tokens)
            self.tokens.extend(toks)
            delta = self.text.push(toks, final=event.finished)
            if self.text.stopped:
                self.finish_reason = "stop"
                if not event.finished:  # the engine would go on: free the row now
                    self.worker.abort(self.job)
            elif event.finished:
                hit = bool(toks) and toks[-1] in self.req.stop_ids
                self.finish_reason = "stop" if hit else "length"
            yield Piece(delta, toks, self.finish_reason)

    def close(self) -> None:
        """Idempotent; runs when the handler ends, however it ends."""
        if self._closed:
            return
        self._closed = True
        reason = self.finish_reason
        if reason is None:  # the client went away mid-request
            self.worker.abort(self.job)
            reason = "cancelled"
        m = self.metrics
        m.requests.labels(reason).inc()
        m.prompt_tokens.inc(len(self.req.prompt))
        m.completion_tokens.labels(reason).inc(len(self.tokens))
        m.e2e.observe(time.perf_counter() - self.start)
        self._on_close()
