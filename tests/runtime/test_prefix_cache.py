"""The prefix cache in the engine (``runtime/prefix_reuse.py``): a prompt whose leading
pages were prefilled before reuses them, and its tokens and accepted drafts are those of
a cold prefill.

Prompts share prefixes of 128 to 256 tokens (1-2 pages of 128) and then go their own
way: the token after the shared part differs, so the draft's KV at the match's end (it
was computed from the next token) must be recomputed, not reused. Requests come in
waves so that later ones find what earlier ones cached, and concurrently so that two
requests prefill the same prefix at once. After every step the audit holds (pages held
exactly by request rows and the tree, snapshots by the tree and pending prefills),
and at the end no request holds a page.
"""

from __future__ import annotations

import dataclasses

import pytest

from nextn_graph.config import GraphConfig, PoolConfig, SchedulerConfig, SpeculativeConfig
from nextn_graph.errors import ConfigError
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.sampling import SamplingParams

from helpers import corpus_prompts
from test_spec_runtime import reference

PAGE, ROWS = 128, 4
MODES = {"eager": None,
         "split": GraphConfig(backend="cpu", buckets=(1, 2, 4), round="split"),
         "fused": GraphConfig(backend="cpu", buckets=(1, 2, 4), round="fused", overlap="off"),
         "overlap": GraphConfig(backend="cpu", buckets=(1, 2, 4), round="fused", overlap="on")}


def _prompts() -> list[list[int]]:
    a, b, c = corpus_prompts(5, [300, 300, 300])
    head = a[:256]
    return [a[:290],                 # cold: caches pages [0, 128) and [128, 256)
            head + b[:40],           # 2 pages hit
            a[:128] + c[:100],       # 1 page hit, then another token than a's 128th
            b[:200],                 # cold, no shared page
            a[:256],                 # the whole prompt cached but its last token: 1 page
            b[:128] + c[:30],        # 1 page of b's
            a[:256] + [a[0]] + b[:20],   # 2 pages, the next token differs
            c[:60]]


WAVES = [[0, 3], [1, 2, 4], [5, 6, 7]]  # wave k starts when wave k - 1 is done


def _engine(models, graph=None, prefix=True, num_pages=16, snapshots=0, budget=0,
            penalties=False) -> SpecEngine:
    if penalties:
        graph = dataclasses.replace(graph or GraphConfig(backend="eager"), penalties=True)
    return SpecEngine(models.target, models.draft, SpeculativeConfig(num_steps=3),
                      PoolConfig(ROWS, 512, page_size=PAGE, num_pages=num_pages,
                                 prefix_cache=prefix, prefix_snapshots=snapshots), graph,
                      scheduler=SchedulerConfig(prefill_token_budget=budget))


def _audit(eng: SpecEngine) -> None:
    if eng.prefix is not None:
        eng.prefix.audit(list(eng.scheduler.live.values()))
    else:
        eng.models.target_pool.audit()


def _serve(eng: SpecEngine, prompts, waves, max_new=16, sampling=None) -> dict:
    """Each wave added at once, stepped to the end -> by prompt index: (tokens, accepted
    per round, cached tokens)."""
    got = {}
    for wave in waves:
        rids = {eng.add_request(prompts[i], max_new, stop_ids=[],
                                sampling=sampling and sampling[i]): i for i in wave}
        for i in wave:
            got[i] = ([], [], None)
        while eng.has_work:
            for out in eng.step():
                assert out.error is None, out.error
                toks, acc, _ = got[rids[out.rid]]
                toks.extend(out.new_tokens)
                acc.append(out.accepted)
                if out.cached_tokens is not None:
                    got[rids[out.rid]] = (toks, acc, out.cached_tokens)
            _audit(eng)
    pool = eng.models.target_pool
    assert not pool.held and pool.free_rows == ROWS
    if eng.prefix is not None:
        assert eng.prefix.cache.locked == 0
        assert pool.free_pages + eng.prefix.cache.cached_pages == pool.pages.num_pages
    return got


@pytest.fixture(scope="module")
def cold(trained):
    return _serve(_engine(trained, prefix=False), _prompts(), WAVES)


@pytest.mark.parametrize("mode", list(MODES))
def test_hits_give_the_cold_tokens_and_drafts(trained, cold, mode):
    """Every request's tokens are the oracle's and, with hits, its tokens and accepted
    drafts round by round are the cold engine's; the hits are whole shared pages."""
    prompts = _prompts()
    eng = _engine(trained, MODES[mode])
    got = _serve(eng, prompts, WAVES)
    for i, p in enumerate(prompts):
        assert got[i][0] == reference(trained.target, p, 16), f"request {i}"
        assert got[i][:2] == cold[i][:2], f"request {i}: drafts differ from a cold prefill"
    cached = [got[i][2] for i in range(len(prompts))]
    assert cached == [0, 256, 128, 0, 128, 128, 256, 0]
    assert eng.stats.cached_tokens == sum(cached)
    assert eng.prefix.cache.stats.hit_tokens == sum(cached)
    assert eng.stats.acceptance_length == pytest.approx(
        (sum(sum(a[1:]) for _, a, _ in cold.values()) + sum(len(a) - 1 for _, a, _ in
                                                              cold.values()))
        / sum(len(a) - 1 for _, a, _ in cold.values()))


