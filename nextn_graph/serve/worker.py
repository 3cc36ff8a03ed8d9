"""The engine thread: the one thread that touches the engine.

The asyncio side never calls the engine. It sends commands (add, abort, drain, stop)
through a thread-safe queue; the thread admits them between steps, steps while there
is work, and hands each engine request's ``StepOutput``s (or a ``Failure``) to its HTTP
request's asyncio queue with ``loop.call_soon_threadsafe``. An HTTP request is one
engine request per choice (a ``Job`` each), added in one command: all, or none. The engine is built on this thread
after the server is listening, so ``/health`` answers 503 until capture is done.

Draining (SIGTERM): new requests are refused with 503; requests in flight run on until
the grace period ends, and then each still running fails explicitly (503, "shutting
down"), its row aborted. Nothing is dropped without an event.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import InputError
from ..runtime.engine import SpecEngine
from ..runtime.request import StepOutput
from .metrics import ServeMetrics
from .protocol import Choice, GenRequest, ModelInfo

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often an idle thread looks at the drain deadline


@dataclass(frozen=True)
class Failure:
    """The end of a request that did not complete: an HTTP status and why."""

    status: int
    message: str


Event = StepOutput | Failure


@dataclass(eq=False)
class Job:
    """One engine request (one choice of an HTTP request) between its handler (asyncio)
    and the engine thread."""

    req: GenRequest
    choice: Choice
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue  # of (choice index, Event): one queue for a request's jobs
    rid: int | None = None  # the engine's id, set on the engine thread

    def deliver(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.choice.index, event))
        except RuntimeError:  # the loop is closed: the handler is gone
            pass


class EngineWorker:
    def __init__(self, build: Callable[[], tuple[SpecEngine, ModelInfo]],
                 metrics: ServeMetrics, on_failed: Callable[[], None]):
        self._build, self._on_failed = build, on_failed
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.engine: SpecEngine | None = None
        self.info: ModelInfo | None = None  # set once the engine is captured
        self.failed: str | None = None  # why the engine could not be built
        self._jobs: dict[int, Job] = {}  # by engine rid: added, not finished
        self._deadline: float | None = None  # draining: fail what is left at this time
        self._thread = threading.Thread(target=self._run, name="nextn-engine", daemon=True)

    # -- the asyncio side ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, jobs: list[Job]) -> None:
        """A request's jobs (its choices), admitted together."""
        self._commands.put(("add", jobs))

    def abort(self, job: Job) -> None:
        """The client went away (or a stop string matched): free the request's row."""
        self._commands.put(("abort", job))

    def drain(self, grace_s: float) -> None:
        self._commands.put(("drain", grace_s))

    def stop(self, timeout_s: float = 30.0) -> None:
        self._commands.put(("stop", None))
        self._thread.join(timeout_s)

    @property
    def pending(self) -> int:
        return self._commands.qsize()

    # -- the engine thread -----------------------------------------------------------
    def _run(self) -> None:
        start = time.monotonic()
        try:
            self.engine, self.info = self._build()
        except Exception as exc:  # health says why; requests get 503
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("engine build failed: %s", self.failed)
            self._on_failed()
            return
        self.metrics.bind_engine(self.engine)
        log.warning("engine ready (%s, built and captured in %.1f s)", self.info.name,
                    time.monotonic() - start)
        while True:
            if not self._take_commands():
                break
            self._expire()
            if self.engine.has_work:
                self._step()
        for job in list(self._jobs.values()):
            self._end(job, Failure(503, "the server stopped before the request finished"))

    def _take_commands(self) -> bool:
        """Run every queued command (block briefly when idle); False on stop."""
        block = not self.engine.has_work
        while True:
            try:
                kind, arg = self._commands.get(block, IDLE_POLL_S) if block else \
                    self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                if arg.rid is not None and self._jobs.pop(arg.rid, None) is not None:
                    self.engine.abort(arg.rid)
            elif kind == "drain":
                self._deadline = time.monotonic() + arg

    def _add(self, jobs: list[Job]) -> None:
        """Admit a request's choices all, or none: one refused (its ``Failure`` sent)
        aborts those of its siblings already added."""
        if self._deadline is not None:
            return jobs[0].deliver(Failure(503, "the server is shutting down"))
        for job in jobs:
            failure = self._add_one(job)
            if failure is not None:
                for added in jobs:
                    if added.rid is not None and self._jobs.pop(added.rid, None) is not None:
                        self.engine.abort(added.rid)
                return job.deliver(failure)

    def _add_one(self, job: Job) -> Failure | None:
        r, c = job.req, job.choice
        try:
            job.rid = self.engine.add_request(list(r.prompts[c.prompt]), r.max_tokens,
                                              r.stop_ids, c.sampling, r.logprobs.output,
                                              r.logprobs.engine_prompt)
        except InputError as exc:
            return Failure(400, str(exc))
        except Exception as exc:  # a broken engine (a failed tensor-parallel group)
            return Failure(500, f"{type(exc).__name__}: {exc}")
        self._jobs[job.rid] = job
        return None

    def _expire(self) -> None:
        if self._deadline is None or time.monotonic() < self._deadline:
            return
        for job in list(self._jobs.values()):
            self.engine.abort(job.rid)
            self._end(job, Failure(503, "the server shut down before the request finished "
                                        "(shutdown grace period over)"))

    def _step(self) -> None:
        before = self.metrics.before_step(self.engine)
        try:
            outs = self.engine.step()
        except Exception as exc:  # not one request's fault: every request in it fails
            log.error("engine step failed", exc_info=exc)
            for job in list(self._jobs.values()):
                self.engine.abort(job.rid)
                self._end(job, Failure(500, f"engine step failed: {type(exc).__name__}: "
                                            f"{str(exc)[:300]}"))
            return
        self.metrics.after_step(self.engine, before, outs, self.pending,
                                len(self._jobs))
        for out in outs:
            job = self._jobs.get(out.rid)
            if job is None:  # aborted since
                continue
            if out.error is not None:
                self._end(job, Failure(500, out.error))
            elif out.finished:
                self._end(job, out)
            else:
                job.deliver(out)

    def _end(self, job: Job, event: Event) -> None:
        self._jobs.pop(job.rid, None)
        job.deliver(event)

