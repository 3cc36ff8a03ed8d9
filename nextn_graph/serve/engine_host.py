"""The two ways to host the engine loop (``loop.py``): its own process (the default of
``nextn-graph serve``), or a thread of the server's process (``--engine-thread``).

Either host builds the engine off the asyncio loop, after the server listens (``/health``
is 503 until capture is done), runs the same ``EngineLoop``, and hands what it publishes
to the ``EngineWorker``: ``ready(facts)``, ``build_failed(reason)``, ``publish(report)``
once per turn, ``ended(reason)`` when the engine ends on its own.

``ProcessHost``: a ``spawn``ed process owns the device. Commands go down one pipe (a
thread in the engine process moves them onto the loop's queue, so a send never waits
for a step); each turn's report comes up the other, one message per turn, read by a
thread of the server. That reader sees the end of the pipe when the process is gone
(killed, a segfault, the OOM killer) and reports "the engine process died (exit code
N)". The engine process ignores SIGINT and SIGTERM: a Ctrl-C in the terminal, or a
SIGTERM to the whole group, reaches the server, which drains and then stops the engine
with a command; and it stops by itself when the server's end of the pipe closes.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import queue
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..config import RunConfig
from ..runtime.engine import SpecEngine
from .build import EngineFacts, build_engine
from .loop import EngineLoop

if TYPE_CHECKING:  # (worker.py imports the web side's metrics; the engine process need not)
    from .worker import EngineWorker

log = logging.getLogger(__name__)

EXIT_WAIT_S = 10.0  # after its pipe closed, how long the engine process gets to exit


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ThreadHost:
    """The engine loop on a thread of this process: it shares the interpreter lock with
    the HTTP side (uvicorn, JSON, tokenizing)."""

    def __init__(self, build: Callable[[], tuple[SpecEngine, EngineFacts]],
                 prepare: Callable[[SpecEngine], None] | None = None):
        self._build, self._prepare = build, prepare
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.engine: SpecEngine | None = None  # once built (tests reach into it)
        self._thread: threading.Thread | None = None

    def start(self, worker: "EngineWorker") -> None:
        self._thread = threading.Thread(target=self._run, args=(worker,), name="nextn-engine",
                                        daemon=True)
        self._thread.start()

    def _run(self, worker: "EngineWorker") -> None:
        try:
            self.engine, facts = self._build()
            if self._prepare is not None:
                self._prepare(self.engine)
        except Exception as exc:
            return worker.build_failed(_reason(exc))
        if not worker.ready(facts):
            return
        try:
            EngineLoop(self.engine, self._commands, worker.publish).run()
        except BaseException as exc:  # a bug in the loop: no request is left hanging
            log.error("the engine thread raised", exc_info=exc)
            worker.ended(f"the engine thread died ({_reason(exc)[:300]})")

    def send(self, command: tuple) -> None:
        self._commands.put(command)

    def stop(self, timeout_s: float) -> None:
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout_s)


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds its engine from (picklable)."""

    cfg: RunConfig
    plain: bool  # decode without the draft
    threads: int  # torch intra-op threads on a CPU device (the server's setting)
    log_level: str  # the server's (uvicorn's names: warning, info, ...)
    # called with the engine once built, in the engine process (a module-level function:
    # it is pickled by name); the tests place their faults with it
    prepare: Callable[[SpecEngine], None] | None = None


class ProcessHost:
    """The engine loop in a process of its own (``multiprocessing``, ``spawn``)."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.process: multiprocessing.process.BaseProcess | None = None
        self._send_lock = threading.Lock()  # commands come from asyncio and from stop()
        self._stopping = False
        self._settled = False  # the build failed, or the front refused the engine
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self, worker: "EngineWorker") -> None:
        ctx = multiprocessing.get_context("spawn")
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._reports, reports_out = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_main, name="nextn-engine", daemon=True,
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
        if not (code == 0 and (self._stopping or self._settled)):
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


def engine_main(spec: EngineSpec, commands, reports) -> None:
    """The engine process: build, say ready (or why not), run the loop until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(),
                        format="%(levelname)s:     [engine] %(message)s")
    if spec.cfg.device.split(":")[0] == "cpu":
        torch.set_num_threads(spec.threads)
    try:
        engine, facts = build_engine(spec.cfg, spec.plain)
        if spec.prepare is not None:
            spec.prepare(engine)
    except Exception as exc:
        reports.send(("failed", _reason(exc)))
        return
    reports.send(("ready", facts))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_forward, args=(commands, inbox), name="nextn-commands",
                     daemon=True).start()
    EngineLoop(engine, inbox, lambda report: reports.send(("report", report))).run()


def _forward(commands, inbox: queue.SimpleQueue) -> None:
    """Commands from the pipe onto the loop's queue; the server gone is a stop."""
    while True:
        try:
            inbox.put(commands.recv())
        except (EOFError, OSError):
            inbox.put(("stop", None))
            return
