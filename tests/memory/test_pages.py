"""Pages of the compressed KV and the prefix cache over them (memory/pages.py,
memory/prefix.py): reference counts, all-or-nothing failures, LRU eviction by pages, the
hit rate of shared prefixes, and an audit that finds every leaked or double-freed page."""

from __future__ import annotations

import random

import pytest

from nextn_graph.errors import CapacityError
from nextn_graph.memory.pages import PagePool, pages_for
from nextn_graph.memory.prefix import PrefixCache


def test_alloc_share_release_and_the_audit():
    pool = PagePool(4, 256)
    a = pool.alloc(3)
    assert sorted(a) == [1, 2, 3] and pool.free_pages == 1  # page 0 is never handed out
    pool.share(a[:1])
    pool.audit({"req a": a, "cache": a[:1]})
    with pytest.raises(AssertionError, match="KV page"):
        pool.audit({"req a": a})  # the cache's reference is not accounted for: a leak
    assert pool.release(a) == 2 and pool.refcount(a[0]) == 1
    pool.audit({"cache": a[:1]})
    assert pool.release(a[:1]) == 1 and pool.free_pages == 4
    pool.audit({})


def test_failures_change_nothing():
    pool = PagePool(3, 4)
    held = pool.alloc(2)
    with pytest.raises(CapacityError, match="2 needed, 1 of 3 free"):
        pool.alloc(2)
    with pytest.raises(CapacityError, match="page 3: it is not allocated"):
        pool.release([held[0], 3])  # one bad id: nothing released
    with pytest.raises(CapacityError, match="released 2 times, held 1"):
        pool.release([held[1], held[1]])
    with pytest.raises(CapacityError, match="not allocated"):
        pool.share([0])
    pool.audit({"req": held})
    for bad in (0, -1, 2.5, True):
        with pytest.raises(CapacityError, match="num_pages"):
            PagePool(bad, 4)
    assert pages_for(0, 4) == 0 and pages_for(1, 4) == 1 and pages_for(8, 4) == 2


def test_hit_rate_is_the_shared_tokens_in_whole_pages():
    """Prompts sharing a 10-token prefix at page size 4: after the first, each later one
    finds 8 tokens (10 rounded down to pages), at most its length minus one."""
    pool = PagePool(64, 4)
    cache = PrefixCache(pool)
    shared = list(range(100, 110))
    prompts = [shared + [i, i + 1, i + 2] for i in range(5)]
    held = {}
    for i, p in enumerate(prompts):
        m = cache.match(p, limit=len(p) - 1)
        assert m.tokens == (0 if i == 0 else 8)
        pages = list(m.pages) + pool.alloc(pages_for(len(p), 4) - len(m.pages))
        pool.share(m.pages)  # the request holds the cached pages it reuses too
        held[i] = pages
        cache.insert(p, pages)
    assert cache.stats.hit_tokens == 4 * 8
    assert cache.stats.hit_rate == pytest.approx(32 / sum(len(p) for p in prompts))
    pool.audit({**held, **cache.holdings()})
    # the limit: a prompt that is exactly two cached pages matches one (its last token
    # must still be computed)
    assert cache.match(shared[:8], limit=7).tokens == 4


def test_eviction_is_lru_by_pages_and_skips_locked_prefixes():
    pool = PagePool(8, 2)
    cache = PrefixCache(pool)
    seqs = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [1, 2, 9, 9]}
    for name, toks in seqs.items():  # requests compute, cache and finish (release)
        m = cache.match(toks)
        pages = list(m.pages) + pool.alloc(2 - len(m.pages))
        pool.share(m.pages)
        cache.insert(toks, pages)
        pool.release(pages)
    assert cache.cached_pages == 5 and pool.free_pages == 3  # "c" shares [1, 2]
    pool.audit(cache.holdings())
    hot = cache.match(seqs["b"])  # b is now the most recently used
    cache.lock(hot)
    assert cache.evict(2) == 2  # a's [3,4] and c's [9,9] leaves, oldest first
    assert cache.match([1, 2, 3, 4]).tokens == 2 and cache.match(seqs["c"]).tokens == 2
    assert cache.evict(10) == 1  # [1, 2] goes; b is locked
    assert cache.match(seqs["b"]).tokens == 4
    cache.unlock(hot)
    assert cache.evict(10) == 2 and cache.cached_pages == 0 and pool.free_pages == 8
    with pytest.raises(CapacityError, match="not locked"):
        cache.unlock(hot)
    pool.audit(cache.holdings())


