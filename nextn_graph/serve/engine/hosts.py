"""The two ways to host the engine loop (``loop.py``): its own process (the default of
``nextn-graph serve``), or a thread of the server's process (``--engine-thread``). Each is
a ``messages.Host``: the front starts it with its ``deliver``, sends it ``ToEngine``
commands, and stops it.

Either host builds the engine off the asyncio loop, after the server listens (``/health``
is 503 until capture is done), runs the same ``EngineLoop``, and delivers the same
``FromEngine`` messages: ``Ready`` (the engine's ``RequestLimits``) or ``BuildFailed``,
one ``Report`` per turn, ``Ended`` when the engine ends on its own.

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
from typing import Callable

from ...parallel.group import TPGroup
from ...runtime.engine import SpecEngine
from ..messages import BuildFailed, Deliver, Ended, Ready, Report, Stop, ToEngine
from .loop import EngineLoop
from .process import EXIT_WAIT_S, EngineSpec, Inbox, engine_main, reason, shutdown

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

    def start(self, deliver: Deliver) -> None:
        self._thread = threading.Thread(target=self._run, args=(deliver,), name="nextn-engine",
                                        daemon=True)
        self._thread.start()

    def _run(self, deliver: Deliver) -> None:
        try:
            self.engine = self._build()
            if self._prepare is not None:
                self._prepare(self.engine)
        except Exception as exc:
            deliver(BuildFailed(reason(exc)))
            return
        if not deliver(Ready(self.engine.request_limits)):
            return
        try:
            EngineLoop(self.engine, self._commands, deliver).run()
        except BaseException as exc:  # a bug, a lost group: no request is left hanging
            log.error("the engine thread raised", exc_info=exc)
            deliver(Ended(f"the engine thread died ({reason(exc)[:300]})"))
            return
        shutdown(self._group)

    def send(self, command: ToEngine) -> None:
        self._commands.put(command)

    def stop(self, timeout_s: float) -> None:
        self._commands.put(Stop())
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

    def start(self, deliver: Deliver) -> None:
        ctx = multiprocessing.get_context("spawn")
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._reports, reports_out = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_main, name="nextn-engine", daemon=False,
                                   args=(self.spec, commands_in, reports_out))
        self.process.start()
        commands_in.close()  # the engine process's ends: closed here, so the reader
        reports_out.close()  # sees the end of the pipe once that process is gone
        atexit.register(self._kill)  # an engine process never outlives the server
        self._reader = threading.Thread(target=self._read, args=(deliver,),
                                        name="nextn-engine-reader", daemon=True)
        self._reader.start()

    def send(self, command: ToEngine) -> None:
        with self._send_lock:
            try:
                self._commands.send(command)
            except OSError:  # the process is gone: the reader reports why
                pass

    def _read(self, deliver: Deliver) -> None:
        while True:
            try:
                msg = self._reports.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # a message that does not unpickle: the pipe is lost
                log.error("the engine process's pipe broke", exc_info=exc)
                break
            try:
                self._take(deliver, msg)
            except Exception as exc:  # a bug on this side: say so, keep reading
                log.error("the engine's %s message could not be taken", type(msg).__name__,
                          exc_info=exc)
        self._reports.close()
        self.process.join(EXIT_WAIT_S)
        if self.process.exitcode is None:  # the pipe closed, the process hangs on
            self._kill()
        code = self.process.exitcode
        if not (self._settled or (code == 0 and self._stopping)):
            deliver(Ended(f"the engine process died (exit code {code})"))

    def _take(self, deliver: Deliver, msg) -> None:
        match msg:
            case Ready():
                if not deliver(msg):  # the front cannot serve this engine
                    self._settled = True
                    self.send(Stop())
            case BuildFailed() | Ended():  # (Ended: the loop raised, a lost group)
                self._settled = True
                deliver(msg)
            case Report():
                deliver(msg)
            case _:
                raise ValueError(f"unknown message {msg!r} from the engine process")

    def stop(self, timeout_s: float) -> None:
        """Stop the loop (the requests left fail, 503) and wait for the process."""
        self._stopping = True
        if self.process is None:
            return
        self.send(Stop())
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
