"""Rank 0 -> every other rank: the scheduler's decisions, as host messages.

Rank 0 owns the scheduler; the other ranks (followers) execute what it decided, so
every rank runs the same forwards, graphs and collectives in the same order. The
messages are frozen dataclasses (``messages.py``). A steady round costs ONE small
broadcast, before its staging copy: ``RunRound`` packed into a fixed-size int64 message
``[ROUND, engine, n, 0, slots(n), lengths(n), sampled(n)]`` (rows beyond ``INLINE_ROWS``
follow in a second one), never pickled. Rare messages (build an engine, prefill prompt
chunks, grow page tables, run a mirrored call, ping, shut down) are pickled into a second
broadcast.

Messages go over the group's host process group (gloo), never the device one: the
followers block on it between rounds without holding a device stream. Every
receive is bounded by the group's timeout, so a dead rank 0 ends the followers.
"""

from __future__ import annotations

import pickle
from enum import IntEnum

import torch
import torch.distributed as dist

from ..counters import Counters
from .messages import ControlMessage, RunRound

INLINE_ROWS = 256  # a round of up to this many requests is one broadcast
_HEAD = 4
_FIELDS = 3  # per request of a round: slot, committed length, samples (0/1)


class Cmd(IntEnum):
    ROUND = 1  # a packed RunRound: engine, slots, committed lengths, sampled flags
    OBJECT = 2  # a pickled message follows (any other kind)


class Channel:
    """The host-message channel of one group; ``send`` on rank 0, ``recv`` elsewhere."""

    def __init__(self, control: dist.ProcessGroup | None, counts: Counters):
        self.control = control  # the group's host process group (gloo)
        self.counts = counts  # the group's CollectiveCounts: a broadcast adds to .control
        self._buf = torch.zeros(_HEAD + _FIELDS * INLINE_ROWS, dtype=torch.int64,
                                device="cpu")  # [head + 3*rows]; host messages
        self._host = self._buf.numpy()  # written in place: no tensor per round
        self._engines = 0

    def new_engine_id(self) -> int:
        """Engines are numbered in build order, the same on every rank."""
        self._engines += 1
        return self._engines

    def _bcast(self, t: torch.Tensor) -> None:
        self.counts.control += 1
        dist.broadcast(t, src=0, group=self.control)

    # -- rank 0 ----------------------------------------------------------------------
    def send(self, msg: ControlMessage) -> None:
        match msg:
            case RunRound():
                self._send_round(msg)
            case _:
                data = pickle.dumps(msg)
                self._host[:_HEAD] = (Cmd.OBJECT, 0, len(data), 0)
                self._bcast(self._buf)
                self._bcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _send_round(self, msg: RunRound) -> None:
        n = len(msg.slots)
        k = min(n, INLINE_ROWS)
        host = self._host
        host[:_HEAD] = (Cmd.ROUND, msg.engine, n, 0)
        for i, values in enumerate((msg.slots, msg.lengths, msg.sampled)):
            at = _HEAD + i * INLINE_ROWS
            host[at:at + k] = values[:k]
        self._bcast(self._buf)
        if n > k:
            rest = msg.slots[k:] + msg.lengths[k:] + tuple(map(int, msg.sampled[k:]))
            self._bcast(torch.tensor(rest, dtype=torch.int64))

    # -- followers -------------------------------------------------------------------
    def recv(self) -> ControlMessage:
        buf = self._buf
        self._bcast(buf)
        cmd, engine, n, _ = buf[:_HEAD].tolist()
        if cmd == Cmd.ROUND:
            return self._recv_round(engine, n)
        if cmd != Cmd.OBJECT:
            raise RuntimeError(f"tensor parallelism: unknown control command {cmd} from "
                               f"rank 0 (ranks running different versions?)")
        data = torch.zeros(n, dtype=torch.uint8)
        self._bcast(data)
        return pickle.loads(data.numpy().tobytes())

    def _recv_round(self, engine: int, n: int) -> RunRound:
        buf, k = self._buf, min(n, INLINE_ROWS)
        fields = [buf[_HEAD + i * INLINE_ROWS:_HEAD + i * INLINE_ROWS + k].tolist()
                  for i in range(_FIELDS)]
        if n > k:
            rest = torch.zeros(_FIELDS * (n - k), dtype=torch.int64)
            self._bcast(rest)
            for i in range(_FIELDS):
                fields[i] += rest[i * (n - k):(i + 1) * (n - k)].tolist()
        slots, lengths, sampled = fields
        return RunRound(engine, tuple(slots), tuple(lengths), tuple(bool(s) for s in sampled))
