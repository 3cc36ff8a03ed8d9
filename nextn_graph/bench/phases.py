"""Observing a round phase by phase: its launches (``count_round``) and its time
(``PhaseTimer``), both as the chunks' observer (``ChunkRunner.observer``)."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch

from ..runtime.chunks import ChunkRunner, RoundObserver
from ..profile.counting import OUTSIDE_PHASES, RoundCounter


def count_round(chunks: ChunkRunner, step: Callable[[], object], counter: RoundCounter,
                trace_replays: bool = False) -> dict:
    """Run ``step`` (one round) under ``counter``, the round's only counter: every
    submission, split by the phases that ran eagerly (a replayed phase is one submission,
    the chunks' counters') and ``OUTSIDE_PHASES`` for the rest (staging, readback).
    ``trace_replays``: replays are phases too (a compiled graph's call is many launches)."""
    chunks.observer = _PhaseCounter(counter, trace_replays)
    try:
        with counter:
            step()
    finally:
        chunks.observer = None
    per_phase = dict(counter.per_phase)
    return {"launches": counter.launches, "method": counter.method,
            "outside_phases": per_phase.pop(OUTSIDE_PHASES, 0), "phases": per_phase}


class _PhaseCounter(RoundObserver):
    """Marks each eagerly run phase (and with ``trace_replays`` each replayed one)."""

    def __init__(self, counter: RoundCounter, trace_replays: bool):
        self.counter, self.trace_replays = counter, trace_replays

    def phase(self, kind: str, replayed: bool):
        return nullcontext() if replayed and not self.trace_replays else self.counter.phase(kind)


class ReplayClock(RoundObserver):
    """Sums the host seconds spent inside graph replay calls."""

    def __init__(self):
        self.seconds = 0.0

    def event(self, name: str, start: float, end: float) -> None:
        if name == "replay":
            self.seconds += end - start


class PhaseTimer(RoundObserver):
    """An observer (``ChunkRunner.observer``): host seconds per phase kind of the rounds it
    watches. On CPU every kernel has run when a phase returns; on a device a phase's
    time would be its launch time only, so there each phase starts and ends with a device
    sync (staging before it and its kernels inside it), which is why the bench times
    phases in rounds of their own, never in the timed ones."""

    def __init__(self, device: torch.device):
        self.seconds: Counter[str] = Counter()  # by phase kind, in round order
        self.synchronized = device.type != "cpu"
        module = torch.get_device_module(device) if self.synchronized else None
        self._sync = (lambda: module.synchronize(device)) if module else (lambda: None)

    @contextmanager
    def phase(self, kind: str, replayed: bool):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[kind] += time.perf_counter() - start
