"""A chunk of a decode round (docs/architecture.md): stage, run, read back. Nothing
here commits: the driver does, once the readback succeeded."""

from __future__ import annotations

import collections
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import ContextManager, Sequence

import torch

from ..counters import Counters
from ..graph.kinds import GraphKey
from ..graph.runner import GraphRunner
from ..graph.updates import UpdateContext, UpdateRegistry
from .round import DecodeRound
from .transfers import HostTransfers, PendingRead

# What a graph round submits to the device, as the counters below name it.
COUNTED_AS = ("graph replays + staging copies (host->device slots, 1 per chunk) + readback "
              "copies (device->host, 1 per chunk) + graph updates (1 per recorded "
              "updatable op) + ops of phases run eagerly")


class RoundObserver:
    """A measurement hook (bench counters and trace, test fault injection); no-ops here."""

    def phase(self, name: str, replayed: bool) -> ContextManager:
        return nullcontext()

    def event(self, name: str, start: float, end: float) -> None:
        """perf_counter [start, end] of a ``launch``, ``read``, ``replay`` or ``read_wait``."""


@dataclass
class ReplayCounters(Counters):
    """Ops of units run eagerly are not counted here: ``profile.counting`` does."""

    SUBMISSIONS = ("graph_replays", "staging_copies", "readback_copies", "graph_updates")

    chunks: int = 0
    graph_replays: int = 0
    staging_copies: int = 0  # host->device copies of the slots, at most 1 per chunk
    readback_copies: int = 0  # device->host copies of the readout rows, 1 per chunk
    graph_updates: int = 0  # NPU task updates: 1 per recorded updatable op of a replay
    eager_fallbacks: int = 0  # units run eagerly on a capturing backend (not captured)
    bucket_splits: int = 0  # rounds larger than the largest bucket, run in chunks
    padded_rows: int = 0  # padding rows replayed alongside real ones
    overlapped_rounds: int = 0  # launched while an earlier round was still unread
    graph_collectives: int = 0  # inside replayed graphs (tensor parallel): not submissions
    sampled_chunks: int = 0  # chunks run in the sampling variants (a request samples)
    real_rows: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def submissions(self) -> int:
        return sum(getattr(self, name) for name in self.SUBMISSIONS)


def plan_chunks(n: int, buckets: tuple[int, ...]) -> list[tuple[slice, int]]:
    """The smallest bucket that fits; above the largest, bucket-sized chunks."""
    if not buckets:
        return [(slice(0, n), n)]
    top = buckets[-1]
    return [(slice(i, min(i + top, n)), next(b for b in buckets if b >= min(top, n - i)))
            for i in range(0, n, top)]


@dataclass(frozen=True)
class PendingChunk:
    rows: int  # b, the real requests
    read: PendingRead


@dataclass(frozen=True)
class ChunkResult:
    accept_lens: list[int]
    preds: list[list[int]]  # [b][N]
    drafts: list[list[int]]  # [b][S]
    # graph.logprobs K: fp32 [b, N, 1+K] (the row's token, then its top K), ids [b, N, K]
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def rows(self, keep: list[int]) -> "ChunkResult":
        lp = None if self.logprobs is None else (self.logprobs[keep], self.top_ids[keep])
        return ChunkResult([self.accept_lens[i] for i in keep], [self.preds[i] for i in keep],
                           [self.drafts[i] for i in keep], *(lp or ()))


