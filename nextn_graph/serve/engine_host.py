"""The two ways to host the engine loop (``loop.py``): its own process (the default of
``nextn-graph serve``), or a thread of the server's process (``--engine-thread``).

Either host builds the engine off the asyncio loop, after the server listens (``/health``
is 503 until capture is done), runs the same ``EngineLoop``, and hands what it publishes
to the ``EngineWorker``: ``ready(limits)`` (the engine's ``RequestLimits``), ``build_failed(reason)``, ``publish(report)``
once per turn, ``ended(reason)`` when the engine ends on its own.

``ProcessHost``: a ``spawn``ed process owns the device. Commands go down one pipe (a
thread in the engine process moves them onto the loop's queue, so a send never waits
for a step); each turn's report comes up the other, one message per turn, read by a
thread of the server. That reader sees the end of the pipe when the process is gone
(killed, a segfault, the OOM killer) and reports "the engine process died (exit code
N)". The engine process ignores SIGINT and SIGTERM: a Ctrl-C in the terminal, or a
SIGTERM to the whole group, reaches the server, which drains and then stops the engine
with a command; and it stops by itself when the server's end of the pipe closes.

Tensor parallelism: with ``parallel.tp`` N > 1 the engine process is rank 0 and spawns
ranks 1..N-1 (``launch.ranks.Followers``: they load, build and follow its engine, and
exit when it is gone); under torchrun the group is the server's own, and a
``ThreadHost`` runs rank 0's engine. Either way the loop's ``Inbox`` pings the
followers while idle, and the loop's end shuts them down.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import threading
from typing import TYPE_CHECKING, Callable

from ..parallel.group import TPGroup
from ..runtime.engine import SpecEngine
from .engine_process import EXIT_WAIT_S, EngineSpec, Inbox, engine_main, reason, shutdown
from .loop import EngineLoop

if TYPE_CHECKING:  # (worker.py imports the web side's metrics; the engine process need not)
    from .worker import EngineWorker

log = logging.getLogger(__name__)


class ThreadHost:
    """The engine loop on a thread of this process: it shares the interpreter lock with
    the HTTP side (uvicorn, JSON, tokenizing). ``group``: ``build`` makes rank 0's engine
    of that tensor-parallel group (under torchrun: the group lives in this process);
    the loop pings the followers while idle and shuts them down once it ends. Closing
    the group is the caller's, once the host stopped."""

    def __init__(self, build: Callable[[], SpecEngine],
                 prepare: Callable[[SpecEngine], None] | None = None,
                 group: TPGroup | None = None):
        self._build, self._prepare = build, prepare
        self._group = group or TPGroup.single()
        self._commands = Inbox(self._group)
        self.engine: SpecEngine | None = None  # once built (tests reach into it)
        self._thread: threading.Thread | None = None

    def start(self, worker: "EngineWorker") -> None:
        self._thread = threading.Thread(target=self._run, args=(worker,), name="nextn-engine",
                                        daemon=True)
        self._thread.start()

    def _run(self, worker: "EngineWorker") -> None:
        try:
            self.engine = self._build()
            if self._prepare is not None:
                self._prepare(self.engine)
        except Exception as exc:
            return worker.build_failed(reason(exc))
        if not worker.ready(self.engine.request_limits):
            return
        try:
            EngineLoop(self.engine, self._commands, worker.publish).run()
        except BaseException as exc:  # a bug, a lost group: no request is left hanging
            log.error("the engine thread raised", exc_info=exc)
            return worker.ended(f"the engine thread died ({reason(exc)[:300]})")
        shutdown(self._group)

    def send(self, command: tuple) -> None:
        self._commands.put(command)

    def stop(self, timeout_s: float) -> None:
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout_s)


class ProcessHost:
    """The engine loop in a process of its own (``multiprocessing``, ``spawn``). With
    ``parallel.tp`` N > 1 that process is rank 0 and starts the N - 1 follower ranks
    itself (``engine_main``), so it is not daemonic (a daemonic process may not have
    children): this process kills it at exit (``atexit``), and it stops by itself when
    its command pipe closes."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.process: multiprocessing.process.BaseProcess | None = None
        self._send_lock = threading.Lock()  # commands come from asyncio and from stop()
        self._stopping = False
        self._settled = False  # the build failed, the front refused the engine, or the
        # engine process said why it ended: its exit code adds nothing
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self, worker: "EngineWorker") -> None:
        ctx = multiprocessing.get_context("spawn")
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._reports, reports_out = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_main, name="nextn-engine", daemon=False,
                                   args=(self.spec, commands_in, reports_out))
        self.process.start()
        commands_in.close()  # the engine process's ends: closed here, so the reader
        reports_out.close()  # sees the end of the pipe once that process is gone
        atexit.register(self._kill)  # an engine process never outlives the server
        self._reader = threading.Thread(target=self._read, args=(worker,),
                                        name="nextn-engine-reader", daemon=True)
        self._reader.start()

    def send(self, command: tuple) -> None:
        with self._send_lock:
            try:
                self._commands.send(command)
            except OSError:  # the process is gone: the reader reports why
                pass

    def _read(self, worker: "EngineWorker") -> None:
        while True:
            try:
                kind, arg = self._reports.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # a message that does not unpickle: the pipe is lost
                log.error("the engine process's pipe broke", exc_info=exc)
                break
            try:
                self._take(worker, kind, arg)
            except Exception as exc:  # a bug on this side: say so, keep reading
                log.error("the engine's %s message could not be taken", kind, exc_info=exc)
        self._reports.close()
        self.process.join(EXIT_WAIT_S)
        if self.process.exitcode is None:  # the pipe closed, the process hangs on
            self._kill()
        code = self.process.exitcode
        if not (self._settled or (code == 0 and self._stopping)):
            worker.ended(f"the engine process died (exit code {code})")

    def _take(self, worker: "EngineWorker", kind: str, arg) -> None:
        if kind == "report":
            worker.publish(arg)
        elif kind == "ready":
            if not worker.ready(arg):
                self._settled = True
                self.send(("stop", None))
        elif kind == "failed":
            self._settled = True
            worker.build_failed(arg)
        elif kind == "ended":  # the loop raised (a lost tensor-parallel group)
            self._settled = True
            worker.ended(arg)
        else:
            raise ValueError(f"unknown message {kind!r} from the engine process")

    def stop(self, timeout_s: float) -> None:
        """Stop the loop (the requests left fail, 503) and wait for the process."""
        self._stopping = True
        if self.process is None:
            return
        self.send(("stop", None))
        self._reader.join(timeout_s)
        if self.process.is_alive():
            log.error("the engine process did not stop in %.0f s: killed", timeout_s)
            self._kill()
            self._reader.join(EXIT_WAIT_S)
        with self._send_lock:
            self._commands.close()
        atexit.unregister(self._kill)

    def _kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()  # (SIGTERM is ignored there: see the module docstring)
            self.process.join(EXIT_WAIT_S)
