"""The engine's use of the prefix cache (``memory/prefix.py``): admission (the
``Scheduler``'s) shares the pages of a prompt's longest cached prefix, a prefill keeps the state at the page boundaries it
computes, and a finished prefill caches its prompt's blocks.

A hit at ``M`` positions (whole pages, at most ``len(prompt) - 1``) reuses:
- the pages of positions ``< M``: compressed entries and indexer keys, shared read-only
  (a request writes entries only at positions it computes, all ``>= M``);
- the snapshot of the match's end: the SWA window and C4's raw block before ``M``, in
  every layer of both models, copied onto the request's rings before its first chunk;
- the target's hidden at ``M - 1``, kept with the snapshot: the draft's KV at ``M - 1``
  was computed from token ``M`` of the prompt that filled the cache, so the first chunk
  recomputes that one draft row from the kept hidden and this prompt's token ``M`` (no
  whole-block drop, and no dependence on whether the next tokens match).
Everything else (positions ``M ..``) is prefilled as usual, so a hit's tokens and drafts
are those of a cold prefill. Host bookkeeping; ``PrefillPrefix`` is what every rank
does on the device.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import ConfigError
from ..memory.pool import KVPool
from ..memory.prefix import PrefixCache, PrefixMatch
from .models import SpecModels
from .prefill_work import PrefillPrefix
from .request import Request


class PrefixReuse:
    """``carry``: the most positions before a boundary that any ring keeps."""

    def __init__(self, cache: PrefixCache, pool: KVPool, carry: int):
        self.cache, self.pool, self.carry = cache, pool, carry
        self.page_size = pool.layout.page_size

    def lookup(self, req: Request) -> PrefixMatch:
        """The longest cached prefix of ``req``'s fill, locked (the scheduler's eviction
        for the rest of its pages must not drop it): ``attach`` it to the request that
        got its row, or ``unlock`` it."""
        fill = req.fill
        limit = len(fill) - 1 if req.prompt_logprobs is None else 0  # they need every row
        m = self.cache.match(fill, limit, count=False)
        self.cache.lock(m)
        return m

    def attach(self, req: Request, m: PrefixMatch) -> None:
        """``req`` was given a row over ``m``'s pages: it prefills from the match's end."""
        req.match, req.cached = m, m.tokens
        req.prefilled = m.tokens
        if not req.output:  # (a preempted request's recompute is no prompt looked up)
            self.cache.stats.record(len(req.prompt), m.tokens)

    def waits(self, req: Request, prefilling: Iterable[Request]) -> bool:
        """``req``'s next uncached page is being prefilled by another request, which will
        cache it: ``req`` does better to wait for it than to compute it again (as
        SGLang's in-batch prefix check deprioritises such requests)."""
        fill = req.fill
        limit = len(fill) - 1 if req.prompt_logprobs is None else 0
        end = self.cache.match(fill, limit, count=False).tokens + self.page_size
        if end > limit:
            return False
        head = fill[:end]
        return any(r.cached < end <= r.fill_len and r.fill[:end] == head
                   for r in prefilling)

    def plan(self, plan: list[tuple[Request, int]]) -> PrefillPrefix:
        """The device work of prefilling ``plan`` (request, end): snapshots taken for
        the boundaries its chunks reach, restores and draft seeds for first chunks after a
        hit."""
        ps = self.page_size
        restore, snapshot, seeds, keep = [], [], [], []
        at = 0
        for req, end in plan:
            start, fill_len = req.prefilled, req.fill_len
            first_hit = start == req.cached > 0
            if first_hit:
                restore.append((req.match.snap, req.row, req.cached))
            seeds.append(req.match.snap if first_hit else 0)
            # boundaries M past the hit, within the prompt, whose kept positions
            # [M - carry, M) this chunk computes
            lo = max(req.cached + ps, (start // ps + 1) * ps)
            for boundary in range(lo, min(fill_len, end + self.carry) + 1, ps):
                if boundary - self.carry < end and boundary not in req.snaps:
                    req.snaps[boundary] = self.cache.take_snapshot()
            for p in range(start, end):
                snap = req.snaps.get((p // ps + 1) * ps, 0)
                snapshot.append(snap)
                if snap and (p + 1) % ps == 0:
                    keep.append((at + p - start, snap))
            at += end - start
        return PrefillPrefix(tuple(restore), tuple(snapshot) if any(snapshot) else (),
                             tuple(seeds) if any(seeds) else (), tuple(keep))

    def prefilled(self, req: Request) -> None:
        """``req``'s prompt (its output too, recomputed after a preemption) is in the pools:
        its whole blocks go into the tree (each with the snapshot of its end), and its
        match is unlocked."""
        ps, fill = self.page_size, req.fill
        blocks = len(fill) // ps
        snaps = [req.snaps.pop((i + 1) * ps, 0) for i in range(blocks)]
        self.cache.insert(fill[:blocks * ps], self.pool.held[req.row][:blocks], snaps)
        self.drop(req)

    def drop(self, req: Request) -> None:
        """``req`` reads the tree no more (prefilled, failed, aborted or requeued): its
        match unlocked, snapshots it took but did not insert given back."""
        if req.match is not None:
            self.cache.unlock(req.match)
            req.match = None
        self.cache.give_back([s for s in req.snaps.values() if s])
        req.snaps.clear()

    def audit(self, requests: list[Request]) -> None:
        """Pages: request rows and the tree hold every page exactly; snapshots: free,
        the tree's and ``requests``' split them exactly; locks: ``requests``' matches
        alone hold them (tests and debugging)."""
        self.pool.audit(self.cache.holdings())
        self.cache.audit([s for r in requests for s in r.snaps.values() if s],
                         [r.match for r in requests if r.match is not None])


def prefix_reuse(models: SpecModels, where: str) -> PrefixReuse:
    """The prefix cache over the target pool's pages and snapshots."""
    pool = models.target_pool
    if pool.pages is None:
        raise ConfigError(f"{where}: key 'pool.prefix_cache' needs a model with compressed "
                          f"layers: the cache shares their pages, and this one has none")
    carry = max(r.carry for p in (pool, models.draft_pool) for r in p.rings())
    return PrefixReuse(PrefixCache(pool.pages, pool.snapshot_ids), pool, carry)
