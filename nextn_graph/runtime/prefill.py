"""Admission and prefill under a per-step token budget (chunked prefill).

``PrefillDriver`` is the part of ``SpecEngine`` that admits requests and prefills
their prompts (the engine owns requests and failure; ``RoundDriver`` the rounds).

Each step, before the round, spends at most ``scheduler.prefill_token_budget``
prompt tokens, first come first served: first the requests already being prefilled
(they hold pool rows), in arrival order, then waiting requests while rows and budget
last. A request whose prompt does not fit what is left is prefilled in chunks over
several steps; it joins the rounds after its final chunk, which makes the bonus and
candidate 1 as a whole-prompt prefill does. All of a step's chunks are one eager
forward of the target and one of the draft (a unit of work): chunk ``[a, b)`` of a
row runs at positions a..b-1 and reads the positions before a from the pools, as a
verify window does. Budget 0 is unlimited: every admitted prompt is one final chunk.

Why a chunk is exact: its SWA and compressor rings keep the last ``window + N - 1``
and ``coff*ratio + N - 1`` positions of the chunk before it, and a row at position
p >= a reads at most ``window - 1`` and ``coff*ratio - 1`` positions back; compressed
entries and indexer keys of blocks finished before a are in the entry pools. NextN
row p pairs token p+1 with target hidden p, and for a chunk that stops inside its
prompt token b is the prompt's own, so nothing waits for a later chunk.

Faults: a fault in a step's prefill fails exactly the requests that had a chunk in
it (rows released). An interrupt puts them back at the head of the queue, rows
released and progress dropped (``prefilled`` 0): a chunk cut short may have written
its ring slots already, which hold positions before ``a`` that a rerun from ``a``
would read (its writes wrap onto them once it is longer than N), so a request starts
its prefill over instead of resuming it. A request's progress only moves once its
chunk's forward (and, for a final chunk, the bonus's readback) succeeded.
"""

from __future__ import annotations

import sys

import torch

from ..memory.batch import Chunk
from ..parallel.control import Message
from . import phases
from .request import Request
from .sampling import RowParams, SamplingParams


def budget_chunks(prefilling: list[Request], budget: int) -> list[tuple[Request, int]]:
    """The step's chunks, first come first served: (request, end) for each request that
    gets one, its chunk the prompt positions ``request.prefilled .. end - 1``; at most
    ``budget`` positions in all (0: unlimited)."""
    left = budget or sys.maxsize
    plan = []
    for req in prefilling:
        if left <= 0:
            break
        take = min(len(req.prompt) - req.prefilled, left)
        plan.append((req, req.prefilled + take))
        left -= take
    return plan


class PrefillDriver:
    """Mixed into ``SpecEngine``: uses its queue, pools, state, stats and commit/fail."""

    # requests holding a pool row whose prompt is not fully prefilled yet, by rid in
    # arrival order (dicts keep insertion order)
    _prefilling: dict[int, Request]
    prefill_budget: int  # scheduler.prefill_token_budget: 0 = unlimited

    def _take_waiting(self) -> None:
        """Rows for waiting requests while the pool has rows and the step has budget."""
        pool = self.models.target_pool
        left = self.prefill_budget or sys.maxsize
        left -= sum(len(r.prompt) - r.prefilled for r in self._prefilling.values())
        while left > 0 and self._num_waiting and pool.free_rows:
            req = self._waiting.popleft()
            if req.finished:  # aborted while waiting
                continue
            req.row = pool.alloc()
            self._num_waiting -= 1
            self._prefilling[req.rid] = req
            left -= len(req.prompt)

    @torch.no_grad()
    def _admit(self) -> None:
        self._take_waiting()
        plan = budget_chunks(list(self._prefilling.values()), self.prefill_budget)
        if not plan:
            return
        reqs = [r for r, _ in plan]
        try:
            bonus = self._prefill(plan)
        except Exception as exc:
            if self.tp.parallel:  # the ranks' states may now differ: nothing can go on
                self._fail_group(reqs, exc, "prefill")
            else:
                self._fail(reqs, exc, "prefill")
            return
        except BaseException:  # an interrupt: back to the head of the queue, from scratch
            for req in reversed(reqs):
                self._prefilling.pop(req.rid)
                self.models.target_pool.release(req.row)
                req.row, req.prefilled = 0, 0
                self._waiting.appendleft(req)
            self._num_waiting += len(reqs)
            raise
        st = self.stats
        st.prefill_forwards += 1
        st.nextn_extend_forwards += int(self.num_steps > 0)
        st.prefill_chunks += len(plan)
        done = [req for req, end in plan if end == len(req.prompt)]
        st.prompt_tokens += sum(len(r.prompt) for r in done)
        for req, end in plan:
            req.prefilled = end
        for req, tok in zip(done, bonus):
            del self._prefilling[req.rid]
            req.copy = 0
            self._running[req.row] = req
            self._commit(req, [tok], [])

    def _prefill(self, plan: list[tuple[Request, int]]) -> list[int]:
        """One step's chunks into the rows' copy 0 -> the final chunks' bonus tokens (host)."""
        chunks = [Chunk(r.row, r.prefilled, r.prompt[r.prefilled:end]) for r, end in plan]
        nexts = [r.prompt[end] if end < len(r.prompt) else None for r, end in plan]
        params = [r.sampling for r, end in plan if end == len(r.prompt)]
        if self.tp.parallel:  # the other ranks prefill the same chunks
            self.tp.channel.send(Message("prefill", self.engine_id, (chunks, nexts, params)))
        bonus = self._prefill_chunks(chunks, nexts, params)
        return bonus.tolist() if params else []

    def _prefill_chunks(self, chunks: list[Chunk], nexts: list[int | None],
                        params: list[SamplingParams]) -> torch.Tensor:
        """Every rank's part of a step's prefill: -> the final chunks' bonus tokens [F]
        (on the device). ``params``: the final chunks' (``nexts`` None), in order."""
        sampled = [not p.greedy for p in params]
        row_params = RowParams.of(params, self.device) if any(sampled) else None
        bonus, cand1, seed, q1 = phases.prefill(self.models, chunks, nexts, self.device,
                                                with_draft=self.num_steps > 0,
                                                params=row_params)
        if not params:
            return bonus
        final = [c for c, n in zip(chunks, nexts) if n is None]
        rows = [c.req_index for c in final]
        slots = torch.tensor([self.state.slot(r, 0) for r in rows], device=self.device)
        lengths = torch.tensor([c.start + len(c.tokens) for c in final], device=self.device)
        self.state.store(slots, lengths, bonus, cand1, seed)
        if self.samples:  # every row's parameters, greedy ones too (a sampling chunk
            tables = self.runner.phases.sampling  # gathers them for all its rows)
            tables.store(torch.tensor(rows, device=self.device),
                         row_params or RowParams.of(params, self.device))
            if q1 is not None:
                tables.q1.index_put_((slots,), q1)
        for row, s in zip(rows, sampled):
            self._sampled_rows[row] = s
        return bonus

    # -- following rank 0 (tensor-parallel ranks other than 0) ---------------------------
    @torch.no_grad()
    def follow_prefill(self, chunks: list[Chunk], nexts: list[int | None],
                       params: list[SamplingParams]) -> None:
        self._prefill_chunks(chunks, nexts, params)
