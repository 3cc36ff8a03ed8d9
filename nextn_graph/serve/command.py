"""``nextn-graph serve``: the OpenAI-compatible server on uvicorn, loopback by default.

The server listens at once; the engine is built (load, build, capture) in its own
process (``--engine-thread``: on a thread of the server's), and ``/health`` is 503 until
the graphs are captured. SIGTERM (or Ctrl-C) stops admitting requests, lets the
ones in flight finish within ``--shutdown-grace`` seconds, fails the rest explicitly,
and exits 0 (Ctrl-C: 130, as every command).

Tensor parallelism (``--tp N``, YAML ``parallel.tp``): the engine process is rank 0 and
starts the other ranks itself. Under torchrun every process runs this command: rank 0
serves, with its engine on a thread of its own process (where the group is), and the
other ranks load and follow it until it shuts down; they never listen.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Callable

import uvicorn

import torch

from ..config import RunConfig, load_run_config
from ..errors import ConfigError, NextnGraphError
from ..launch.follower import load_and_follow
from ..launch.ranks import check_world_size, close_group, exit_rank, group_from_env
from ..parallel.group import TPGroup
from ..runtime.engine import SpecEngine
from .engine.build import build_engine
from .engine.hosts import ProcessHost, ThreadHost
from .engine.process import EngineSpec
from .front.app import create_app
from .front.http import head_timeout_protocol
from .front.limits import API_KEY_ENV, ServeSettings
from .front.model_info import describe


def serve_config(args: argparse.Namespace) -> RunConfig:
    pool = {"max_requests": args.max_requests, "max_context": args.max_context,
            "prefix_cache": args.prefix_cache}
    return load_run_config(args.config, checkpoint=args.checkpoint, kernels=args.kernels,
                           pool=pool,
                           scheduler={"prefill_token_budget": args.prefill_token_budget},
                           graph={"logprobs": args.max_logprobs,
                                  "penalties": args.penalties},
                           parallel={"tp": args.tp})


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    return ServeSettings(args.host, args.port, args.api_key or os.environ.get(API_KEY_ENV),
                         args.max_body_bytes, max(args.max_waiting, 0),
                         shutdown_grace_s=max(args.shutdown_grace, 0.0),
                         model_name=args.model_name,
                         engine="thread" if args.engine_thread else "process",
                         request_timeout_s=args.request_timeout or None,
                         body_timeout_s=args.body_timeout)


def engine_host(cfg: RunConfig, settings: ServeSettings, log_level: str,
                plain: bool = False, prepare: Callable[[SpecEngine], None] | None = None,
                group: TPGroup | None = None) -> ProcessHost | ThreadHost:
    """Where the engine runs (``settings.engine``). ``plain``: decode without the draft
    (``speculative`` None), for comparisons; ``prepare``: called with the engine once
    built, where it runs (a module-level function). ``group``: this process is rank 0 of
    a tensor-parallel group (torchrun), so the engine runs on a thread, where the group
    is; otherwise ``parallel.tp`` > 1 has the engine process start the other ranks."""
    if group is not None and group.parallel:
        return ThreadHost(lambda: build_engine(cfg, plain, group), prepare, group)
    if settings.engine == "thread":
        if cfg.parallel.tp > 1:
            raise ConfigError(f"--engine-thread (ServeSettings.engine 'thread') cannot serve "
                              f"--tp {cfg.parallel.tp} (parallel.tp): the engine process "
                              f"starts the other ranks; drop --engine-thread, or launch "
                              f"the ranks with torchrun")
        return ThreadHost(lambda: build_engine(cfg, plain), prepare)
    # the engine process takes this process's torch threads (set by --threads)
    return ProcessHost(EngineSpec(cfg, plain, torch.get_num_threads(), log_level, prepare))


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app when a signal starts the shutdown."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def make_server(cfg: RunConfig, settings: ServeSettings, log_level: str = "info",
                plain: bool = False, prepare: Callable[[SpecEngine], None] | None = None,
                group: TPGroup | None = None) -> uvicorn.Server:
    """The server, not yet running; an engine that fails to build stops it. ``group``:
    rank 0's tensor-parallel group under torchrun (``engine_host``)."""
    holder: list[uvicorn.Server] = []

    def stop() -> None:  # (uvicorn's documented way to stop a server from code)
        holder[0].should_exit = True

    app = create_app(settings, engine_host(cfg, settings, log_level, plain, prepare, group),
                     lambda limits: describe(cfg, settings.model_name, limits),
                     cfg.pool.max_requests, on_failed=stop)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on",
                            log_level=log_level,
                            http=head_timeout_protocol(settings.body_timeout_s),
                            # a backstop: the engine loop ends every request by the grace
                            timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 10)
    holder.append(_Server(config, app.state.serve.begin_drain))
    return holder[0]


def run_serve(args: argparse.Namespace) -> int:
    cfg = serve_config(args)  # a bad config is refused before anything starts
    group = group_from_env(cfg.device, cfg.parallel.timeout_s)  # launched by torchrun
    if group is None:
        return _serve(cfg, args)
    try:
        check_world_size(group, cfg.parallel.tp)
        if group.is_driver:
            status = _serve(cfg, args, group)
        else:  # no server: follow rank 0 (signals are its to act on) until it shuts down
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            load_and_follow(group, cfg)
            status = 0
    except BaseException:
        close_group(group, orderly=False)
        raise
    close_group(group)
    exit_rank(status)


def _serve(cfg: RunConfig, args: argparse.Namespace, group: TPGroup | None = None) -> int:
    """Serve until a signal stops the server -> 0; an engine that failed to start is an
    error (status 2)."""
    server = make_server(cfg, serve_settings(args), args.log_level, group=group)
    # uvicorn re-raises the signal it caught once it has shut down; the handler it
    # restores then is this one, so a SIGTERM ends the command with status 0
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = server.config.app.state.serve.worker.failed
    if failed:  # e.g. a missing or corrupt checkpoint: one line, status 2
        raise NextnGraphError(f"serve: the engine failed to start: {failed}")
    return 0
