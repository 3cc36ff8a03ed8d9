"""Chunked prefill under a per-step token budget: a step's chunks are one eager forward
of the target and one of the draft; chunk [a, b) reads positions before a from the
pools, as a verify window does. An interrupt requeues the step's requests from scratch:
a chunk cut short may have overwritten ring slots that a rerun from a would read.

Rank 0 turns the scheduler's plan into a ``PrefillWork`` (``work``), the one argument
of the device prefill every rank runs (``run``), and commits what it read back."""

from __future__ import annotations

import dataclasses

import torch

from ..memory.batch import Chunk
from ..parallel.group import TPGroup
from ..parallel.messages import PrefillChunks
from ..sampling import RowParams
from .buffers import RequestState, SamplingTables
from .models import SpecModels
from .penalty_tables import PenaltyTables
from .prefill_forward import prefill_forward
from .prefill_work import NO_PREFIX, PrefillWork, Resume, logprob_rows, prompt_marks
from .request import Request, TokenLogprob, token_logprobs
from .scheduler import Scheduler
from .stats import SpecStats


class Prefiller:
    """Prefills what ``scheduler`` plans into the pools and the rows' state copy 0, then
    hands the final chunks' requests back to it to run."""

    def __init__(self, models: SpecModels, state: RequestState, sampling: SamplingTables | None,
                 stats: SpecStats, scheduler: Scheduler, tp: TPGroup, engine_id: int,
                 num_steps: int, penalties: PenaltyTables | None = None,
                 boundary_hidden: torch.Tensor | None = None):
        self.models, self.state, self.sampling, self.stats = models, state, sampling, stats
        self.sched, self.tp, self.engine_id = scheduler, tp, engine_id
        self.num_steps = num_steps
        self.penalties = penalties
        self.device = state.lengths.device
        # [snapshots + 1, hc*H]: by snapshot, the target's hidden before its boundary
        self.boundary_hidden = boundary_hidden

    @torch.no_grad()
    def step(self) -> None:
        plan = self.sched.plan_prefill()
        if not plan:
            return
        reqs = [r for r, _ in plan]
        try:
            bonus, logprobs = self._prefill(plan)
        except Exception as exc:  # on a group the ranks' states may now differ: all fail
            self.sched.fail_unit(reqs, reqs, exc, "prefill")
            return
        except BaseException:  # an interrupt: back to the head of the queue, from scratch
            self.sched.requeue(reqs)
            raise
        st = self.stats
        st.prefill_forwards += 1
        st.nextn_extend_forwards += int(self.num_steps > 0)
        st.prefill_chunks += len(plan)
        finals = [r for r, end in plan if end == r.fill_len]
        st.prompt_tokens += sum(len(r.prompt) for r in finals if not r.output)
        st.cached_tokens += sum(r.cached for r in finals if not r.output)
        st.recomputed_tokens += sum(r.fill_len - r.cached for r in finals if r.output)
        self.sched.prefilled(plan, bonus, logprobs)

    def work(self, plan: list[tuple[Request, int]], rows: dict[int, list[int]],
             k: int) -> PrefillWork:
        """The device work of prefilling ``plan`` (request, end): rank 0's decisions;
        ``rows``, ``k``: the logprobs asked (``logprob_rows``)."""
        fills = [r.fill for r, _ in plan]
        chunks = tuple(Chunk(r.row, r.prefilled, f[r.prefilled:end])
                       for (r, end), f in zip(plan, fills))
        nexts = tuple(f[end] if end < len(f) else None for (_, end), f in zip(plan, fills))
        finals = [r for r, end in plan if end == r.fill_len]
        reuse = self.sched.prefix
        prefix = NO_PREFIX if reuse is None else reuse.plan(plan)
        marks = None
        if self.penalties is not None and (prefix.seeds or any(r.output for r, _ in plan)):
            marks = tuple(prompt_marks(c, r, seeded) for c, seeded, (r, _) in
                          zip(chunks, prefix.seeds or [0] * len(plan), plan))
        pool = self.models.target_pool
        return PrefillWork(
            chunks, nexts, tuple(r.sampling for r in finals),
            # the requests admitted this step: their first chunk (after a hit's pages)
            tables=tuple((r.row, tuple(pool.held[r.row])) for r, _ in plan
                         if r.prefilled == r.cached) if self.tp.parallel else (),
            prefix=prefix, marks=marks,
            # a preempted request resumes: its bonus is the one it had, its output counted
            resumes=tuple(Resume(len(r.prompt), tuple(r.output)) if r.output else None
                          for r in finals),
            lp_rows=tuple(sum(rows.values(), [])), lp_k=k)

    def _prefill(self, plan: list[tuple[Request, int]]):
        """-> (the final chunks' bonus tokens, logprobs by rid; host)."""
        rows, k = logprob_rows(plan)
        work = self.work(plan, rows, k)
        if self.tp.parallel:  # the other ranks prefill the same chunks into the same pages
            self.tp.channel.send(PrefillChunks(self.engine_id, work))
        bonus, lp = self.run(work)
        bonus = bonus.tolist() if work.params else []
        return bonus, self._logprobs(plan, rows, lp, bonus)

    @staticmethod
    def _logprobs(plan: list[tuple[Request, int]], rows: dict[int, list[int]], lp,
                  bonus: list[int]) -> dict:
        """By rid: (the prompt logprobs of the request's chunk, the bonus's or None)."""
        if not rows:
            return {}
        values, ids = lp[0].cpu(), lp[1].cpu()
        finals = iter(bonus)
        out, at = {}, 0
        for req, end in plan:
            final = end == req.fill_len
            tok = next(finals) if final else None
            if req.rid not in rows:
                continue
            n = len(rows[req.rid])
            # row p holds the logprob of token p + 1: the prompt's, or the bonus
            tokens = req.prompt[end - n + 1:end + 1] + ([tok] if final else [])
            got = token_logprobs(tokens, values[at:at + n], ids[at:at + n],
                                 max(req.logprobs or 0, req.prompt_logprobs or 0))
            at += n
            prompt = got[:n - final] if req.prompt_logprobs is not None else ()
            out[req.rid] = (tuple(_top(t, req.prompt_logprobs) for t in prompt),
                            _top(got[-1], req.logprobs) if final and req.logprobs is not None
                            else None)
        return out

    def run(self, work: PrefillWork):
        """Every rank's part of a step's prefill -> (the final chunks' bonus [F], on the
        device; logprobs of ``work.lp_rows`` or None)."""
        dev, params = self.device, work.params
        row_params = RowParams.of(params, dev) if any(not p.greedy for p in params) else None
        final = work.finals
        rows = [c.req_index for c in final]
        ends = [c.start + len(c.tokens) for c in final]
        lengths = torch.tensor(ends, device=dev)  # [F] P (L for a resumed request)
        resumes = work.resumes or (None,) * len(final)
        forced = None
        if any(resumes):  # [F] the bonus a resumed request had, -1: draw it
            forced = torch.tensor([r.output[-1] if r else -1 for r in resumes], device=dev)
        process = self._penalize(work, rows, ends, resumes)
        prefix = work.prefix
        if prefix.restore:  # a hit's ring state, before anything reads or writes the rows
            snaps, onto, at = (list(x) for x in zip(*prefix.restore))
            self.models.target_pool.restore(snaps, onto, at)
            self.models.draft_pool.restore(snaps, onto, at)
        lp_rows = torch.tensor(work.lp_rows, device=dev) if work.lp_rows else None
        bonus, cand1, seed, q1, lp = prefill_forward(
            self.models, list(work.chunks), list(work.nexts), dev,
            with_draft=self.num_steps > 0, params=row_params, lp_rows=lp_rows,
            lp_k=work.lp_k, process=process, prefix=prefix,
            boundary_hidden=self.boundary_hidden, forced=forced)
        if not params:
            return bonus, lp
        slots = torch.tensor([self.state.map.slot(r) for r in rows], device=dev)
        if self.penalties is not None:  # the first token: the first round counts it
            self.penalties.stage(slots, bonus.unsqueeze(1), torch.ones_like(bonus))
        self.state.store(slots, lengths, bonus, cand1, seed)
        if self.sampling is not None:
            # every row's parameters, greedy ones too: a sampling chunk gathers all its rows'
            self.sampling.store(torch.tensor(rows, device=dev),
                                row_params or RowParams.of(params, dev))
            if q1 is not None:
                self.sampling.q1.index_put_((slots,), q1)
        return bonus, lp

    def _penalize(self, work: PrefillWork, rows: list[int], ends: list[int],
                  resumes: tuple[Resume | None, ...]):
        """The prompt's tokens counted, then the final rows' parameters -> the bonus
        rows' logit processing, or None without penalties."""
        pen = self.penalties
        if pen is None:
            return None
        pen.mark_prompt(list(work.marks or work.chunks))
        if not rows:
            return None
        pen.admit(rows, list(work.params),
                  [r.prompt_len if r else n for r, n in zip(resumes, ends)])
        for row, r, n in zip(rows, resumes, ends):
            if r:
                pen.resume(row, list(r.output[:-1]), n)
        dev = self.device
        at = torch.tensor(rows, device=dev)
        before = torch.tensor(ends, device=dev) - 1  # L = P - 1: row P
        none = torch.zeros(len(rows), 0, dtype=torch.long, device=dev)
        return lambda x: pen.logits(x.unsqueeze(1), at, before, none).squeeze(1)


def _top(lp: TokenLogprob, k: int | None) -> TokenLogprob:
    return dataclasses.replace(lp, top=lp.top[:k or 0])
