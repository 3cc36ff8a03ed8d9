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
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from ..config import RunConfig
from ..errors import ParallelError
from ..launch.follower import load_and_follow, ping, ping_every_s, shutdown
from ..launch.ranks import Followers, close_group, exit_rank
from ..parallel.group import TPGroup
from ..runtime.engine import SpecEngine
from .build import EngineFacts, build_engine
from .loop import EngineLoop

if TYPE_CHECKING:  # (worker.py imports the web side's metrics; the engine process need not)
    from .worker import EngineWorker

log = logging.getLogger(__name__)

EXIT_WAIT_S = 10.0  # after its pipe closed, how long the engine process gets to exit


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Inbox(queue.Queue):
    """The engine loop's command queue. On a tensor-parallel group, a blocking wait that
    finds nothing (the loop is idle: a server between requests) pings the followers at
    least every ``follower.ping_every_s``, since their receive is bounded by the group's
    timeout. Only the loop's thread gets, so a ping never meets the engine's messages."""

    def __init__(self, group: TPGroup):
        super().__init__()
        self._group = group
        self._every_s = ping_every_s(group) if group.parallel else 0.0
        self._next = time.monotonic() + self._every_s

    def get(self, block: bool = True, timeout: float | None = None) -> tuple:
        try:
            return super().get(block, timeout)
        except queue.Empty:
            if block and self._group.parallel and time.monotonic() >= self._next:
                ping(self._group)  # a follower gone: ParallelError, the loop ends
                self._next = time.monotonic() + self._every_s
            raise


def _shutdown(group: TPGroup) -> None:
    """Rank 0, its loop over: end the followers' loops (those still there)."""
    try:
        shutdown(group)
    except Exception as exc:  # a follower gone already: nothing left to tell
        log.warning("the followers' shutdown failed: %s", _reason(exc))


class ThreadHost:
    """The engine loop on a thread of this process: it shares the interpreter lock with
    the HTTP side (uvicorn, JSON, tokenizing). ``group``: ``build`` makes rank 0's engine
    of that tensor-parallel group (under torchrun: the group lives in this process);
    the loop pings the followers while idle and shuts them down once it ends. Closing
    the group is the caller's, once the host stopped."""

    def __init__(self, build: Callable[[], tuple[SpecEngine, EngineFacts]],
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
            self.engine, facts = self._build()
            if self._prepare is not None:
                self._prepare(self.engine)
        except Exception as exc:
            return worker.build_failed(_reason(exc))
        if not worker.ready(facts):
            return
        try:
            EngineLoop(self.engine, self._commands, worker.publish).run()
        except BaseException as exc:  # a bug, a lost group: no request is left hanging
            log.error("the engine thread raised", exc_info=exc)
            return worker.ended(f"the engine thread died ({_reason(exc)[:300]})")
        _shutdown(self._group)

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


def engine_main(spec: EngineSpec, commands, reports) -> None:
    """The engine process: build, say ready (or why not), run the loop until stopped.
    With ``parallel.tp`` N > 1 it is rank 0: it starts ranks 1..N-1 (``Followers``),
    which load and build alongside it, and shuts them down at the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level.upper(),
                        format="%(levelname)s:     [engine] %(message)s")
    if spec.cfg.device.split(":")[0] == "cpu":
        torch.set_num_threads(spec.threads)
    par = spec.cfg.parallel
    if par.tp == 1:
        built = _build(spec, reports, None)
        if built is not None:
            _run(*built, commands, reports)
        return
    followers = Followers(follower_main, par.tp, (spec.cfg,), spec.cfg.device, par.timeout_s,
                          spec.threads)
    status = 1
    try:
        built = _build(spec, reports, followers)
        if built is not None:
            engine, group = built
            if _run(engine, group, commands, reports):
                _shutdown(group)
                status = 0
            close_group(group, orderly=status == 0)
    finally:
        followers.end(EXIT_WAIT_S)
        reports.close()
        exit_rank(status)  # (not the interpreter's exit: see launch.ranks.exit_rank)


def follower_main(group: TPGroup, cfg: RunConfig) -> int:
    """A follower rank of the engine process (``serve --tp N``): load, follow rank 0 until
    it shuts down. Signals are rank 0's to act on, as in the engine process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return load_and_follow(group, cfg)


def _build(spec: EngineSpec, reports, followers: Followers | None):
    """Build the engine (rank 0 of the followers' group, when there are some) and say
    ready -> (engine, group); or say why not -> None. A follower that exits before the
    engine is ready fails the build at once (``_watch_build``), not after a timeout."""
    settled, lock = threading.Event(), threading.Lock()

    def settle(message: tuple) -> bool:  # one of "ready" / "failed" is sent, once
        with lock:
            if settled.is_set():
                return False
            settled.set()
            reports.send(message)
            return True

    if followers is not None:
        threading.Thread(target=_watch_build, args=(followers, settled, settle),
                         name="nextn-build-watch", daemon=True).start()
    try:
        group = followers.join() if followers is not None else TPGroup.single()
        engine, facts = build_engine(spec.cfg, spec.plain, group)
        if spec.prepare is not None:
            spec.prepare(engine)
    except Exception as exc:
        dead = followers.dead() if followers is not None else None
        settle(("failed", f"{dead}; rank 0: {_reason(exc)}" if dead else _reason(exc)))
        return None
    return (engine, group) if settle(("ready", facts)) else None


def _watch_build(followers: Followers, settled: threading.Event, settle) -> None:
    """While the engine builds: a follower gone would leave rank 0 waiting in a
    collective until the group's timeout; say so and end the process now."""
    while not settled.wait(0.1):
        dead = followers.dead()
        if dead is not None and settle(("failed", f"{dead} while the engine was being "
                                                  f"built")):
            followers.end(0.0)
            exit_rank(1)


def _run(engine: SpecEngine, group: TPGroup, commands, reports) -> bool:
    """The loop, until a stop (or the server's end of the pipe closing) -> True; False
    when it raised (a bug, a lost group), after saying why."""
    inbox = Inbox(group)
    threading.Thread(target=_forward, args=(commands, inbox), name="nextn-commands",
                     daemon=True).start()
    try:
        EngineLoop(engine, inbox, lambda report: reports.send(("report", report))).run()
    except BaseException as exc:  # (a lost group: its reason says it all)
        log.error("the engine loop raised", exc_info=None if isinstance(
            exc, ParallelError) else exc)
        try:
            reports.send(("ended", f"the engine loop died ({_reason(exc)[:300]})"))
        except OSError:  # the server is gone too
            pass
        return False
    return True


def _forward(commands, inbox: Inbox) -> None:
    """Commands from the pipe onto the loop's queue; the server gone is a stop."""
    while True:
        try:
            inbox.put(commands.recv())
        except (EOFError, OSError):
            inbox.put(("stop", None))
            return
