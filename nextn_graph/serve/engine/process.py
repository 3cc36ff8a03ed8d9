"""The engine process's side of ``ProcessHost`` (``hosts.py``): ``engine_main``
builds the engine, says ready (or why not) and runs the engine loop until stopped; with
``parallel.tp`` N > 1 it is rank 0 and starts ranks 1..N-1 itself (``Followers``:
``follower_main`` loads, builds and follows), and shuts them down at the end. Also the
pieces both hosts use: the loop's ``Inbox`` (pinging idle followers) and ``shutdown``.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ...config import RunConfig
from ...errors import ParallelError
from ...launch import follower
from ...launch.follower import load_and_follow, ping, ping_every_s
from ...launch.ranks import Followers, close_group, exit_rank
from ...parallel.group import TPGroup
from ...runtime.engine import SpecEngine
from ..messages import BuildFailed, Ended, Ready, Stop, ToEngine
from .build import build_engine
from .loop import EngineLoop

log = logging.getLogger(__name__)

EXIT_WAIT_S = 10.0  # after its pipe closed, how long the engine process gets to exit


def reason(exc: BaseException) -> str:
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

    def get(self, block: bool = True, timeout: float | None = None) -> ToEngine:
        try:
            return super().get(block, timeout)
        except queue.Empty:
            if block and self._group.parallel and time.monotonic() >= self._next:
                ping(self._group)  # a follower gone: ParallelError, the loop ends
                self._next = time.monotonic() + self._every_s
            raise


def shutdown(group: TPGroup) -> None:
    """Rank 0, its loop over: end the followers' loops (those still there)."""
    try:
        follower.shutdown(group)
    except Exception as exc:  # a follower gone already: nothing left to tell
        log.warning("the followers' shutdown failed: %s", reason(exc))


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
                shutdown(group)
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

    def settle(message: Ready | BuildFailed) -> bool:  # one of them is sent, once
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
        engine = build_engine(spec.cfg, spec.plain, group)
        if spec.prepare is not None:
            spec.prepare(engine)
    except Exception as exc:
        dead = followers.dead() if followers is not None else None
        settle(BuildFailed(f"{dead}; rank 0: {reason(exc)}" if dead else reason(exc)))
        return None
    return (engine, group) if settle(Ready(engine.request_limits)) else None


def _watch_build(followers: Followers, settled: threading.Event, settle) -> None:
    """While the engine builds: a follower gone would leave rank 0 waiting in a
    collective until the group's timeout; say so and end the process now."""
    while not settled.wait(0.1):
        dead = followers.dead()
        if dead is not None and settle(BuildFailed(f"{dead} while the engine was being "
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
        EngineLoop(engine, inbox, reports.send).run()
    except BaseException as exc:  # (a lost group: its reason says it all)
        log.error("the engine loop raised", exc_info=None if isinstance(
            exc, ParallelError) else exc)
        try:
            reports.send(Ended(f"the engine loop died ({reason(exc)[:300]})"))
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
            inbox.put(Stop())
            return
