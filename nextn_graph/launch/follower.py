"""The loop of every tensor-parallel rank but 0: do what rank 0 decided, until told to stop.

Rank 0 runs the user's program (a server, ``generate``, the bench) and its engines
send each decision over the group's ``Channel``, one message each
(``parallel/messages.py``, dispatched here by ``match``): build an engine (every rank
then builds and captures the same one), prefill prompt chunks into rows (and the pages
rank 0 gave them), grow page tables, run a round over slots, run a mirrored call
(reference decoding), ping (an idle server: rank 0 is alive), shut down. A follower
never reads tokens back and never decides
(``follow_prefill``, ``follow_round``): its state follows rank 0's exactly because
every forward is the same and every collective result is the same on every rank.

A receive that fails (rank 0 died or hung past the timeout) ends the loop with a
``ParallelError``, so no follower outlives its driver.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..checkpoint.loader import LoadedModel
from ..errors import ParallelError
from ..parallel.group import TPGroup
from ..parallel.messages import (BuildEngine, GrowTables, MirrorCall, Ping, PrefillChunks,
                                 RunRound, Shutdown)
from ..runtime.engine import SpecEngine
from ..runtime.prefill_work import PrefillWork
from ..runtime.generate import plain_generate, reference_generate
from .ranks import load_on_ranks

log = logging.getLogger(__name__)

PING_S = 5.0  # an idle rank 0 pings its followers at least this often (``ping``)

# Calls rank 0 may mirror: each is deterministic given its arguments and the models,
# so every rank takes the same host decisions from the same (all-gathered) logits.
MIRRORED: dict[str, Callable] = {
    "reference_generate": lambda models, *a, **k: reference_generate(models.target, *a, **k),
    "plain_generate": lambda models, *a, **k: plain_generate(models.target, *a, **k),
}


def mirror(group: TPGroup, models: LoadedModel, name: str, *args, **kwargs):
    """Run ``MIRRORED[name]`` on every rank: rank 0 tells the others, then runs it too."""
    if group.parallel:
        group.channel.send(MirrorCall(name, args, kwargs))
    return MIRRORED[name](models, *args, **kwargs)


def shutdown(group: TPGroup) -> None:
    """Rank 0: end the followers' loops (at the end of the program)."""
    if group.parallel and group.is_driver:
        group.channel.send(Shutdown())


def ping_every_s(group: TPGroup) -> float:
    """How often an idle rank 0 pings: well inside the followers' bounded receive."""
    return min(PING_S, group.timeout_s / 4) if group.timeout_s else PING_S


def ping(group: TPGroup) -> None:
    """Rank 0, idle (a server between requests): say it is alive. A follower's receive
    is bounded by the group's timeout, so without a message that often it would take
    rank 0 for gone. A ping that fails means a follower is gone: ``ParallelError``."""
    if not (group.parallel and group.is_driver):
        return
    try:
        group.channel.send(Ping())
    except Exception as exc:
        raise ParallelError(f"tensor parallelism: rank 0 lost its followers "
                            f"({type(exc).__name__}: {str(exc)[:300]})") from exc


def load_and_follow(group: TPGroup, cfg) -> int:
    """A follower rank's whole job: load its slices of the config's checkpoint (agreeing
    with the others on what was loaded), then follow rank 0 until it shuts down -> the
    number of messages handled."""
    models, _ = load_on_ranks(cfg, group)
    return serve(models, group)


@torch.no_grad()
def follow_prefill(engine: SpecEngine, work: PrefillWork) -> None:
    """Rank 0's prefill of a step's chunks, without reading the bonus tokens back; the
    requests it admitted get the page-table rows it allocated (``work.tables``), and the
    prefix cache's copies and snapshots are rank 0's (``work.prefix``)."""
    for row, pages in work.tables:
        engine.models.target_pool.write_table(row, list(pages))
    engine.prefill.run(work)


@torch.no_grad()
def follow_round(engine: SpecEngine, msg: RunRound) -> None:
    """Rank 0's round, chunk for chunk, without reading anything back."""
    slots, lengths, sampled = list(msg.slots), list(msg.lengths), msg.sampled
    for part, bucket in engine.chunks.plan(len(slots)):
        engine.chunks.run(slots[part], lengths[part], bucket, read=False,
                          sampled=any(sampled[part]))


def build(models: LoadedModel, group: TPGroup, msg: BuildEngine) -> SpecEngine:
    """Rank 0's engine ``msg.engine``, built here (the same graphs captured)."""
    engine = SpecEngine(models.target, models.draft, msg.spec, msg.pool, msg.graph,
                        kernels=msg.kernels)
    if engine.engine_id != msg.engine:
        raise ParallelError(f"tensor parallelism: rank {group.rank} built engine "
                            f"{engine.engine_id}, rank 0 engine {msg.engine}")
    return engine


def serve(models: LoadedModel, group: TPGroup) -> int:
    """Follow rank 0 until it shuts down -> the number of messages handled (pings aside)."""
    engines: dict[int, SpecEngine] = {}
    handled = 0
    while True:
        try:
            msg = group.channel.recv()
        except Exception as exc:
            raise ParallelError(f"tensor parallelism: rank {group.rank} lost rank 0 "
                                f"({type(exc).__name__}: {str(exc)[:300]})") from exc
        match msg:
            case Ping():  # rank 0 is alive, and idle (not counted)
                continue
            case Shutdown():
                return handled + 1
            case BuildEngine():
                engines[msg.engine] = build(models, group, msg)
            case PrefillChunks(engine=e, work=work):
                follow_prefill(engines[e], work)
            case GrowTables(engine=e, rows=rows):  # pages grown before a round: rank 0's
                for row, pages in rows:
                    engines[e].models.target_pool.write_table(row, list(pages))
            case RunRound(engine=e):
                follow_round(engines[e], msg)
            case MirrorCall(name=name, args=args, kwargs=kwargs):
                MIRRORED[name](models, *args, **kwargs)
            case _:
                raise ParallelError(f"tensor parallelism: unknown message "
                                    f"{type(msg).__name__} from rank 0")
        handled += 1
