"""Pages on demand (``pool.allocation: grow``): a request holds the pages of its next
round's writes and gets more before each round; when none are left, the newest running
request goes back to wait and is prefilled again (its prompt and output, ``Request.fill``)
with its bonus kept, and resumes where it was.

A pool of 5 pages of 128 positions for 4 rows, 6 requests whose prompts and outputs
together need 2 to 3 pages each: preemptions happen (a running request's pages would
run out), every request's tokens are the oracle's (greedy) or those of a pool that
reserves everything at admission (seeded sampling, penalties), on every round mode; the
audit holds after every step and every page is back at the end.
"""

from __future__ import annotations

import dataclasses

import pytest

from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.sampling import SamplingParams

from helpers import corpus_prompts
from test_spec_runtime import reference

PAGE, PAGES, ROWS = 128, 5, 4
LENGTHS = [120, 100, 90, 150, 20, 110]
MAX_NEW = [60, 70, 80, 40, 60, 50]
MODES = {"eager": None,
         "split": GraphConfig(backend="cpu", buckets=(1, 2, 4), round="split"),
         "fused": GraphConfig(backend="cpu", buckets=(1, 2, 4), round="fused", overlap="off"),
         "overlap": GraphConfig(backend="cpu", buckets=(1, 2, 4), round="fused", overlap="on")}


def _engine(models, graph=None, allocation="grow", prefix=False, spec=True):
    return SpecEngine(models.target, models.draft,
                      SpeculativeConfig(num_steps=3) if spec else None,
                      PoolConfig(ROWS, 512, page_size=PAGE, num_pages=PAGES,
                                 prefix_cache=prefix, allocation=allocation), graph)


def _run(eng: SpecEngine, prompts, sampling=None) -> list[list[int]]:
    rids = [eng.add_request(p, n, stop_ids=[], sampling=sampling and sampling[i])
            for i, (p, n) in enumerate(zip(prompts, MAX_NEW))]
    out = {r: [] for r in rids}
    pool = eng.models.target_pool
    while eng.has_work:
        for o in eng.step():
            assert o.error is None, o.error
            out[o.rid].extend(o.new_tokens)
        if eng.prefix is not None:
            eng.prefix.audit(list(eng.scheduler.live.values()))
        else:
            pool.audit()
    assert not pool.held and pool.free_rows == ROWS
    return [out[r] for r in rids]


@pytest.mark.parametrize("mode", list(MODES))
def test_preempted_requests_resume_exactly(trained, mode):
    prompts = corpus_prompts(8, LENGTHS)
    eng = _engine(trained, MODES[mode])
    got = _run(eng, prompts)
    for i, (p, n) in enumerate(zip(prompts, MAX_NEW)):
        assert got[i] == reference(trained.target, p, n), f"request {i}"
    assert eng.stats.preemptions > 0 and eng.stats.recomputed_tokens > 0
    assert eng.models.target_pool.free_pages == PAGES


def test_sampling_penalties_and_the_prefix_cache_resume_as_reserved(trained):
    """Seeded sampling with penalties on an engine whose pages grow (with the prefix
    cache, which a resumed request hits): the tokens of a pool that reserves all."""
    prompts = corpus_prompts(8, LENGTHS)
    params = [SamplingParams(temperature=0.8, seed=i, repetition_penalty=0.8,
                             frequency_penalty=0.3) for i in range(len(prompts))]
    graph = GraphConfig(backend="cpu", buckets=(1, 2, 4), round="fused", overlap="off",
                        penalties=True)
    want = _run(SpecEngine(trained.target, trained.draft, SpeculativeConfig(num_steps=3),
                           PoolConfig(ROWS, 512, page_size=PAGE, num_pages=64,
                                      prefix_cache=False), graph), prompts, params)
    eng = _engine(trained, graph, prefix=True)
    got = _run(eng, prompts, params)
    assert eng.stats.preemptions > 0
    assert got == want


def test_plain_decoding_resumes(trained):
    prompts = corpus_prompts(8, LENGTHS)
    eng = _engine(trained, MODES["fused"], spec=False)
    got = _run(eng, prompts)
    assert eng.stats.preemptions > 0
    for i, (p, n) in enumerate(zip(prompts, MAX_NEW)):
        assert got[i] == reference(trained.target, p, n), f"request {i}"


@pytest.mark.parametrize("mode", [*(pytest.param(m, marks=pytest.mark.heavy)
                                    for m in ("split", "fused")), "overlap"])
def test_random_arrivals_aborts_hits_and_preemptions(trained, mode):
    """Shared-prefix prompts arriving at random steps on a tight pool (4 pages, 4 rows,
    the prefix cache on, a prefill budget of 96), two of them aborted mid-way: every
    request that was not aborted gets the oracle's tokens, the audit holds after every
    step, and the run saw hits and preemptions."""
    import random
    from nextn_graph.config import SchedulerConfig
    rng = random.Random(4)
    heads = corpus_prompts(9, [140, 130])
    tails = corpus_prompts(10, [30, 45, 12, 60, 25, 8, 50, 40])
    jobs = [(rng.randrange(0, 12), heads[i % 2][:rng.choice((128, 135))] + tails[i],
             rng.choice((40, 90, 130))) for i in range(8)]
    eng = SpecEngine(trained.target, trained.draft, SpeculativeConfig(num_steps=3),
                     PoolConfig(ROWS, 512, page_size=PAGE, num_pages=PAGES - 1),
                     MODES[mode], scheduler=SchedulerConfig(96))
    rids, out, aborted, step = {}, {}, set(), 0
    while step < 12 or eng.has_work:
        for i, (at, prompt, n) in enumerate(jobs):
            if at == step:
                rids[eng.add_request(prompt, n, stop_ids=[])] = i
        if step == 9:  # abort the two requests added first that still run
            for rid in [r for r in rids if r not in out or len(out[r]) < jobs[rids[r]][2]][:2]:
                if eng.abort(rid):
                    aborted.add(rid)
        for o in eng.step():
            assert o.error is None, o.error
            out.setdefault(o.rid, []).extend(o.new_tokens)
        eng.prefix.audit(list(eng.scheduler.live.values()))
        step += 1
        assert step < 500
    pool = eng.models.target_pool
    assert not pool.held and eng.prefix.cache.locked == 0
    assert pool.free_pages + eng.prefix.cache.cached_pages == PAGES - 1
    for rid, i in rids.items():
        if rid not in aborted:
            assert out[rid] == reference(trained.target, jobs[i][1], jobs[i][2]), i
    assert eng.stats.cached_tokens > 0 and eng.stats.preemptions > 0 and aborted
