"""Rank 0's round message to its followers (parallel/control.py): slots, committed lengths
and each request's sampling flag, inline up to INLINE_ROWS and in a second broadcast past it.
The broadcasts are replayed from one channel into the other, so no process group is needed."""

from __future__ import annotations

import pytest
import torch

from nextn_graph.counters import Counters
from nextn_graph.parallel.control import INLINE_ROWS, Channel, Message


class _Counts(Counters):
    control = 0


def _pair() -> tuple[Channel, Channel]:
    """A sender and a receiver whose broadcasts are a queue of tensor copies."""
    sent: list[torch.Tensor] = []
    tx, rx = Channel(None, _Counts()), Channel(None, _Counts())
    tx._bcast = lambda t: sent.append(t.clone())
    rx._bcast = lambda t: t.copy_(sent.pop(0))
    return tx, rx


@pytest.mark.parametrize("n", [1, 5, INLINE_ROWS, INLINE_ROWS + 3])
def test_round_message_round_trips(n):
    tx, rx = _pair()
    slots = [7 + 2 * i for i in range(n)]
    lengths = [100 + i for i in range(n)]
    sampled = [i % 3 == 1 for i in range(n)]
    tx.send_round(4, slots, lengths, sampled)
    assert rx.recv() == Message("round", 4, (slots, lengths, sampled))


def test_an_object_message_follows_a_round():
    tx, rx = _pair()
    tx.send_round(1, [3], [9], [True])
    tx.send(Message("shutdown", 1))
    assert rx.recv().payload == ([3], [9], [True])
    assert rx.recv() == Message("shutdown", 1)
