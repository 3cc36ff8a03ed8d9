"""Rank 0 -> every other rank: the messages of ``Channel`` (``control.py``), one frozen
dataclass per kind. A follower (``launch.follower.serve``) dispatches them with ``match``.

They are defined here, below the runtime and ``launch`` that send them, so the channel
and every sender and receiver share one vocabulary. What rank 0 sends is the runtime's
own data where there is one: a prefill step's ``PrefillWork`` (``runtime/prefill_work.py``)
travels as it is, so ``PrefillChunks.work`` is typed ``object`` here (this layer may not
name a runtime type; the follower passes it to ``Prefiller.run`` unchanged).

``RunRound`` is the steady-state message: ``Channel`` packs it into one int64 broadcast
(no pickling per round). Every other kind is pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config.graph import GraphConfig
from ..config.pool import PoolConfig
from ..config.speculative import SpeculativeConfig


@dataclass(frozen=True)
class BuildEngine:
    """Build engine ``engine`` (ids in build order, the same on every rank) from rank 0's
    resolved sections; every rank then captures the same graphs."""

    engine: int
    spec: SpeculativeConfig | None  # None: plain decoding
    pool: PoolConfig
    graph: GraphConfig
    kernels: str | None  # the kernel set's name; None: the models' own


@dataclass(frozen=True)
class PrefillChunks:
    """One step's prefill of engine ``engine``: the chunks, pages and prefix-cache work
    rank 0 decided."""

    engine: int
    work: object  # runtime.prefill_work.PrefillWork (runtime is above this layer)


@dataclass(frozen=True)
class GrowTables:
    """Pages rank 0 grew before a round: the followers write the same page-table rows."""

    engine: int
    rows: tuple[tuple[int, tuple[int, ...]], ...]  # (request row, its pages)


@dataclass(frozen=True)
class RunRound:
    """One decode round of engine ``engine`` over ``slots`` (sent packed, never pickled)."""

    engine: int
    slots: tuple[int, ...]
    lengths: tuple[int, ...]  # per slot: its committed length
    sampled: tuple[bool, ...]  # per slot: the request samples (not greedy)


@dataclass(frozen=True)
class MirrorCall:
    """Run ``launch.follower.MIRRORED[name](models, *args, **kwargs)`` on every rank."""

    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ping:
    """An idle rank 0 is alive (a follower's receive is bounded by the group's timeout)."""


@dataclass(frozen=True)
class Shutdown:
    """The end of the program: a follower's loop returns."""


ControlMessage = (BuildEngine | PrefillChunks | GrowTables | RunRound | MirrorCall | Ping
                  | Shutdown)
