"""The engine loop: the one place that calls the engine (``add_request``, ``step``,
``abort``), wherever it is hosted (``hosts``: a thread of the server, or a process of
its own; the loop knows neither).

It takes commands (``messages.ToEngine``: ``Add``, ``Abort``, ``Drain``, ``Stop``) from a
queue between steps, steps while there is work, and after each turn that did anything
publishes one ``Report``: the turn's events (each engine request's ``StepOutput``s, or
its ``Failure``, by job key) and an ``EngineSnapshot`` for the metrics. One message per
turn, however many requests it served.

Draining (SIGTERM): new requests are refused with 503; requests in flight run on until
the grace period ends, and then each still running fails explicitly (503, "shutting
down"), its row aborted. Nothing is dropped without an event.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

from ...errors import InputError, without_paths
from ...runtime.engine import SpecEngine
from ...runtime.request import StepOutput
from ..messages import (Abort, Add, Drain, Event, Failure, JobEvent, Report, Stop, Ticket,
                        api_param)
from .snapshot import Snapshots

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # how often an idle loop looks at the drain deadline


class EngineLoop:
    def __init__(self, engine: SpecEngine, commands: queue.SimpleQueue,
                 publish: Callable[[Report], None]):
        self.engine = engine
        self._commands, self._publish = commands, publish
        self._rids: dict[int, int] = {}  # job key -> engine rid: added, not ended
        self._keys: dict[int, int] = {}  # engine rid -> job key
        self._events: list[JobEvent] = []  # this turn's
        self._outs: list[StepOutput] = []  # this turn's step outputs (for the snapshot)
        self._busy = False  # this turn took a command or stepped
        self._deadline: float | None = None  # draining: fail what is left at this time
        self._snapshots = Snapshots(engine)

    def run(self) -> None:
        """Turns until a stop command; the requests left then fail (503)."""
        while self._take_commands():
            self._expire()
            if self.engine.has_work:
                self._step()
            if self._busy or self._events:
                self._flush()
        for key in list(self._rids):
            self._end(key, Failure(503, "the server stopped before the request finished"))
        self._flush()

    def _flush(self) -> None:
        snapshot = self._snapshots.take(self._outs, self._commands.qsize(), len(self._rids))
        events, self._events, self._outs, self._busy = self._events, [], [], False
        self._publish(Report(tuple(events), snapshot))

    def _take_commands(self) -> bool:
        """Run every queued command (block briefly when idle); False on stop."""
        block = not self.engine.has_work
        while True:
            try:
                command = self._commands.get(block, IDLE_POLL_S) if block else \
                    self._commands.get_nowait()
            except queue.Empty:
                return True
            block, self._busy = False, True
            match command:
                case Stop():
                    return False
                case Add(tickets=tickets):
                    self._add(tickets)
                case Abort(key=key):
                    self._abort(key)
                case Drain(grace_s=grace_s):
                    self._deadline = time.monotonic() + grace_s
                case _:
                    raise ValueError(f"engine loop: unknown command {command!r}")

    def _abort(self, key: int) -> None:
        rid = self._rids.pop(key, None)
        if rid is not None:
            del self._keys[rid]
            self.engine.abort(rid)

    def _add(self, tickets: tuple[Ticket, ...]) -> None:
        """Admit a request's choices all, or none: one refused (its ``Failure`` sent)
        aborts those of its siblings already added."""
        if self._deadline is not None:
            return self._events.append(JobEvent(tickets[0].key,
                                                Failure(503, "the server is shutting down")))
        for ticket in tickets:
            failure = self._add_one(ticket)
            if failure is not None:
                for added in tickets:
                    self._abort(added.key)
                return self._events.append(JobEvent(ticket.key, failure))

    def _add_one(self, t: Ticket) -> Failure | None:
        try:
            rid = self.engine.add_request(list(t.prompt), t.max_tokens, t.stop_ids,
                                          t.sampling, t.logprobs, t.prompt_logprobs)
        except InputError as exc:
            return Failure(400, str(exc), api_param(exc.field))
        except Exception as exc:  # a broken engine (a failed tensor-parallel group)
            return Failure(500, without_paths(f"{type(exc).__name__}: {exc}"))
        self._rids[t.key], self._keys[rid] = rid, t.key
        return None

    def _expire(self) -> None:
        if self._deadline is None or time.monotonic() < self._deadline:
            return
        for key, rid in list(self._rids.items()):
            self.engine.abort(rid)
            self._end(key, Failure(503, "the server shut down before the request finished "
                                        "(shutdown grace period over)"))

    def _step(self) -> None:
        self._busy = True
        try:
            outs = self.engine.step()
        except Exception as exc:  # not one request's fault: every request in it fails
            log.error("engine step failed", exc_info=exc)
            for key, rid in list(self._rids.items()):
                self.engine.abort(rid)
                self._end(key, Failure(500, without_paths(
                    f"engine step failed: {type(exc).__name__}: {str(exc)[:300]}")))
            return
        self._outs.extend(outs)
        for out in outs:
            key = self._keys.get(out.rid)
            if key is None:  # aborted since
                continue
            if out.error is not None:
                self._end(key, Failure(500, without_paths(out.error)))
            elif out.finished:
                self._end(key, out)
            else:
                self._events.append(JobEvent(key, out))

    def _end(self, key: int, event: Event) -> None:
        rid = self._rids.pop(key, None)
        self._keys.pop(rid, None)
        self._events.append(JobEvent(key, event))
