"""The engine's request API under misuse: aborts at any time, long queues, bad batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.errors import ConfigError, InputError
from nextn_graph.runtime.generate import reference_generate
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


@pytest.mark.parametrize("spec,pool,graph,match", [
    (SpeculativeConfig(eagle_topk=4), None, None, "eagle_topk' is 4"),
    (SpeculativeConfig(algorithm="DSpark"), None, None, "algorithm' is 'DSpark'"),
    (SpeculativeConfig(num_steps="3"), None, None, "num_steps' must be an integer"),
    (SpeculativeConfig(num_steps=-2), None, None, r"num_steps' must lie in \[1, 32\], got -2"),
    (SpeculativeConfig(num_steps=400), None, None, "got 400"),
    (None, PoolConfig(0, 96), None, "max_requests' must be at least 1, got 0"),
    (None, PoolConfig(2, True), None, "max_context' must be an integer"),
    (None, None, GraphConfig(backend="cpu", buckets=(1.0, 2.0)), "buckets' must be a list of int"),
    (None, None, GraphConfig(backend="gpu"), "backend' must be one of"),
])
def test_configs_built_in_code_are_checked_like_yaml(tiny, spec, pool, graph, match):
    """SpecEngine(...) refuses what the YAML loader refuses, before allocating anything."""
    spec = spec or SpeculativeConfig(num_steps=3, num_draft_tokens=4)
    with pytest.raises(ConfigError, match=match):
        SpecEngine(tiny.target, tiny.draft, spec, pool or PoolConfig(2, 96), graph)


def test_numpy_and_tensor_max_new_tokens_are_plain_ints(trained):
    eng = engine(trained)
    rids = [eng.add_request([5, 6, 7], n, stop_ids=[])
            for n in (np.int64(4), torch.tensor(4), 4)]
    assert [type(r.max_new_tokens) for r in eng.scheduler.waiting] == [int, int, int]
    outs = {r: [] for r in rids}
    while eng.has_work:
        for o in eng.step():
            outs[o.rid].extend(o.new_tokens)
    assert outs[rids[0]] == outs[rids[1]] == outs[rids[2]] and len(outs[rids[2]]) == 4
