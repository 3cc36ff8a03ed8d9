"""The round's driver: run and commit every running request's round, in step or
overlapped (docs/architecture.md). Overlapped, a finished request's extra round is
dropped when read: never emitted, it touches only its own row, up to N positions past
its end (``lookahead``). A split or empty batch drains the round in flight first."""

from __future__ import annotations

import collections

import torch

from ..parallel.group import TPGroup
from ..parallel.messages import GrowTables, RunRound
from .chunks import ChunkResult, ChunkRunner
from .request import Request, token_logprobs
from .scheduler import Scheduler
from .stats import SpecStats


def samples(reqs: list[Request]) -> bool:
    return any(r.samples for r in reqs)


class RoundDriver:
    """Launch, read and commit of the rounds; the ``Scheduler`` owns the requests."""

    def __init__(self, chunks: ChunkRunner, stats: SpecStats, scheduler: Scheduler,
                 tp: TPGroup, engine_id: int, overlap: bool):
        self.chunks, self.stats, self.sched = chunks, stats, scheduler
        self.slots = chunks.slots
        self.tp, self.engine_id, self.overlap = tp, engine_id, overlap
        self.num_steps = chunks.round.num_steps
        # rounds launched and not yet read, oldest first (at most two); one stays here
        # until its readback succeeded, so an interrupt during a read loses nothing
        self.inflight: collections.deque = collections.deque()

    @torch.no_grad()
    def run(self) -> None:
        if self.sched.broken:  # its requests failed with the group
            return self.inflight.clear()
        while len(self.inflight) > 1:  # a read an interrupt cut short: finish it first
            self._finish_oldest()  # (the next launch would reuse its host buffer)
        live = [r for r in self.sched.running.values() if not r.finished]
        if self.sched.grow and live:
            live = self._grow(live)
        if not self.overlap:
            return self._round_in_step(live) if live else None
        if not live or not self.chunks.fits_one(len(live)):
            # nothing to launch, or a split round: no overlap this time
            self._drain()
            live = [r for r in self.sched.running.values() if not r.finished]
            return self._round_in_step(live) if live else None
        (_, bucket), = self.chunks.plan(len(live))
        slots, lengths = self._announce(live)
        if slots is None:
            return
        try:
            pending = self.chunks.launch(slots, lengths, bucket, sampled=samples(live))
        except Exception as exc:
            self._drain()  # round k-1 read and committed first (it may finish some)
            live = [r for r in live if not r.finished]
            return self._unit_failed(live, live, exc)
        self.slots.flip(live)  # the device state moves on with the round in flight
        self.chunks.counters.overlapped_rounds += int(bool(self.inflight))
        self.inflight.append((live, pending))
        while len(self.inflight) > 1:
            self._finish_oldest()

    def _grow(self, live: list[Request]) -> list[Request]:
        """Pages for this round's writes (``Scheduler.grow_pages``); a preemption waits
        for the round in flight to be read, so every request it touches is committed.
        -> the requests that still run."""
        done, grown = self.sched.grow_pages(live, preempt=not self.inflight)
        if not done:
            self._drain()
            live = [r for r in self.sched.running.values() if not r.finished]
            _, more = self.sched.grow_pages(live, preempt=True)
            grown += more
        if self.sched.broken:  # a fault growing a page table failed the group
            self.inflight.clear()
            return []
        if grown and self.tp.parallel:  # the followers' page tables, before the round
            try:
                self.tp.channel.send(GrowTables(self.engine_id, tuple(
                    (row, tuple(pages)) for row, pages in grown)))
            except Exception as exc:
                self.sched.fail_all(live, exc, "page tables")
                self.inflight.clear()
                return []
        return [r for r in self.sched.running.values() if not r.finished]

    def _announce(self, reqs: list[Request]):
        """The round's slots and committed lengths; on a tensor-parallel group, rank 0's
        one control message (before the staging copy). (None, None) if that failed."""
        slots = self.slots.slots(reqs)
        lengths = [r.committed for r in reqs]  # overlapped: one round behind (no kernel
        if self.tp.parallel:  # takes host lengths then, see config/graph.py)
            try:
                self.tp.channel.send(RunRound(self.engine_id, tuple(slots), tuple(lengths),
                                              tuple(r.samples for r in reqs)))
            except Exception as exc:
                self.sched.fail_all(reqs, exc, "decode round")
                self.inflight.clear()
                return None, None
        return slots, lengths

    def _unit_failed(self, chunk: list[Request], active: list[Request], exc: Exception) -> None:
        self.sched.fail_unit(chunk, active, exc, "decode round")
        if self.sched.broken:  # every request failed: nothing in flight is read
            self.inflight.clear()

    def _drain(self) -> None:
        while self.inflight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        """Read the oldest round in flight back and commit it; requests that finished
        before it (or were aborted) had their extra round: dropped, rows released."""
        chunk, pending = self.inflight[0]
        try:
            res = self.chunks.finish(pending)
        except Exception as exc:  # (an interrupt leaves the round queued, to read again)
            res = exc
        self.inflight.popleft()  # read, or failed for good: this round is over
        for req in chunk:  # a request that finished before it: its extra round's row
            if req.finished and self.sched.running.get(req.row) is req:
                self.sched.release(req)
        if isinstance(res, Exception):
            alive = [r for r in chunk if not r.finished]
            return self._unit_failed(alive, alive, res)
        keep = [i for i, r in enumerate(chunk) if not r.finished]
        held = {id(r) for later, _ in self.inflight for r in later}
        self.stats.rounds += int(bool(keep))
        self._commit_round([chunk[i] for i in keep], res.rows(keep), held)

    def _round_in_step(self, active: list[Request]) -> None:
        slots, lengths = self._announce(active)
        if slots is None:
            return
        done = []
        for part, bucket in self.chunks.plan(len(active)):
            chunk = active[part]
            try:
                res = self.chunks.run(slots[part], lengths[part], bucket, sampled=samples(chunk))
            except Exception as exc:
                self._unit_failed(chunk, active, exc)
                if self.tp.parallel:
                    return
                continue
            done.append((chunk, res))
        self.stats.rounds += int(bool(done))
        for chunk, res in done:
            self.slots.flip(chunk)  # the round's next state is now the committed one
            self._commit_round(chunk, res, set())

    def _commit_round(self, chunk: list[Request], res: ChunkResult, held: set[int]) -> None:
        """A request in ``held`` (the round in flight) keeps its row until that is read."""
        if not chunk:
            return
        s, st, b = self.num_steps, self.stats, len(chunk)
        st.request_rounds += b
        st.verify_forwards += 1
        st.nextn_extend_forwards += int(s > 0)
        st.nextn_decode_forwards += max(s - 1, 0)
        st.proposed_drafts += b * s
        st.accepted_drafts += sum(res.accept_lens) - b
        for i, (req, a, preds) in enumerate(zip(chunk, res.accept_lens, res.preds)):
            lp = None
            if req.logprobs is not None:  # what the request asked for, of its a tokens
                lp = token_logprobs(preds[:a], res.logprobs[i, :a], res.top_ids[i, :a],
                                    req.logprobs)
            self.sched.commit(req, preds[:a], res.drafts[i], hold=id(req) in held,
                              accepted=a - 1, logprobs=lp)
