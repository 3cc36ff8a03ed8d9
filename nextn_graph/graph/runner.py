"""Capture per bucket, and the replay manager that drives a decode round.

What to capture is the ``kinds`` of the round (``runtime.round.DecodeRound``: its
three phases rollout, target_verify, draft_extend, or the one fused ``round``) for
every bucket B of the config; how is the backend's business.
One capture loop serves all kinds: largest bucket first, warm-up, one shared
pool, time and memory recorded per graph.

A round picks the smallest bucket that fits, stages the requests' state slots
(padding is slot 0, which every phase masks inside the graph), replays the graphs
(three split, one fused) and reads back accept_lens, predictions and drafts in one
host sync. A fused round flips the staged slots itself, so a chunk of the same
requests as the last one is not staged again: a steady fused round is one replay
and one readback. Both
transfers go through host buffers allocated once (``HostTransfers``), pinned on
a device, so the non_blocking copies stay asynchronous (torch_npu turns a
non_blocking copy from pageable memory into a stream synchronize). A
batch larger than the largest bucket is split into bucket-sized chunks, which
the engine runs one by one; a kind that is not captured runs eagerly over the
same buffers. Both are counted. Nothing here commits: the engine does, once a
chunk's readback succeeded.
"""

from __future__ import annotations

import collections
import functools
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import ContextManager, Protocol

import torch

from ..counters import Counters
from ..parallel.group import CollectiveCounts
from ..progress import progress_bar
from .backends import CaptureRecord, Graph, GraphBackend, timed_capture
from .kinds import GraphKind
from ..errors import CaptureError
from .transfers import HostTransfers, PendingRead
from .updates import UpdateContext, UpdateRegistry


# What a graph round submits to the device, as the counters below name it.
COUNTED_AS = ("graph replays + staging copies (host->device slots, 1 per chunk) + readback "
              "copies (device->host, 1 per chunk) + graph updates (1 per recorded "
              "updatable op) + ops of phases run eagerly")


class RoundObserver:
    """An optional measurement hook of a runner (the bench's phase counter, phase timer
    and per-round trace; the tests' fault injection). Both methods do nothing here:
    an observer overrides what it watches."""

    def phase(self, kind: str, replayed: bool) -> ContextManager:
        """Around each graph kind (its name) of a chunk; ``replayed``: a graph ran it."""
        return nullcontext()

    def event(self, name: str, start: float, end: float) -> None:
        """A chunk's ``launch`` or ``read`` half took [start, end] (perf_counter s)."""


class Round(Protocol):
    """What a round offers the runner (``runtime.round.DecodeRound``): kinds to capture
    and run per bucket, the static tensors they use, and its buffers and state."""

    bufs: "object"  # .slots [Bmax] staged request slots, .readout [Bmax, 1 + N + S]
    state: "object"  # .rows: pool rows R (slots are row + copy * R)
    num_steps: int
    verify_width: int  # N
    fused: bool  # one kind; it flips the staged slots to the copies it wrote

    @property
    def kinds(self) -> tuple[GraphKind, ...]: ...

    @property
    def sampled_kinds(self) -> tuple[GraphKind, ...]: ...  # each kind's sampling variant, or ()

    def run(self, kind: GraphKind, b: int) -> None: ...

    def static_tensors(self) -> dict[str, torch.Tensor]: ...


@dataclass
class ReplayCounters(Counters):
    """Every device submission the runner issues (``SUBMISSIONS``), and the round shapes.
    The ops of a phase left eager are the bench's to count (``profile.counting``)."""

    SUBMISSIONS = ("graph_replays", "staging_copies", "readback_copies", "graph_updates")

    rounds: int = 0  # chunks run (a split round counts each chunk)
    graph_replays: int = 0
    staging_copies: int = 0  # host->device copies of the slots, 1 per chunk
    readback_copies: int = 0  # device->host copies of the readout rows, 1 per chunk
    graph_updates: int = 0  # task updates: 1 per recorded updatable op of a replayed graph
    eager_fallbacks: int = 0  # phases run eagerly on a graph backend (kind not captured)
    bucket_splits: int = 0  # rounds larger than the largest bucket, split in chunks
    padded_rows: int = 0  # padding requests replayed alongside real ones
    # rounds launched while an earlier round was still unread (graph.overlap)
    overlapped_rounds: int = 0
    # collectives inside the replayed graphs (tensor parallelism): not submissions of
    # their own, each is part of its graph's replay
    graph_collectives: int = 0
    sampled_rounds: int = 0  # chunks run in the sampling variants (a request samples)
    real_rows: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def submissions(self) -> int:
        return sum(getattr(self, name) for name in self.SUBMISSIONS)


