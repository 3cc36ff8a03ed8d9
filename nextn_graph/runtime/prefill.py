"""Chunked prefill under a per-step token budget: a step's chunks are one eager forward
of the target and one of the draft; chunk [a, b) reads positions before a from the
pools, as a verify window does. An interrupt requeues the step's requests from scratch:
a chunk cut short may have overwritten ring slots that a rerun from a would read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..memory.batch import Chunk
from ..parallel.control import Message
from ..parallel.group import TPGroup
from . import eagle
from .buffers import RequestState, SamplingTables
from .eagle import SpecModels
from .penalty_tables import PenaltyTables
from .prefix_reuse import NO_PREFIX, PrefillPrefix
from .request import Request, TokenLogprob, token_logprobs
from ..sampling import RowParams, SamplingParams
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

    def _prefill(self, plan: list[tuple[Request, int]]):
        """-> (the final chunks' bonus tokens, logprobs by rid; host)."""
        fills = [r.fill for r, _ in plan]
        chunks = [Chunk(r.row, r.prefilled, f[r.prefilled:end]) for (r, end), f in zip(plan, fills)]
        nexts = [f[end] if end < len(f) else None for (_, end), f in zip(plan, fills)]
        finals = [r for (r, end), f in zip(plan, fills) if end == len(f)]
        params = [r.sampling for r in finals]
        # a preempted request resumes: its bonus is the one it had, its output counted
        resumes = [Resume(len(r.prompt), r.output) if r.output else None for r in finals]
        reuse = self.sched.prefix
        prefix = NO_PREFIX if reuse is None else reuse.plan(plan)
        marks = None
        if self.penalties is not None and (prefix.seeds or any(r.output for r, _ in plan)):
            marks = [prompt_marks(c, r, seeded) for c, seeded, (r, _) in
                     zip(chunks, prefix.seeds or [0] * len(plan), plan)]
        if self.tp.parallel:  # the other ranks prefill the same chunks into the same pages
            pool = self.models.target_pool
            tables = [(r.row, pool.held[r.row]) for r, _ in plan if r.prefilled == r.cached]
            self.tp.channel.send(Message("prefill", self.engine_id, (
                chunks, nexts, params, tables, prefix, marks, resumes)))
        rows, k = logprob_rows(plan)
        bonus, lp = self.run_chunks(chunks, nexts, params,
                                    torch.tensor(sum(rows.values(), []), device=self.device)
                                    if rows else None, k, prefix, marks, resumes)
        bonus = bonus.tolist() if params else []
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

    def run_chunks(self, chunks: list[Chunk], nexts: list[int | None],
                   params: list[SamplingParams], lp_rows: torch.Tensor | None = None,
                   lp_k: int = 0, prefix: PrefillPrefix = NO_PREFIX,
                   marks: list[Chunk] | None = None, resumes: list | None = None):
        """Every rank's part of a step's prefill -> (the final chunks' bonus [F], on the
        device; logprobs of ``lp_rows`` or None). ``params``: the final chunks'.
        ``prefix``: the prefix cache's part; ``marks``: the prompt tokens the penalties
        count, where they differ from ``chunks`` (a hit's cached ones, a resumed request's
        prompt alone); ``resumes``: per final chunk, a preempted request's ``Resume``
        (its bonus kept, its output counted) or None."""
        row_params = (RowParams.of(params, self.device) if any(not p.greedy for p in params)
                      else None)
        final = [c for c, n in zip(chunks, nexts) if n is None]
        rows = [c.req_index for c in final]
        ends = [c.start + len(c.tokens) for c in final]
        lengths = torch.tensor(ends, device=self.device)  # [F] P (L for a resumed request)
        resumes = resumes or [None] * len(final)
        forced = None
        if any(resumes):  # [F] the bonus a resumed request had, -1: draw it
            forced = torch.tensor([r.output[-1] if r else -1 for r in resumes], device=self.device)
        pen, process = self.penalties, None
        if pen is not None:  # the prompt's tokens, then the final rows' parameters
            pen.mark_prompt(marks or chunks)
            if final:
                pen.admit(rows, params, [r.prompt_len if r else n for r, n in zip(resumes, ends)])
                for row, r, n in zip(rows, resumes, ends):
                    if r:
                        pen.resume(row, r.output[:-1], n)
                at = torch.tensor(rows, device=self.device)
                before = lengths - 1  # L = P - 1: row P
                none = torch.zeros(len(rows), 0, dtype=torch.long, device=self.device)
                process = lambda x: pen.logits(x.unsqueeze(1), at, before, none).squeeze(1)  # noqa: E731
        if prefix.restore:  # a hit's ring state, before anything reads or writes the rows
            snaps, onto, ends = (list(x) for x in zip(*prefix.restore))
            self.models.target_pool.restore(snaps, onto, ends)
            self.models.draft_pool.restore(snaps, onto, ends)
        bonus, cand1, seed, q1, lp = eagle.prefill(
            self.models, chunks, nexts, self.device, with_draft=self.num_steps > 0,
            params=row_params, lp_rows=lp_rows, lp_k=lp_k, process=process,
            prefix=prefix, boundary_hidden=self.boundary_hidden, forced=forced)
        if not params:
            return bonus, lp
        slots = torch.tensor([self.state.map.slot(r) for r in rows], device=self.device)
        if pen is not None:  # the first token: the first round counts it
            pen.stage(slots, bonus.unsqueeze(1), torch.ones_like(bonus))
        self.state.store(slots, lengths, bonus, cand1, seed)
        if self.sampling is not None:
            # every row's parameters, greedy ones too: a sampling chunk gathers all its rows'
            self.sampling.store(torch.tensor(rows, device=self.device),
                                row_params or RowParams.of(params, self.device))
            if q1 is not None:
                self.sampling.q1.index_put_((slots,), q1)
        return bonus, lp


def logprob_rows(plan: list[tuple[Request, int]]) -> tuple[dict[int, list[int]], int]:
    """-> (batch rows whose logprobs were asked, by rid: all chunk rows for prompt
    logprobs, else a final chunk's last row; the largest k asked)."""
    rows, k, at = {}, 0, 0
    for req, end in plan:
        n, final = end - req.prefilled, end == req.fill_len
        if req.output:  # resumed: its logprobs went out with its tokens
            pass
        elif req.prompt_logprobs is not None:
            rows[req.rid] = list(range(at, at + n))
        elif final and req.logprobs is not None:
            rows[req.rid] = [at + n - 1]
        if req.rid in rows:
            k = max(k, req.logprobs or 0, req.prompt_logprobs or 0)
        at += n
    return rows, k


@dataclass(frozen=True)
class Resume:
    """A preempted request's final prefill chunk: ``prompt_len`` P, ``output`` so far
    (its last token is the bonus the prefill keeps)."""

    prompt_len: int
    output: list[int]


def prompt_marks(chunk: Chunk, req: Request, seeded: int) -> Chunk:
    """The prompt tokens the penalties count for ``chunk`` of ``req``: a resumed request's
    prompt with its first chunk and nothing after; a hit's prompt up to the chunk's end
    with its first (``seeded``); else the chunk's own."""
    if req.output:
        first = chunk.start == req.cached
        return Chunk(chunk.req_index, 0 if first else chunk.start, req.prompt if first else [])
    if seeded:
        return Chunk(chunk.req_index, 0, req.prompt[:chunk.start + len(chunk.tokens)])
    return chunk


def _top(lp: TokenLogprob, k: int | None) -> TokenLogprob:
    return dataclasses.replace(lp, top=lp.top[:k or 0])
