"""One request's life on the asyncio side: one engine request per choice (its ``Job``, run
by the engine loop), the text of each choice's output as it arrives (stop strings found
there), its logprobs, timings, and the end of them all.

``Session.pieces()`` yields ``Piece``s, each what one engine event added to one choice,
until every choice has its finish reason. A ``Failure`` of any choice fails the whole
request: it becomes an ``APIError``, and ``close()`` aborts the other choices. ``close()``
always runs (the handler's ``finally``): a choice that has not ended by then lost its
client (or a sibling failed), so its engine request is aborted and its row freed at the
next round. No choice is left running.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from ...checkpoint.tokenizer import CheckpointTokenizer
from ...runtime.request import StepOutput, TokenLogprob
from ..messages import Failure
from .detokenize import TextStream
from .errors import APIError
from .metrics import ServeMetrics
from .protocol import GenRequest
from .worker import EngineWorker, Job

DISCONNECT_POLL_S = 0.25  # a non-streamed request checks its client this often


@dataclass(frozen=True)
class Piece:
    """What one engine event added to one choice."""

    index: int  # the choice's
    text: str  # the new text that is safe to send
    token_ids: list[int]  # committed in the event
    logprobs: tuple[TokenLogprob, ...] | None  # one per token id, when asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None  # first piece, when asked
    finish_reason: str | None  # stop | length, on the choice's last piece

    @staticmethod
    def join(pieces: list["Piece"]) -> "Piece":
        """One choice's pieces as one (a whole response)."""
        logprobs = None if pieces[0].logprobs is None else tuple(
            e for p in pieces for e in p.logprobs)
        return Piece(pieces[0].index, "".join(p.text for p in pieces),
                     [t for p in pieces for t in p.token_ids], logprobs,
                     pieces[0].prompt_logprobs, pieces[-1].finish_reason)


class _Run:
    """One choice: its job, its output so far, its end."""

    def __init__(self, job: Job, tokenizer: CheckpointTokenizer | None):
        self.job = job
        self.text = TextStream(tokenizer, job.req.stop)
        self.tokens: list[int] = []
        self.started = False  # an event came
        self.last: float | None = None  # when the last event came
        self.finish_reason: str | None = None  # stop | length | error, once ended
        self.cached = 0  # prompt tokens the engine's prefix cache served (first event)

    def take(self, event: StepOutput) -> Piece:
        """The event's piece; an ``APIError`` (500) when the engine left out logprobs
        that were asked."""
        req, toks = self.job.req, list(event.new_tokens)
        ask, first = req.logprobs, not self.started
        self.started = True
        if first:
            self.cached = event.cached_tokens or 0
        logprobs = prompt = None
        if ask.output is not None:
            logprobs = _checked(event.logprobs, len(toks), "logprobs")
        if ask.engine_prompt is not None and first:
            prompt = _checked(event.prompt_logprobs, len(req.prompts[self.job.choice.prompt]),
                              "prompt_logprobs")
        if req.echo_only:  # the one token made so the prefill runs shows nowhere (no text,
            # ids, logprobs or usage; a stop token or not, the choice ends as length)
            toks, logprobs = [], None if logprobs is None else ()
        self.tokens.extend(toks)
        delta = self.text.push(toks, final=event.finished)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif event.finished:
            hit = bool(toks) and toks[-1] in req.stop_ids
            self.finish_reason = "stop" if hit else "length"
        return Piece(self.job.choice.index, delta, toks, logprobs, prompt, self.finish_reason)


def _checked(entries: tuple | None, count: int, what: str) -> tuple:
    if entries is None or len(entries) != count:
        got = "none" if entries is None else len(entries)
        raise APIError(500, f"the engine returned {got} {what} for {count} tokens",
                       code="engine_fault")
    return entries


