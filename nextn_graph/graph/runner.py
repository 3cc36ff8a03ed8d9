"""The graph cache: one graph per ``GraphKey``, captured once into one shared pool,
largest bucket first, and replayed by key."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch

from ..errors import CaptureError
from ..parallel.group import CollectiveCounts
from ..progress import progress_bar
from .backends import CaptureRecord, Graph, GraphBackend, timed_capture
from .kinds import GraphKey


class Unit(Protocol):
    def run(self, key: GraphKey) -> None: ...  # key's unit, eagerly, over static tensors

    def static_tensors(self) -> dict[str, torch.Tensor]: ...  # what the graphs bake in


@dataclass
class GraphRunner:
    backend: GraphBackend
    warmup: int = 1
    # The tensor-parallel group's counts of collectives issued from Python (None: no
    # group). A capture issues a graph's collectives once; replays re-issue them unseen.
    collectives: CollectiveCounts | None = None
    graphs: dict[GraphKey, Graph] = field(default_factory=dict)
    records: list[CaptureRecord] = field(default_factory=list)
    _held: dict[GraphKey, int] = field(default_factory=dict)  # collectives inside each graph
    _addresses: dict[str, int] = field(default_factory=dict)

    def capture(self, keys: Iterable[GraphKey], unit: Unit, pad: Callable[[int], None],
                progress: bool = False) -> list[CaptureRecord]:
        """Capture every key; ``pad(bucket)`` stages padding rows only before each, so
        the warm-up and the capture write nothing but row 0."""
        if not self.backend.captures:
            return []
        todo = sorted(keys, key=lambda k: -k.bucket)  # (stable: a bucket keeps its order)
        pool = self.backend.new_pool() if todo else None
        for i, key in enumerate(todo, start=1):
            fn = functools.partial(unit.run, key)
            pad(key.bucket)
            with torch.no_grad():
                with self.backend.warmup_context():  # cuda: the capture's side stream
                    for _ in range(self.warmup):
                        fn()
                issued = self._issued()
                graph, record = timed_capture(self.backend, fn, pool, key.name, key.bucket)
                self._held[key] = self._issued() - issued
            self.graphs[key] = graph
            self.records.append(record)
            if progress:
                progress_bar(i, len(todo), f"captured {key} in {record.seconds:.2f}s")
        self._addresses = _addresses(unit.static_tensors())
        return self.records

    def replay(self, key: GraphKey, update: list[dict[str, Any]] | None = None) -> int:
        """Replay ``key``'s graph with its host-argument updates -> the collectives that
        ran inside it (part of the replay, not submissions of their own)."""
        issued = self._issued()
        self.graphs[key].replay(update)
        # a compiled graph re-issues its collectives from Python: counted where they ran
        return self._held.get(key, 0) if self._issued() == issued else 0

    def check_addresses(self, static: dict[str, torch.Tensor]) -> None:
        for name, ptr in _addresses(static).items():
            if self._addresses.get(name) != ptr:
                raise CaptureError(f"static input {name} moved since capture "
                                   f"({self._addresses.get(name):#x} -> {ptr:#x})")

    def _issued(self) -> int:
        return self.collectives.total() if self.collectives is not None else 0


def _addresses(static: dict[str, torch.Tensor]) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in static.items()}
