"""The scheduler: which requests wait, are prefilled, run, and what a step returns.
Host bookkeeping only. An aborted request stays in the waiting queue until admission
skips it, so ``abort`` is O(1) however long the queue."""

from __future__ import annotations

import collections
import logging
import sys
from typing import Sequence

from ..memory.pool import KVPool
from ..sampling import SamplingParams
from .prefix_reuse import PrefixReuse
from .request import Request, StepOutput, TokenLogprob
from .stats import SpecStats

log = logging.getLogger(__name__)


def budget_chunks(prefilling: list[Request], budget: int) -> list[tuple[Request, int]]:
    """(request, end) per chunk, first come first served: positions ``prefilled ..
    end - 1``, at most ``budget`` in all (0: unlimited)."""
    left = budget or sys.maxsize
    plan = []
    for req in prefilling:
        if left <= 0:
            break
        take = min(req.fill_len - req.prefilled, left)
        plan.append((req, req.prefilled + take))
        left -= take
    return plan


class Scheduler:
    """``rank``: the tensor-parallel rank (None without a group), where a fault fails
    every live request (``fail_all``)."""

    def __init__(self, pool: KVPool, stats: SpecStats, prefill_budget: int,
                 rank: int | None = None, lookahead: int = 0,
                 prefix: PrefixReuse | None = None, width: int = 1, grow: bool = False):
        self.pool = pool  # the target pool's rows (the draft pool numbers rows the same)
        self.prefix = prefix  # the prefix cache's admission and inserts (None: off)
        self.width = width  # N: the positions one round writes
        # pages on demand (``pool.allocation: grow``): a request holds the pages of the
        # next round's writes, more before each round, and the newest running request
        # goes back to wait (recomputed later) when none are left
        self.grow = grow
        self.lookahead = lookahead  # positions verify windows write past the last output
        self.stats = stats
        self.prefill_budget = prefill_budget  # scheduler.prefill_token_budget: 0 = unlimited
        self.rank = rank
        self.waiting: collections.deque[Request] = collections.deque()
        self.num_waiting = 0  # live requests in waiting
        # by rid in arrival order (dicts keep insertion order): rows held, prompts part done
        self.prefilling: dict[int, Request] = {}
        self.running: dict[int, Request] = {}  # by pool row
        self.live: dict[int, Request] = {}  # by rid: waiting, being prefilled or running
        self.outbox: list[StepOutput] = []  # made but not yet returned by a step
        self.broken: str | None = None  # why a tensor-parallel group can no longer run
        self.next_rid = 0

    @property
    def has_work(self) -> bool:
        return bool(self.num_waiting or self.prefilling or self.running or self.outbox)

    @property
    def num_in_flight(self) -> int:
        return self.num_waiting + len(self.prefilling) + len(self.running)

    def add(self, prompt: list[int], max_new_tokens: int, stop_ids: frozenset[int],
            sampling: SamplingParams, logprobs: int | None = None,
            prompt_logprobs: int | None = None) -> int:
        req = Request(self.next_rid, prompt, max_new_tokens, stop_ids, sampling,
                      logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        self.next_rid += 1
        self.waiting.append(req)
        self.live[req.rid] = req
        self.num_waiting += 1
        return req.rid

    def abort(self, rid: int) -> bool:
        """The row goes back at once; unreturned outputs are dropped."""
        req = self.live.get(rid)
        if req is None:
            return False
        if req.row:
            self.release(req)
        else:  # still waiting: admission skips it
            del self.live[rid]
            self.num_waiting -= 1
            if not self.num_waiting:
                self.waiting.clear()
        req.finished = True
        if self.outbox:
            self.outbox = [o for o in self.outbox if o.rid != rid]
        return True

    def take_outputs(self) -> list[StepOutput]:
        outs, self.outbox = self.outbox, []
        return outs

    def plan_prefill(self) -> list[tuple[Request, int]]:
        self.take_waiting()
        return budget_chunks(list(self.prefilling.values()), self.prefill_budget)

    def positions(self, req: Request) -> int:
        """The positions a request's writes can reach; reserved at admission unless pages
        grow on demand (then ``reach`` is what it holds)."""
        return len(req.prompt) + req.max_new_tokens + self.lookahead

    def reach(self, req: Request) -> int:
        """The positions a request holds pages for: all it can reach, or with pages on
        demand those of its next round's writes (a round in flight's too, ``lookahead``)."""
        full = self.positions(req)
        if not self.grow:
            return full
        return min(full, max(req.committed, req.fill_len) + self.width + self.lookahead)

    def take_waiting(self) -> None:
        """Rows and pages for waiting requests, first come first served, while the pool has
        both for the head of the queue and the step has budget."""
        left = self.prefill_budget or sys.maxsize
        left -= sum(r.fill_len - r.prefilled for r in self.prefilling.values())
        deferred: list[Request] = []  # wait for a prefix another request is prefilling
        while left > 0 and self.waiting:
            req = self.waiting[0]
            if not req.finished and self.prefix is not None and \
                    self.prefix.waits(req, self.prefilling.values()):
                deferred.append(self.waiting.popleft())
                continue
            try:
                admitted = req.finished or self._admit(req)
            except Exception as exc:
                # a device fault writing its page table fails this request alone: the
                # pool's alloc is all or nothing, so it holds nothing
                self.waiting.popleft()
                self.num_waiting -= 1
                self.fail_unit([req], [req], exc, "admission")
                continue
            if not admitted:
                break
            self.waiting.popleft()
            if req.finished:  # aborted while waiting
                continue
            self.num_waiting -= 1
            self.prefilling[req.rid] = req
            left -= req.fill_len - req.prefilled
        self.waiting.extendleft(reversed(deferred))

    def _admit(self, req: Request) -> bool:
        """A row and pages for ``req``, all or nothing -> False: no room. With the prefix
        cache, its longest cached prefix's pages are shared, and cached prefixes are
        evicted (not the match) when pages are short."""
        reach, prefix = self.reach(req), self.prefix
        m = prefix.lookup(req) if prefix is not None else None
        shared = m.pages if m is not None else ()
        try:
            if not self.pool.fits(reach, len(shared)) and m is not None and self.pool.free_rows:
                prefix.cache.evict(self.pool.pages_needed(reach) - len(shared)
                                   - self.pool.free_pages)
            if not self.pool.fits(reach, len(shared)):
                if m is not None:
                    prefix.cache.unlock(m)
                return False
            req.row = self.pool.alloc(reach, shared=shared)
        except BaseException:  # a device fault writing the page table: nothing was taken
            if m is not None:
                prefix.cache.unlock(m)
            raise
        if m is not None:
            prefix.attach(req, m)
        return True

    def grow_pages(self, live: list[Request], preempt: bool) -> tuple[bool, list]:
        """Pages for the next round's writes of every request of ``live`` (oldest first),
        evicting cached prefixes, and with ``preempt`` sending the newest requests back
        to wait when that is not enough -> (whether all of ``live`` that still run have
        them; the (row, pages) tables that changed). Without ``preempt``, stops at the
        first request that would need it."""
        grown = []
        for req in sorted(live, key=lambda r: r.rid):
            if req.row == 0 or self.running.get(req.row) is not req:
                continue  # preempted here already
            more = self.pool.pages_needed(self.reach(req)) - len(self.pool.held[req.row])
            while more > 0 and more > self.pool.free_pages:
                if self.prefix is not None and self.prefix.cache.evict(
                        more - self.pool.free_pages):
                    continue
                if not preempt:
                    return False, grown
                victim = max((r for r in live if self.running.get(r.row) is r),
                             key=lambda r: r.rid)
                self.preempt(victim)
                if victim is req:
                    break
            if self.running.get(req.row) is req and more > 0:
                try:
                    self.pool.grow(req.row, more)
                except Exception as exc:  # a device fault writing its page table
                    self.fail_unit([req], live, exc, "page growth")
                    if self.broken:
                        return True, grown
                    continue
                grown.append((req.row, self.pool.held[req.row]))
        return True, grown

    def preempt(self, req: Request) -> None:
        """Back to the head of the queue with its output: its row and pages freed, it is
        prefilled again (prompt and output, ``Request.fill``) and resumes where it was."""
        log.info("preempting request %d at %d positions: KV pages ran out", req.rid,
                 req.committed)
        self.running.pop(req.row, None)
        self._free(req)
        req.row, req.prefilled, req.cached, req.copy = 0, 0, 0, 0
        self.waiting.appendleft(req)
        self.num_waiting += 1
        self.stats.preemptions += 1

    def prefilled(self, plan: list[tuple[Request, int]], bonus: Sequence[int],
                  logprobs: dict[int, tuple] | None = None) -> None:
        """``bonus``: the final chunks', in plan order. ``logprobs``: by rid, (the chunk's
        prompt logprobs, the bonus's or None)."""
        logprobs = logprobs or {}
        for req, end in plan:
            req.prefilled = end
            req.prompt_lps.extend(logprobs.get(req.rid, ((), None))[0])
        done = [req for req, end in plan if end == req.fill_len]
        for req, tok in zip(done, bonus):
            del self.prefilling[req.rid]
            if self.prefix is not None:
                self.prefix.prefilled(req)
            req.copy = 0
            self.running[req.row] = req
            if req.output:  # resumed after a preemption: its bonus was emitted already
                continue
            lp = logprobs.get(req.rid, ((), None))[1]
            prompt_lps = None
            if req.prompt_logprobs is not None:
                prompt_lps, req.prompt_lps = (None, *req.prompt_lps), []
            self.commit(req, [tok], [], logprobs=lp and (lp,), prompt_logprobs=prompt_lps,
                        cached_tokens=req.cached)

    def requeue(self, reqs: list[Request]) -> None:
        """An interrupt: back to the head of the queue, the prefill starts over."""
        for req in reversed(reqs):
            self.prefilling.pop(req.rid)
            self._free(req)
            req.row, req.prefilled, req.prompt_lps, req.cached = 0, 0, [], 0
            self.waiting.appendleft(req)
        self.num_waiting += len(reqs)

    def release(self, req: Request) -> None:
        self.running.pop(req.row, None)  # absent while being prefilled
        self.prefilling.pop(req.rid, None)
        self.live.pop(req.rid, None)
        self._free(req)

    def _free(self, req: Request) -> None:
        if self.prefix is not None:
            self.prefix.drop(req)
        self.pool.release(req.row)

    def commit(self, req: Request, tokens: list[int], drafts: list[int],
               hold: bool = False, accepted: int | None = None,
               logprobs: tuple[TokenLogprob, ...] | None = None,
               prompt_logprobs: tuple | None = None, cached_tokens: int | None = None) -> None:
        """``hold``: the request is in the round in flight, which releases its row.
        ``logprobs``: one per token (cut with the tokens at a stop or the length)."""
        kept = req.emit(tokens)
        self.stats.emitted_tokens += len(kept)
        if req.finished and not hold:
            self.release(req)
        self.outbox.append(StepOutput(req.rid, kept, req.finished, drafts, accepted=accepted,
                                      logprobs=logprobs and logprobs[:len(kept)],
                                      prompt_logprobs=prompt_logprobs,
                                      cached_tokens=cached_tokens))

    def audit(self) -> None:
        """Every held pool row is a live request's, every page, snapshot and prefix lock
        is held by a live request or the prefix cache, exactly (tests and debugging)."""
        rows = sorted(r.row for r in self.live.values() if r.row)
        if rows != sorted(self.pool.held):
            raise AssertionError(f"KV pool rows {sorted(self.pool.held)} are held, live "
                                 f"requests hold {rows}")
        if self.prefix is not None:
            self.prefix.audit(list(self.live.values()))
        else:
            self.pool.audit()

    def fail(self, reqs: list[Request], exc: Exception, where: str) -> None:
        reason = f"{where}: {type(exc).__name__}: {str(exc)[:500]}"
        log.error("%s; failing requests %s", reason, [r.rid for r in reqs], exc_info=exc)
        self.stats.faults += 1
        self.stats.failed_requests += len(reqs)
        for req in reqs:
            req.finished = True
            if req.row:
                self.release(req)
            else:  # still waiting (a group failure fails the queue too)
                self.live.pop(req.rid, None)
            self.outbox.append(StepOutput(req.rid, [], True, [], error=reason))

    def fail_all(self, reqs: list[Request], exc: Exception, where: str) -> None:
        """The ranks may have run different work (or a rank is gone): every live request
        fails, later steps raise ``ParallelError``."""
        others = [r for r in self.live.values() if r not in reqs and not r.finished]
        self.fail(list(reqs) + others, exc, f"{where} (tensor-parallel rank {self.rank})")
        self.waiting.clear()
        self.num_waiting = 0
        self.broken = f"{where}: {type(exc).__name__}: {str(exc)[:300]}"

    def fail_unit(self, unit: list[Request], active: list[Request], exc: Exception,
                  where: str) -> None:
        if self.rank is None:
            self.fail(unit, exc, where)
        else:
            self.fail_all(active, exc, where)