class Session:
    def __init__(self, req: GenRequest, worker: EngineWorker, metrics: ServeMetrics,
                 tokenizer: CheckpointTokenizer | None, on_close: Callable[[], None],
                 disconnected: Callable | None = None, timeout_s: float | None = None):
        self.req, self.worker, self.metrics = req, worker, metrics
        self.events: asyncio.Queue = asyncio.Queue()  # of (choice index, Event)
        self.runs = [_Run(Job(req, c, self.events), tokenizer) for c in req.choices()]
        self.failed = False  # a choice failed: the request did
        self._on_close, self._disconnected = on_close, disconnected
        self._closed = False
        self._first = None  # the first event, once ``first_event`` has waited for it
        self.start = time.perf_counter()
        self.timeout_s = timeout_s  # the server's --request-timeout (None: none)
        self.timed_out = False

    def submit(self) -> None:
        self.worker.submit([run.job for run in self.runs])

    @property
    def done(self) -> bool:
        return all(run.finish_reason is not None for run in self.runs)

    @property
    def usage(self) -> dict:
        """Every prompt's tokens once, every choice's output (as vLLM counts); of the
        prompt tokens, those the prefix cache served (each prompt's best choice)."""
        n = sum(len(p) for p in self.req.prompts)
        m = sum(len(run.tokens) for run in self.runs)
        cached: dict[int, int] = {}
        for run in self.runs:
            i = run.job.choice.prompt
            cached[i] = max(cached.get(i, 0), run.cached)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    def stop_polling(self) -> None:
        self._disconnected = None

    async def first_event(self) -> None:
        """Wait for the request's first event (its first tokens, or its refusal) before
        a stream's headers go out, so a refusal keeps its HTTP status (400, 503). (The
        engine loop admits a request's choices together: a refusal comes first.)"""
        index, event = self._first = await self._next()
        if isinstance(event, Failure):
            raise self._fail(self.runs[index], event.status, event.message, param=event.param)

    def _fail(self, run: _Run, status: int, message: str, code: str | None = None,
              param: str | None = None) -> APIError:
        run.finish_reason, self.failed = "error", True
        return APIError(status, message, param,
                        code=code or ("engine_fault" if status == 500 else None))

    async def _next(self) -> tuple[int, object]:
        if self._first is not None:
            event, self._first = self._first, None
            return event
        if self._disconnected is None and self.timeout_s is None:
            return await self.events.get()
        while True:  # notice a client that went away (non-streamed) and the deadline
            wait = DISCONNECT_POLL_S if self._disconnected is not None else None
            if self.timeout_s is not None:
                left = self.start + self.timeout_s - time.perf_counter()
                wait = left if wait is None else min(wait, left)
            try:
                return await asyncio.wait_for(self.events.get(), max(wait, 0))
            except asyncio.TimeoutError:
                if self.timeout_s is not None and \
                        time.perf_counter() >= self.start + self.timeout_s:
                    self.timed_out = True  # (close() aborts the engine requests)
                    raise APIError(504, f"the request ran past the server's request "
                                        f"timeout of {self.timeout_s:g} s", code="timeout")
                if self._disconnected is not None and await self._disconnected():
                    raise APIError(499, "the client disconnected", code="client_closed")

    async def pieces(self) -> AsyncIterator[Piece]:
        while not self.done:
            index, event = await self._next()
            run = self.runs[index]
            if run.finish_reason is not None:  # stopped by a stop string: rounds in flight
                continue
            if isinstance(event, Failure):
                raise self._fail(run, event.status, event.message, param=event.param)
            now = time.perf_counter()
            (self.metrics.itl if run.started else self.metrics.ttft).observe(
                now - (run.last if run.started else self.start))
            run.last = now
            try:
                piece = run.take(event)
            except APIError as exc:
                raise self._fail(run, exc.status, exc.message, exc.code) from None
            if run.text.stopped and not event.finished:  # the engine would go on
                self.worker.abort(run.job)  # free the row now
            yield piece

    def close(self) -> None:
        """Idempotent; runs when the handler ends, however it ends."""
        if self._closed:
            return
        self._closed = True
        m = self.metrics
        for run in self.runs:
            reason = run.finish_reason
            if reason is None:  # the client went away mid-request, or a sibling failed
                self.worker.abort(run.job)
                reason = "timeout" if self.timed_out else "error" if self.failed else \
                    "cancelled"
            m.requests.labels(reason).inc()
            m.completion_tokens.labels(reason).inc(len(run.tokens))
        m.prompt_tokens.inc(self.usage["prompt_tokens"])
        m.e2e.observe(time.perf_counter() - self.start)
        self._on_close()
