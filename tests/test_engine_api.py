"""The engine's request API under misuse: aborts at any time, long queues, bad batches."""

from __future__ import annotations

import pytest

from nextn_graph.config import PoolConfig, SpeculativeConfig
from nextn_graph.errors import InputError
from nextn_graph.generate import reference_generate
from nextn_graph.runtime.engine import SpecEngine

from helpers import corpus_prompts


def engine(models, max_requests: int = 2) -> SpecEngine:
    return SpecEngine(models.target, models.draft,
                      SpeculativeConfig(num_steps=3, num_draft_tokens=4),
                      PoolConfig(max_requests, 96), None)


def test_abort_of_waiting_requests_keeps_counts_and_order(trained):
    """Aborting queued requests (any order, any number) keeps num_waiting exact, and
    the survivors are admitted in arrival order with correct outputs."""
    eng = engine(trained)
    prompts = corpus_prompts(4, [5, 9, 7, 12, 6, 8])
    rids = [eng.add_request(p, 5, stop_ids=[]) for p in prompts]
    burst = [eng.add_request([3, 4, 5], 5) for _ in range(3000)]
    assert eng.num_waiting == 3006
    assert all(eng.abort(r) for r in reversed(burst))
    assert not any(eng.abort(r) for r in burst)  # twice: unknown now
    assert eng.abort(rids[1]) and eng.abort(rids[4])
    assert eng.num_waiting == 4
    admitted, outputs = [], {r: [] for r in rids}
    while eng.has_work:
        for o in eng.step():
            if not outputs[o.rid]:
                admitted.append(o.rid)
            outputs[o.rid].extend(o.new_tokens)
    assert admitted == [rids[0], rids[2], rids[3], rids[5]]
    for i in (0, 2, 3, 5):
        want = reference_generate(trained.target, [prompts[i]], 5, stop_ids=set(),
                                  max_context=96).outputs[0]
        assert outputs[rids[i]] == want, i
    assert outputs[rids[1]] == outputs[rids[4]] == []
    assert eng.models.target_pool.free_rows == 2 and eng.num_waiting == 0


def test_all_waiting_aborted_leaves_an_idle_engine(trained):
    eng = engine(trained, max_requests=1)
    rids = [eng.add_request([5, 6, 7], 4) for _ in range(50)]
    for r in rids:
        assert eng.abort(r)
    assert not eng.has_work and eng.num_waiting == 0 and eng.step() == []


def test_no_output_for_a_rid_after_its_abort(trained):
    """Outputs made before an interrupt wait in the engine; aborting the request
    drops them: after abort(rid) returns, step() never mentions rid."""
    eng = engine(trained)
    a, b = (eng.add_request(p, 6, stop_ids=[]) for p in corpus_prompts(5, [6, 10]))
    hook = eng.models.draft.register_forward_pre_hook(_interrupt_once())
    try:
        with pytest.raises(KeyboardInterrupt):
            eng.step()  # prefill of both committed; the round is interrupted
    finally:
        hook.remove()
    assert eng.abort(a)
    seen = [o.rid for _ in range(20) for o in eng.step()]
    assert a not in seen and b in seen and not eng.has_work
    assert eng.models.target_pool.free_rows == 2


def _interrupt_once():
    """A draft forward pre-hook: the second draft forward (the first of a round,
    after the prefill's draft extend) raises KeyboardInterrupt once."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt

    return hook


def test_generate_names_the_bad_stop_ids_without_queuing(trained):
    eng = engine(trained)
    with pytest.raises(InputError, match=r"^generate: stop token id NoneType None"):
        eng.generate([[5, 6, 7], [8, 9]], 3, stop_ids=[1, None])
    assert not eng.has_work
