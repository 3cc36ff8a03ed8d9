"""Rank 0's messages to its followers (parallel/messages.py) over the channel
(parallel/control.py): a round's slots, committed lengths and sampling flags packed inline
up to INLINE_ROWS and in a second broadcast past it; every other kind pickled; each comes
back as the frozen dataclass it was. The broadcasts are replayed from one channel into the
other, so no process group is needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nextn_graph.config import GraphConfig, PoolConfig
from nextn_graph.counters import Counters
from nextn_graph.errors import ParallelError
from nextn_graph.launch.follower import serve
from nextn_graph.parallel.control import INLINE_ROWS, Channel
from nextn_graph.parallel.messages import (BuildEngine, GrowTables, MirrorCall, Ping,
                                           PrefillChunks, RunRound, Shutdown)


class _Counts(Counters):
    control = 0


def _pair() -> tuple[Channel, Channel, list[int]]:
    """A sender and a receiver whose broadcasts are a queue of tensor copies; the dtype
    of every broadcast sent (int64: packed, uint8: pickled)."""
    sent: list[torch.Tensor] = []
    dtypes: list[torch.dtype] = []
    tx, rx = Channel(None, _Counts()), Channel(None, _Counts())
    tx._bcast = lambda t: (sent.append(t.clone()), dtypes.append(t.dtype))
    rx._bcast = lambda t: t.copy_(sent.pop(0))
    return tx, rx, dtypes


@pytest.mark.parametrize("n", [1, 5, INLINE_ROWS, INLINE_ROWS + 3])
def test_round_message_round_trips(n):
    tx, rx, dtypes = _pair()
    msg = RunRound(4, tuple(7 + 2 * i for i in range(n)), tuple(100 + i for i in range(n)),
                   tuple(i % 3 == 1 for i in range(n)))
    tx.send(msg)
    assert rx.recv() == msg
    assert dtypes == [torch.int64] * (1 if n <= INLINE_ROWS else 2)  # packed, not pickled


@pytest.mark.parametrize("msg", [
    BuildEngine(2, None, PoolConfig(max_requests=4), GraphConfig(backend="eager"), "reference"),
    PrefillChunks(2, ("any", "picklable", "work")),
    GrowTables(2, ((0, (3, 4)), (5, (6,)))),
    MirrorCall("plain_generate", ([1, 2],), {"max_new_tokens": 3}),
    Ping(), Shutdown(),
])
def test_every_other_kind_round_trips_after_a_round(msg):
    tx, rx, dtypes = _pair()
    tx.send(RunRound(1, (3,), (9,), (True,)))
    tx.send(msg)
    assert rx.recv() == RunRound(1, (3,), (9,), (True,))
    assert rx.recv() == msg
    assert dtypes == [torch.int64, torch.int64, torch.uint8]  # the round; head, pickle


def _follower(*messages) -> SimpleNamespace:
    """A follower's group whose channel hands out ``messages`` in order."""
    queue = list(messages)
    return SimpleNamespace(rank=1, channel=SimpleNamespace(recv=lambda: queue.pop(0)))


def test_a_follower_counts_what_it_handled_and_stops_at_shutdown():
    assert serve(None, _follower(Ping(), Ping(), Shutdown(), Ping())) == 1  # pings aside


def test_a_follower_refuses_a_message_it_does_not_know():
    with pytest.raises(ParallelError, match="unknown message tuple"):
        serve(None, _follower(("round", 1, None)))


def test_a_follower_ends_when_rank_0_is_gone():
    with pytest.raises(ParallelError, match="rank 1 lost rank 0"):
        serve(None, _follower())  # (the receive raises: nothing comes)