def test_a_duplicate_block_keeps_the_cached_page():
    pool = PagePool(8, 2)
    cache = PrefixCache(pool)
    first, second = pool.alloc(2), pool.alloc(2)
    assert cache.insert([1, 2, 3, 4], first) == 2
    assert cache.insert([1, 2, 3, 4, 5], second) == 0  # same blocks: nothing added
    assert cache.match([1, 2, 3, 4, 6]).pages == tuple(first)
    pool.audit({"first": first, "second": second, **cache.holdings()})


@pytest.mark.parametrize("seed", range(3))
def test_random_requests_never_leak_a_page(seed):
    """Requests with shared prefixes come and go, the cache evicts under pressure; after
    every step each page's count matches its holders exactly."""
    rng = random.Random(seed)
    pool = PagePool(40, 4)
    cache = PrefixCache(pool)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    running: dict[int, tuple] = {}
    for step in range(200):
        if running and (rng.random() < 0.4 or len(running) > 5):
            rid = rng.choice(list(running))
            toks, pages, m = running.pop(rid)
            cache.insert(toks, pages)
            cache.unlock(m)
            pool.release(pages)
        else:
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            m = cache.match(toks, limit=len(toks) - 1)
            cache.lock(m)  # first: the eviction below must not drop the match itself
            need = pages_for(len(toks), 4) - len(m.pages)
            if need > pool.free_pages:
                cache.evict(need - pool.free_pages)
            if need > pool.free_pages:
                cache.unlock(m)
                continue  # admission waits: nothing was taken
            pool.share(m.pages)
            running[step] = (toks, list(m.pages) + pool.alloc(need), m)
        pool.audit({**{r: v[1] for r, v in running.items()}, **cache.holdings()})
    assert cache.stats.hit_tokens > 0


def test_snapshots_follow_the_nodes():
    """Nodes own snapshots: a duplicate insert and the blocks past a missing snapshot
    give theirs back, eviction frees a leaf's, ``take_snapshot`` evicts the least
    recently used unlocked leaf when none is free, and the audit counts rows taken."""
    pool = PagePool(8, 2)
    cache = PrefixCache(pool, snapshots=[10, 11, 12])
    pages = pool.alloc(2)
    s1, s2 = cache.take_snapshot(), cache.take_snapshot()
    assert (s1, s2) == (10, 11)
    cache.audit(taken=[s1, s2])
    assert cache.insert([1, 2, 3, 4], pages, [s1, s2]) == 2
    assert cache.match([1, 2, 3, 4, 5]).snap == s2 and cache.match([1, 2, 9]).snap == s1
    dup = pool.alloc(2)
    s3 = cache.take_snapshot()
    assert cache.insert([1, 2, 3, 4], dup, [s3, 0]) == 0  # cached already: s3 back
    assert cache.free_snapshots == 1
    other = pool.alloc(2)
    assert cache.insert([7, 7, 8, 8], other, [0, cache.take_snapshot()]) == 0  # no state
    assert cache.free_snapshots == 1 and cache.cached_pages == 2
    m = cache.match([1, 2, 5])  # [1, 2] locked: only [3, 4] may go
    cache.lock(m)
    a, b = cache.take_snapshot(), cache.take_snapshot()  # the free one, then [3, 4]'s
    assert {a, b} == {12, s2} and cache.cached_pages == 1
    assert cache.take_snapshot() == 0  # [1, 2] is locked
    cache.give_back([a, b])
    cache.unlock(m)
    cache.audit()
    pool.release(pages + dup + other)
    assert cache.evict(10) == 1 and cache.free_snapshots == 3
    pool.audit({})
