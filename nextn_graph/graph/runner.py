"""Capture per bucket, and the replay manager that drives a decode round.

What to capture is the three phases of ``RoundPhases`` (draft_extend, rollout,
target_verify) for every bucket B of the config; how is the backend's business.
One capture loop serves all kinds: largest bucket first, warm-up, one shared
pool, time and memory recorded per graph.

A round picks the smallest bucket that fits, stages the requests' state slots
(padding is slot 0, which every phase masks inside the graph), replays the three
graphs and reads back accept_lens, predictions and drafts in one host sync. A
batch larger than the largest bucket is split into bucket-sized chunks, which
the engine runs one by one; a kind that is not captured runs eagerly over the
same buffers. Both are counted. Nothing here commits: the engine does, once a
chunk's readback succeeded.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Callable, ContextManager

import torch

from ..progress import progress_bar
from ..runtime.buffers import RoundPhases
from .backends import CaptureRecord, Graph, GraphBackend, timed_capture
from .emulator import CaptureError
from .updates import UpdateContext, UpdateRegistry



@dataclass
class ReplayCounters:
    rounds: int = 0  # chunks run (a split round counts each chunk)
    graph_replays: int = 0
    staging_copies: int = 0  # host->device row copies and the one readback per chunk
    graph_updates: int = 0  # update() calls before replays
    eager_fallbacks: int = 0  # phases run eagerly on a graph backend (kind not captured)
    bucket_splits: int = 0  # rounds larger than the largest bucket, split in chunks
    padded_rows: int = 0  # padding requests replayed alongside real ones
    real_rows: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def plan_chunks(n: int, buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """The bucket policy: (chunk size, bucket) pairs for a batch of n requests. The
    smallest bucket that fits; above the largest, bucket-sized chunks; no buckets
    (eager): one chunk of exactly n."""
    if not buckets:
        return [(n, n)]
    sizes = [min(buckets[-1], n - i) for i in range(0, n, buckets[-1])]
    return [(s, next(b for b in buckets if b >= s)) for s in sizes]


@dataclass(frozen=True)
class RoundResult:
    """Host copies of what the round decided, per real request in order."""

    accept_lens: list[int]
    preds: list[list[int]]  # [b][N]
    drafts: list[list[int]]  # [b][S]


@dataclass
class RoundRunner:
    phases: RoundPhases
    backend: GraphBackend
    buckets: tuple[int, ...]  # sorted; empty for eager
    kinds: tuple[str, ...]  # which kinds to capture
    warmup: int = 1
    debug_check_addresses: bool = False
    updates: UpdateRegistry = field(default_factory=UpdateRegistry)
    graphs: dict[tuple[str, int], Graph] = field(default_factory=dict)
    records: list[CaptureRecord] = field(default_factory=list)
    counters: ReplayCounters = field(default_factory=ReplayCounters)
    # Profiling hook: tracer(kind, replayed) -> context manager around each phase.
    tracer: Callable[[str, bool], ContextManager] | None = None
    _addresses: dict[str, int] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return self.phases.num_steps

    def _round_kinds(self) -> tuple[str, ...]:
        return self.phases.kinds

    # -- capture -----------------------------------------------------------------
    def capture(self, progress: bool = False) -> list[CaptureRecord]:
        if not self.backend.captures or not self.buckets:
            return []
        pool = self.backend.new_pool()
        todo = [(b, k) for b in sorted(self.buckets, reverse=True)
                for k in self._round_kinds() if k in self.kinds]
        for i, (bucket, kind) in enumerate(todo, start=1):
            fn = functools.partial(self.phases.run, kind, bucket)
            self._stage([], bucket)  # capture over padding rows only: writes land in row 0
            with torch.no_grad():
                for _ in range(self.warmup):
                    fn()
                graph, record = timed_capture(self.backend, fn, pool, kind, bucket)
            self.graphs[(kind, bucket)] = graph
            self.records.append(record)
            if progress:
                progress_bar(i, len(todo), f"captured {kind} B={bucket} in {record.seconds:.2f}s")
        self._addresses = self._snapshot()
        return self.records

    def _snapshot(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self.phases.static_tensors().items()}

    def _check_addresses(self) -> None:
        for name, ptr in self._snapshot().items():
            if self._addresses.get(name) != ptr:
                raise CaptureError(f"static input {name} moved since capture "
                                   f"({self._addresses.get(name):#x} -> {ptr:#x})")

    # -- replay ------------------------------------------------------------------
    def plan(self, n: int) -> list[tuple[int, int]]:
        """(chunk size, bucket) pairs for a round of n requests; a split is counted."""
        plan = plan_chunks(n, self.buckets if self.graphs else ())
        self.counters.bucket_splits += int(len(plan) > 1)
        return plan

    def _stage(self, slots: list[int], bucket: int) -> None:
        padded = slots + [0] * (bucket - len(slots))
        self.phases.bufs.slots[:bucket].copy_(torch.tensor(padded), non_blocking=True)

    def run_chunk(self, slots: list[int], lengths: list[int], bucket: int) -> RoundResult:
        """One decode round for requests at state ``slots`` (their committed copies)
        with committed ``lengths``, replayed at ``bucket``. The next state lands in
        the other copies; nothing is committed here, so a raise leaves every
        request's committed state as it was."""
        b = len(slots)
        c = self.counters
        c.rounds, c.real_rows, c.padded_rows = c.rounds + 1, c.real_rows + b, c.padded_rows + bucket - b
        self._stage(slots, bucket)
        c.staging_copies += 1
        if self.debug_check_addresses and self.graphs:
            self._check_addresses()
        rows = [s % self.phases.state.rows for s in slots]
        for kind in self._round_kinds():
            graph = self.graphs.get((kind, bucket))
            with self.tracer(kind, graph is not None) if self.tracer else nullcontext():
                self._run_phase(kind, bucket, graph, rows, lengths)
        return self._readback(b)

    def _run_phase(self, kind: str, bucket: int, graph: Graph | None, rows: list[int],
                   lengths: list[int]) -> None:
        c, b = self.counters, len(rows)
        if graph is None:
            self.phases.run(kind, bucket)
            c.eager_fallbacks += int(self.backend.captures)
            return
        update = None
        if graph.update_ops:
            pad = (0,) * (bucket - b)
            ctx = UpdateContext(bucket, self.num_steps + 1, tuple(rows) + pad,
                                tuple(lengths) + pad)
            update = self.updates.derive(graph.update_ops, ctx)
            c.graph_updates += 1
        graph.replay(update)
        c.graph_replays += 1

    def _readback(self, b: int) -> RoundResult:
        """The round's one host sync: accept_lens, predictions and drafts of b requests."""
        bufs, s = self.phases.bufs, self.num_steps
        n = s + 1
        host = torch.cat((bufs.accept_lens[:b], bufs.preds[:b].flatten(),
                          bufs.draft_tokens[:b].flatten())).tolist()
        self.counters.staging_copies += 1
        preds, drafts = host[b:b + b * n], host[b + b * n:]
        return RoundResult(host[:b], [preds[i * n:(i + 1) * n] for i in range(b)],
                           [drafts[i * s:(i + 1) * s] for i in range(b)])