def plan_chunks(n: int, buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """The bucket policy: (chunk size, bucket) pairs for a batch of n requests. The
    smallest bucket that fits; above the largest, bucket-sized chunks; no buckets
    (eager): one chunk of exactly n."""
    if not buckets:
        return [(n, n)]
    sizes = [min(buckets[-1], n - i) for i in range(0, n, buckets[-1])]
    return [(s, next(b for b in buckets if b >= s)) for s in sizes]


@dataclass(frozen=True)
class PendingChunk:
    """A launched chunk whose readback is under way."""

    rows: int  # b, the real requests
    read: PendingRead


@dataclass(frozen=True)
class RoundResult:
    """Host copies of what the round decided, per real request in order."""

    accept_lens: list[int]
    preds: list[list[int]]  # [b][N]
    drafts: list[list[int]]  # [b][S]
    # with graph.logprobs K: fp32 logprobs [b, N, 1+K] of each window row's token, then
    # of its K most likely tokens, whose ids are top_ids [b, N, K] (host tensors)
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def rows(self, keep: list[int]) -> "RoundResult":
        """The results of requests ``keep`` (indices), in that order."""
        lp = None if self.logprobs is None else (self.logprobs[keep], self.top_ids[keep])
        return RoundResult([self.accept_lens[i] for i in keep], [self.preds[i] for i in keep],
                           [self.drafts[i] for i in keep], *(lp or ()))


@dataclass
class GraphRunner:
    round: Round
    backend: GraphBackend
    buckets: tuple[int, ...]  # sorted; empty for eager
    kinds: tuple[str, ...]  # graph.kinds: which phases to capture
    warmup: int = 1
    debug_check_addresses: bool = False
    updates: UpdateRegistry = field(default_factory=UpdateRegistry)
    graphs: dict[tuple[str, int], Graph] = field(default_factory=dict)  # (kind name, bucket)
    records: list[CaptureRecord] = field(default_factory=list)
    counters: ReplayCounters = field(default_factory=ReplayCounters)
    # The tensor-parallel group's counts of collectives issued from Python (a capture
    # issues a graph's once; replays re-issue them unseen); None: no group.
    collectives: CollectiveCounts | None = None
    observer: RoundObserver | None = None  # measurement only; None in serving
    # kinds run, by (kind name, bucket, "graph" | "eager"), since start: never reset
    phase_runs: collections.Counter = field(default_factory=collections.Counter)
    _addresses: dict[str, int] = field(default_factory=dict)
    _collectives: dict[tuple[str, int], int] = field(default_factory=dict)  # per graph
    # host seconds spent inside graph replay calls (the rest of a round is host work:
    # staging, readback, updates, eager phases, the engine's bookkeeping)
    replay_s: float = 0.0
    read_wait_s: float = 0.0  # host seconds waiting for readbacks (the copy and its event)
    # (bucket, slots) the device's staged slots hold after the last chunk, when known
    _resident: tuple | None = None
    _host: HostTransfers = field(init=False)

    def __post_init__(self) -> None:
        self._host = HostTransfers(self.round.bufs)

    @property
    def num_steps(self) -> int:
        return self.round.num_steps

    def _round_kinds(self, sampled: bool = False) -> tuple[GraphKind, ...]:
        return self.round.sampled_kinds if sampled else self.round.kinds

    def _captures(self, kind: GraphKind) -> bool:
        """Whether ``kind`` (greedy or sampling) is captured."""
        return self.round.fused or kind.unit in self.kinds

    # -- capture -----------------------------------------------------------------
    def capture(self, progress: bool = False) -> list[CaptureRecord]:
        if not self.backend.captures or not self.buckets:
            return []
        pool = self.backend.new_pool()
        todo = [(b, k) for b in sorted(self.buckets, reverse=True)
                for k in self._round_kinds() + self._round_kinds(sampled=True)
                if self._captures(k)]
        for i, (bucket, kind) in enumerate(todo, start=1):
            fn = functools.partial(self.round.run, kind, bucket)
            self._stage([], bucket)  # capture over padding rows only: writes land in row 0
            with torch.no_grad():
                with self.backend.warmup_context():  # cuda: the capture's side stream
                    for _ in range(self.warmup):
                        fn()
                issued = self._issued()
                graph, record = timed_capture(self.backend, fn, pool, kind.name, bucket)
                # what the capture issued from Python is what each replay re-issues
                self._collectives[(kind.name, bucket)] = self._issued() - issued
            self.graphs[(kind.name, bucket)] = graph
            self.records.append(record)
            if progress:
                progress_bar(i, len(todo), f"captured {kind} B={bucket} in {record.seconds:.2f}s")
        self._addresses = self._snapshot()
        self._resident = None  # capture staged padding
        return self.records

    def _issued(self) -> int:
        """Collectives the model's tensor-parallel group issued from Python so far."""
        return self.collectives.total() if self.collectives is not None else 0

    def _snapshot(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self.round.static_tensors().items()}

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
        self._host.upload(slots, bucket, self.round.bufs.slots)

    def run_chunk(self, slots: list[int], lengths: list[int], bucket: int,
                  read: bool = True, sampled: bool = False) -> RoundResult | None:
        """One decode round for requests at state ``slots`` (their committed copies)
        with committed ``lengths``, replayed at ``bucket``. The next state lands in
        the other copies; nothing is committed here, so a raise leaves every
        request's committed state as it was. ``read`` False (tensor-parallel ranks
        other than 0): nothing is read back. ``sampled``: run the sampling variants (a
        request of the chunk samples)."""
        pending = self.launch_chunk(slots, lengths, bucket, read, sampled)
        return self.finish_chunk(pending) if read else None

    def launch_chunk(self, slots: list[int], lengths: list[int], bucket: int,
                     read: bool = True, sampled: bool = False) -> PendingChunk | None:
        """``run_chunk``'s first half: stage (if the slots are not already in place),
        run every kind, and start the readback; ``finish_chunk`` waits for it. Another
        chunk may be launched in between (it is queued behind this one's copy)."""
        start = time.perf_counter()
        b = len(slots)
        c = self.counters
        c.rounds, c.real_rows, c.padded_rows = c.rounds + 1, c.real_rows + b, c.padded_rows + bucket - b
        if (bucket, tuple(slots)) != self._resident:  # a fused round left them in place
            self._stage(slots, bucket)
            c.staging_copies += 1
        self._resident = None  # unknown until every phase of this chunk ran
        if self.debug_check_addresses and self.graphs:
            self._check_addresses()
        c.sampled_rounds += int(sampled)
        for kind in self._round_kinds(sampled):
            graph = self.graphs.get((kind.name, bucket))
            self.phase_runs[kind.name, bucket, "eager" if graph is None else "graph"] += 1
            with (self.observer.phase(kind.name, graph is not None) if self.observer
                  else nullcontext()):
                self._run_phase(kind, bucket, graph, slots, lengths)
        if self.round.fused:  # the round flipped the staged slots to its new copies
            rows = self.round.state.rows
            self._resident = (bucket, tuple((s + rows) % (2 * rows) for s in slots))
        pending = None
        if read:  # one copy of b rows [accept_len, preds, drafts]
            pending = PendingChunk(b, self._host.start_read(self.round.bufs.readout[:b]))
            c.readback_copies += 1
        self._record("launch", start)
        return pending

    def finish_chunk(self, pending: PendingChunk) -> RoundResult:
        """Wait for a launched chunk's readback (its one host sync) -> what it decided."""
        start = time.perf_counter()
        host = self._host.finish_read(pending.read)  # [b * readout width] flat
        self.read_wait_s += time.perf_counter() - start
        bufs, b = self.round.bufs, pending.rows
        n, s, k = self.round.verify_width, self.round.num_steps, bufs.top_logprobs
        host = host.view(b, bufs.readout.shape[1])
        rows = host[:, :1 + n + s].tolist()
        lp = ()
        if k:  # (copied out: the host buffer is reused two reads on)
            ids = host[:, 1 + n + s:1 + n + s + n * k]
            values = host[:, 1 + n + s + n * k:].clone().view(torch.float32)[:, :n * (1 + k)]
            lp = (values.view(b, n, 1 + k), ids.clone().view(b, n, k))
        self._record("read", start)
        return RoundResult([r[0] for r in rows], [r[1:1 + n] for r in rows],
                           [r[1 + n:] for r in rows], *lp)

    def _record(self, event: str, start: float) -> None:
        if self.observer is not None:
            self.observer.event(event, start, time.perf_counter())

    def _run_phase(self, kind: GraphKind, bucket: int, graph: Graph | None, slots: list[int],
                   lengths: list[int]) -> None:
        c, b = self.counters, len(slots)
        if graph is None:
            self.round.run(kind, bucket)
            c.eager_fallbacks += int(self.backend.captures)
            return
        update = None
        if graph.update_ops:
            pad = (0,) * (bucket - b)
            rows = tuple(s % self.round.state.rows for s in slots)  # pool rows of the slots
            ctx = UpdateContext(bucket, self.round.verify_width, rows + pad,
                                tuple(lengths) + pad)
            update = self.updates.derive(graph.update_ops, ctx)
            c.graph_updates += len(update)  # the NPU graph updates one task per op
        issued = self._issued()
        start = time.perf_counter()
        graph.replay(update)
        self.replay_s += time.perf_counter() - start
        c.graph_replays += 1
        if self._issued() == issued:  # a compiled graph counts its own (Dynamo replays the
            c.graph_collectives += self._collectives.get((kind.name, bucket), 0)  # increments)
