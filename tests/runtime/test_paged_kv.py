"""Paged compressed KV (``memory/pool.py``): requests hold the pages their positions reach,
admission waits for pages, and the tokens are the oracle's.

A pool of 128-position pages with fewer pages than its rows could use (page-bound, not
row-bound) serves mixed lengths on every round mode (eager, split graphs, fused, fused
with overlap) and on the sparse kernel set: every request's tokens equal the no-cache
oracle's, the pool's audit holds after every step (no page leaked or held twice), a
request whose pages are out of order exists (the page table is really read), and at the
end every page is free. A request that could never fit is refused at add_request; a page
size that splits an entry is refused at build.
"""

from __future__ import annotations

import pytest

from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.errors import CapacityError, InputError
from nextn_graph.runtime.engine import SpecEngine

from helpers import corpus_prompts
from test_spec_runtime import reference

PAGE, NUM_PAGES, ROWS = 128, 6, 5
LENGTHS = [5, 140, 30, 260, 12, 90, 200, 8]  # prompts: 1 to 3 pages with their outputs
MAX_NEW = [20, 12, 30, 10, 25, 15, 8, 30]
MODES = {"eager": None,
         "split": GraphConfig(backend="cpu", buckets=(1, 2, 4), round="split"),
         "fused": GraphConfig(backend="cpu", buckets=(1, 2, 4), round="fused", overlap="off"),
         "overlap": GraphConfig(backend="cpu", buckets=(1, 2, 4), round="fused", overlap="on")}


def _engine(models, graph=None, num_pages=NUM_PAGES, kernels=None) -> SpecEngine:
    return SpecEngine(models.target, models.draft, SpeculativeConfig(num_steps=3),
                      PoolConfig(ROWS, 512, page_size=PAGE, num_pages=num_pages,
                                 prefix_cache=False, allocation="reserve"), graph,
                      kernels=kernels)


def _serve_all(eng: SpecEngine, prompts, limits) -> dict:
    """Add every request at once, step to the end -> outputs, and what the pool saw."""
    pool = eng.models.target_pool
    rids = [eng.add_request(p, n, stop_ids=[]) for p, n in zip(prompts, limits)]
    outputs = {rid: [] for rid in rids}
    page_bound = scattered = False
    peak = 0
    while eng.has_work:
        for out in eng.step():
            assert out.error is None, out.error
            outputs[out.rid].extend(out.new_tokens)
        pool.audit()
        held = list(pool.held.values())
        assert sum(map(len, held)) + pool.free_pages == NUM_PAGES
        peak = max(peak, len(held))
        page_bound |= bool(eng.num_waiting and pool.free_rows)
        scattered |= any(p != list(range(p[0], p[0] + len(p))) for p in held if p)
    assert pool.free_pages == NUM_PAGES and pool.free_rows == ROWS and not pool.held
    return {"outputs": [outputs[r] for r in rids], "page_bound": page_bound,
            "scattered": scattered, "peak": peak}


@pytest.mark.parametrize("mode", list(MODES))
def test_paged_pool_serves_mixed_lengths_exactly(trained, mode):
    """8 requests of 5 to 260 prompt tokens over 6 pages of 128 (5 rows): the oracle's
    tokens; admission waited on pages while rows were free; pages were handed out of
    order; every page came back."""
    prompts = corpus_prompts(3, LENGTHS)
    got = _serve_all(_engine(trained, MODES[mode]), prompts, MAX_NEW)
    for i, (p, n) in enumerate(zip(prompts, MAX_NEW)):
        assert got["outputs"][i] == reference(trained.target, p, n), f"request {i}"
    assert got["page_bound"] and got["scattered"] and got["peak"] >= 2


@pytest.mark.slow
def test_paged_pool_on_the_sparse_kernels(trained):
    """The sparse set (Triton kernels, interpreted here) reads the compressed entries and
    the indexer's keys through the page table: the oracle's tokens. Slow (over 10 min on
    2 cores: the interpreter runs every kernel of every forward op by op); the kernels'
    paged addressing is in the default run (tests/kernels/test_kernel_indexer.py)."""
    prompts = corpus_prompts(4, [140, 9, 260])
    limits = [3, 4, 3]
    got = _serve_all(_engine(trained, kernels="triton"), prompts, limits)
    for i, (p, n) in enumerate(zip(prompts, limits)):
        assert got["outputs"][i] == reference(trained.target, p, n), f"request {i}"
    assert got["scattered"]


def test_request_larger_than_every_page_is_refused(trained):
    """2 pages of 128 hold 256 positions: a request reaching past them can never be
    admitted, so add_request refuses it (naming the pages as the bound) and queues
    nothing."""
    eng = _engine(trained, num_pages=2)
    with pytest.raises(InputError, match=r"exceeds the maximum context 256 \(the pool's pages: "
                                         r"pool.num_pages 2 x page_size 128\)$") as info:
        eng.add_request(list(range(2, 202)), 60)
    assert info.value.field == "max_new_tokens"
    assert eng.num_waiting == 0 and eng.request_limits.max_context == 256
    rid = eng.add_request(list(range(2, 202)), 50)  # 200 + 50 + 2 lookahead <= 256
    while eng.has_work:
        eng.step()
    assert eng.models.target_pool.free_pages == 2 and rid == 0  # the refused took no rid


def test_page_size_that_splits_an_entry_is_refused(trained):
    with pytest.raises(CapacityError, match="page_size 192 is not a multiple of the "
                                            "compress ratio 128"):
        SpecEngine(trained.target, trained.draft, SpeculativeConfig(num_steps=3),
                   PoolConfig(2, 512, page_size=192), None)
