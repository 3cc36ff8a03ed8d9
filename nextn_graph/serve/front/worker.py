"""The server's handle on the engine loop, wherever a host runs it (a ``messages.Host``:
the engine's own process, or a thread of this one).

The asyncio side never calls the engine. It submits a request's jobs (one per choice,
each with a key), aborts them, drains and stops, by sending the host ``ToEngine``
commands. The host delivers ``FromEngine`` messages back (``take``, dispatched by
``match``): ``Ready`` with the engine's ``RequestLimits`` (the front makes its
``ModelInfo`` of them) or ``BuildFailed``, then one ``Report`` per turn, and ``Ended`` if
the engine ends on its own. A report's snapshot feeds the metrics on the thread it
arrives on (the engine thread, or the pipe's reader); its events reach their jobs on the
asyncio loop, in one ``call_soon_threadsafe`` per report. The job table is the asyncio
loop's alone (no lock).

An engine that ends on its own (its process killed, a segfault, the OOM killer; the
engine thread raising) fails every open job (500, with the reason: "the engine process
died (exit code -9)", an ``error`` event mid-stream); ``/health`` then answers 503 with
that reason, new requests get 503, and /metrics says so (``ready`` 0, nothing running
or waiting, no free row).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

from ...runtime.request_checks import RequestLimits
from ..messages import (Abort, Add, BuildFailed, Drain, Ended, EngineSnapshot, Event, Failure,
                        FromEngine, Host, JobEvent, Ready, Report, Ticket)
from .metrics import ServeMetrics
from .model_info import ModelInfo
from .protocol import Choice, GenRequest

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One engine request (one choice of an HTTP request), on the asyncio side."""

    req: GenRequest
    choice: Choice
    events: asyncio.Queue  # of (choice index, Event): one queue for a request's jobs
    key: int | None = None  # set when submitted

    def ticket(self) -> Ticket:
        r, c = self.req, self.choice
        return Ticket(self.key, r.prompts[c.prompt], r.engine_max_tokens, r.stop_ids,
                      c.sampling, r.logprobs.output, r.logprobs.engine_prompt)

    def deliver(self, event: Event) -> None:
        self.events.put_nowait((self.choice.index, event))


class EngineWorker:
    def __init__(self, host: Host, describe: Callable[[RequestLimits], ModelInfo],
                 metrics: ServeMetrics, on_failed: Callable[[], None]):
        self.host, self.metrics = host, metrics
        self._describe, self._on_failed = describe, on_failed
        self.info: ModelInfo | None = None  # set once the engine is captured
        self.failed: str | None = None  # why the engine could not be built
        self.dead: str | None = None  # why the engine ended on its own
        self.snapshot: EngineSnapshot | None = None  # the latest turn's
        self._jobs: dict[int, Job] = {}  # by key: submitted, not ended (asyncio side)
        self._keys = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start = 0.0

    # -- the asyncio side ------------------------------------------------------------
    def start(self) -> None:
        self._loop, self._start = asyncio.get_running_loop(), time.monotonic()
        self.host.start(self.take)

    def submit(self, jobs: list[Job]) -> None:
        """A request's jobs (its choices), admitted together."""
        if self.dead:  # (state.info() refuses first; this is the race with a death)
            return jobs[0].deliver(Failure(503, self.dead))
        for job in jobs:
            job.key = next(self._keys)
            self._jobs[job.key] = job
        self.host.send(Add(tuple(job.ticket() for job in jobs)))

    def abort(self, job: Job) -> None:
        """The client went away (or a stop string matched): free the request's row."""
        if self._jobs.pop(job.key, None) is not None:
            self.host.send(Abort(job.key))

    def drain(self, grace_s: float) -> None:
        self.host.send(Drain(grace_s))

    def stop(self, timeout_s: float = 30.0) -> None:
        self.host.stop(timeout_s)

    def _dispatch(self, events: tuple[JobEvent, ...]) -> None:
        for e in events:
            job = self._jobs.get(e.key)
            if job is None:  # aborted since
                continue
            if isinstance(e.event, Failure) or e.event.finished:
                del self._jobs[e.key]
            job.deliver(e.event)

    def _fail_all(self, failure: Failure) -> None:
        jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            job.deliver(failure)

    def _post(self, fn, arg) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed: the handlers are gone
            pass

    # -- the host's thread -----------------------------------------------------------
    def take(self, msg: FromEngine) -> bool:
        """One message of the host -> False when the front refuses a ready engine."""
        match msg:
            case Report():
                self._publish(msg)
            case Ready(limits=limits):
                return self._ready(limits)
            case BuildFailed(reason=reason):
                self._build_failed(reason)
            case Ended(reason=reason):
                self._ended(reason)
            case _:
                raise ValueError(f"unknown message {msg!r} from the engine's host")
        return True

    def _ready(self, limits: RequestLimits) -> bool:
        """The engine is built and captured; False when the front cannot serve it (its
        tokenizer or chat template does not load): the host then stops the engine."""
        try:
            self.info = self._describe(limits)
        except Exception as exc:
            self._build_failed(f"{type(exc).__name__}: {exc}")
            return False
        self.metrics.ready.set(1)
        log.warning("engine ready (%s, built and captured in %.1f s)", self.info.name,
                    time.monotonic() - self._start)
        return True

    def _build_failed(self, reason: str) -> None:
        """Health says why; requests get 503; the server stops."""
        self.failed = reason
        log.error("engine build failed: %s", reason)
        self._on_failed()

    def _publish(self, report: Report) -> None:
        self.snapshot = report.snapshot
        self.metrics.observe(report.snapshot)  # before the events: a client that has its
        if report.events:  # answer sees the engine counters of the step that made it
            self._post(self._dispatch, report.events)

    def _ended(self, reason: str) -> None:
        """The engine ended on its own: every open job fails, and so does what comes.
        Before it was ready, that is a failed start (the server stops)."""
        if self.info is None:
            return self._build_failed(reason)
        log.error("%s: failing every request", reason)
        self.dead = reason
        self.metrics.engine_ended()
        self._post(self._fail_all, Failure(500, reason))