def test_concurrent_arrivals_wait_for_a_prefix_in_flight(trained, cold):
    """All eight at once: a request whose next page another is prefilling waits for it
    (a step) instead of computing it again, so the hits are those of the waves; the
    tokens are the cold ones. A request asking for prompt logprobs never waits."""
    prompts = _prompts()
    eng = _engine(trained, MODES["fused"])
    got = _serve(eng, prompts, [list(range(8))])
    assert [got[i][2] for i in range(8)] == [0, 256, 128, 0, 128, 128, 256, 0]
    assert all(got[i][:2] == cold[i][:2] for i in got)


def test_chunked_prefill_and_penalties_with_hits(trained):
    """A prefill budget of 64 tokens a step (a prompt's blocks reach the cache over
    several steps) and repetition penalties (a hit's cached tokens count as prompt):
    the cold engine's tokens."""
    prompts = _prompts()
    params = [SamplingParams(repetition_penalty=0.7, presence_penalty=0.5)] * len(prompts)
    want = _serve(_engine(trained, prefix=False, penalties=True), prompts, WAVES,
                  sampling=params)
    for budget in (0, 64):
        eng = _engine(trained, MODES["fused"], budget=budget, penalties=True)
        got = _serve(eng, prompts, WAVES, sampling=params)
        assert [got[i][:2] for i in got] == [want[i][:2] for i in want], budget
        assert eng.stats.cached_tokens > 0


def test_seeded_sampling_with_hits(trained):
    prompts = _prompts()
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(len(prompts))]
    want = _serve(_engine(trained, prefix=False), prompts, WAVES, sampling=params)
    got = _serve(_engine(trained, MODES["fused"]), prompts, WAVES, sampling=params)
    assert [got[i][0] for i in got] == [want[i][0] for i in want]


def test_eviction_under_page_and_snapshot_pressure(trained, cold):
    """8 pages and 2 snapshots for 4 rows: the tree gives pages and snapshots
    back, least recently used first, and admission waits for pages rather than evicting
    a locked prefix; every token is still the cold one."""
    prompts = _prompts()
    eng = _engine(trained, MODES["split"], num_pages=8, snapshots=2)
    got = _serve(eng, prompts, WAVES)
    assert all(got[i][0] == cold[i][0] for i in got)
    assert eng.prefix.cache.free_snapshots + eng.prefix.cache.cached_pages == 2


def test_prompt_logprobs_and_switch(trained):
    """A request asking for prompt logprobs is not served from the cache (every prompt
    row is computed); the cache off keeps every page free at the end."""
    prompts = _prompts()
    eng = _engine(trained, GraphConfig(backend="eager", logprobs=2))
    _serve(eng, prompts, [[0]])
    rid = eng.add_request(prompts[1], 4, stop_ids=[], prompt_logprobs=1)
    outs = []
    while eng.has_work:
        outs += eng.step()
    first = next(o for o in outs if o.rid == rid and o.cached_tokens is not None)
    assert first.cached_tokens == 0 and len(first.prompt_logprobs) == len(prompts[1])
    off = _engine(trained, prefix=False)
    _serve(off, prompts, [[0, 1]])
    assert off.prefix is None and off.models.target_pool.free_pages == 16


def test_bad_prefix_settings_are_refused(trained):
    with pytest.raises(ConfigError, match="prefix_snapshots"):
        _engine(trained, snapshots=-1)


def test_a_prefill_fault_leaves_the_cache_consistent(trained, cold):
    """The prefill of the second wave (hits among them) raises: exactly those requests
    fail, their locks and snapshots go back, the audit holds, the tree still serves
    the third wave, and a retry of the failed prompts hits and gives the cold tokens."""
    prompts = _prompts()
    eng = _engine(trained, MODES["split"])
    _serve(eng, prompts, WAVES[:1])
    fired = []

    def fault(module, args):
        if not fired:
            fired.append(1)
            raise RuntimeError("injected prefill fault")
    hook = eng.models.target.register_forward_pre_hook(fault)
    rids = [eng.add_request(prompts[i], 16, stop_ids=[]) for i in WAVES[1]]
    errors = {}
    while eng.has_work:
        for out in eng.step():
            if out.error:
                errors[out.rid] = out.error
        _audit(eng)
    hook.remove()
    assert set(errors) == set(rids) and "injected prefill fault" in errors[rids[0]]
    assert eng.prefix.cache.locked == 0 and not eng.models.target_pool.held
    got = _serve(eng, prompts, [WAVES[1], WAVES[2]])
    for i in WAVES[1] + WAVES[2]:
        assert got[i][:2] == cold[i][:2], i
    assert got[1][2] == 256


def test_plain_decoding_with_hits(trained):
    """Without a draft (speculative None) hits reuse the target's pages and snapshots
    alone: the oracle's tokens."""
    prompts = _prompts()
    eng = SpecEngine(trained.target, trained.draft, None,
                     PoolConfig(ROWS, 512, page_size=PAGE, num_pages=16),
                     GraphConfig(backend="cpu", buckets=(1, 2, 4)))
    got = _serve(eng, prompts, WAVES)
    assert [got[i][2] for i in range(8)] == [0, 256, 128, 0, 128, 128, 256, 0]
    for i, p in enumerate(prompts):
        assert got[i][0] == reference(trained.target, p, 16), i