class ChunkRunner:
    """``buckets``: sorted, empty for eager. A fused round is always captured."""

    def __init__(self, round: DecodeRound, graphs: GraphRunner, buckets: tuple[int, ...],
                 captured_phases: Sequence[str], updates: UpdateRegistry | None = None,
                 debug_check_addresses: bool = False):
        self.round, self.graphs, self.buckets = round, graphs, buckets
        self.captured_phases = tuple(captured_phases)
        self.updates = updates or UpdateRegistry()
        self.debug_check_addresses = debug_check_addresses
        self.slots = round.state.map
        self.counters = ReplayCounters()
        # units run, by (GraphKey.name, bucket, "graph" | "eager"), since start
        self.phase_runs: collections.Counter = collections.Counter()
        self.observer: RoundObserver | None = None
        self._host = HostTransfers(round.bufs)
        self._keys: dict[tuple[int, bool], tuple[GraphKey, ...]] = {}

    def keys(self, bucket: int, sampled: bool = False) -> tuple[GraphKey, ...]:
        keys = self._keys.get((bucket, sampled))
        if keys is None:
            keys = self._keys[bucket, sampled] = tuple(
                GraphKey(p, bucket, sampled) for p in self.round.units)
        return keys

    def capture(self, progress: bool = False) -> None:
        variants = (False, True) if self.round.sampling is not None else (False,)
        keys = [k for b in self.buckets for s in variants for k in self.keys(b, s)
                if self.round.fused or k.phase in self.captured_phases]
        self.graphs.capture(keys, self.round, lambda b: self._stage([], b), progress)
        self.slots.staged(0, None)  # capture staged padding

    def plan(self, n: int) -> list[tuple[slice, int]]:
        """``plan_chunks`` over the buckets (nothing captured: one chunk); counts a split."""
        plan = plan_chunks(n, self.buckets if self.graphs.graphs else ())
        self.counters.bucket_splits += int(len(plan) > 1)
        return plan

    def fits_one(self, n: int) -> bool:
        return len(plan_chunks(n, self.buckets if self.graphs.graphs else ())) == 1

    def run(self, slots: list[int], lengths: list[int], bucket: int, read: bool = True,
            sampled: bool = False) -> ChunkResult | None:
        """Nothing is committed, so a raise leaves every request as it was. ``read``
        False (tensor-parallel followers): no readback."""
        pending = self.launch(slots, lengths, bucket, read, sampled)
        return self.finish(pending) if read else None

    def launch(self, slots: list[int], lengths: list[int], bucket: int, read: bool = True,
               sampled: bool = False) -> PendingChunk | None:
        obs = self.observer
        start = time.perf_counter() if obs else 0.0
        b, c = len(slots), self.counters
        c.chunks, c.real_rows, c.padded_rows = c.chunks + 1, c.real_rows + b, c.padded_rows + bucket - b
        c.sampled_chunks += int(sampled)
        if self.slots.needs_staging(bucket, slots):
            self._stage(slots, bucket)
            c.staging_copies += 1
        self.slots.staged(bucket, None)  # unknown until every unit of this chunk ran
        if self.debug_check_addresses and self.graphs.graphs:
            self.graphs.check_addresses(self.round.static_tensors())
        for key in self.keys(bucket, sampled):
            replayed = key in self.graphs.graphs
            self.phase_runs[key.name, bucket, "graph" if replayed else "eager"] += 1
            with obs.phase(key.name, replayed) if obs else nullcontext():
                if replayed:
                    self._replay(key, slots, lengths)
                else:
                    self.round.run(key)
                    c.eager_fallbacks += int(self.graphs.backend.captures)
        if self.round.fused:  # the round flipped the staged slots to its new copies
            self.slots.staged(bucket, slots, flipped=True)
        pending = None
        if read:  # one copy of b rows [accept_len, preds, drafts (, logprobs)]
            pending = PendingChunk(b, self._host.start_read(self.round.bufs.readout[:b]))
            c.readback_copies += 1
        if obs:
            obs.event("launch", start, time.perf_counter())
        return pending

    def finish(self, pending: PendingChunk) -> ChunkResult:
        obs = self.observer
        start = time.perf_counter() if obs else 0.0
        host = self._host.finish_read(pending.read)  # [b * readout width] flat
        if obs:
            obs.event("read_wait", start, time.perf_counter())
        bufs, b = self.round.bufs, pending.rows
        n, s, k = self.round.verify_width, self.round.num_steps, bufs.top_logprobs
        host = host.view(b, bufs.readout.shape[1])
        rows = host[:, :1 + n + s].tolist()
        lp = ()
        if k:  # (copied out: the host buffer is reused two reads on)
            ids = host[:, 1 + n + s:1 + n + s + n * k]
            values = host[:, 1 + n + s + n * k:].clone().view(torch.float32)[:, :n * (1 + k)]
            lp = (values.view(b, n, 1 + k), ids.clone().view(b, n, k))
        if obs:
            obs.event("read", start, time.perf_counter())
        return ChunkResult([r[0] for r in rows], [r[1:1 + n] for r in rows],
                           [r[1 + n:] for r in rows], *lp)

    def _stage(self, slots: list[int], bucket: int) -> None:
        self._host.upload(slots, bucket, self.round.bufs.slots)

    def _replay(self, key: GraphKey, slots: list[int], lengths: list[int]) -> None:
        c, bucket = self.counters, key.bucket
        graph = self.graphs.graphs[key]
        update = None
        if graph.update_ops:
            pad = (0,) * (bucket - len(slots))
            ctx = UpdateContext(bucket, self.round.verify_width,
                                tuple(self.slots.row(s) for s in slots) + pad,
                                tuple(lengths) + pad)
            update = self.updates.derive(graph.update_ops, ctx)
            c.graph_updates += len(update)
        obs = self.observer
        start = time.perf_counter() if obs else 0.0
        c.graph_collectives += self.graphs.replay(key, update)
        c.graph_replays += 1
        if obs:
            obs.event("replay", start, time.perf_counter())
