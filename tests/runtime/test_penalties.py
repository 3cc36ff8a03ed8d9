"""Penalties inside the round: presence / frequency / repetition penalties, logit_bias and
min_tokens, applied at every verify row with the window's drafts counted, give the tokens
of the no-cache oracle that applies them one token at a time; greedy and sampled,
speculative and plain, graphs fused, split and eager, whole and chunked prefill. Neutral
requests on a penalties engine keep exactly their old tokens."""

from __future__ import annotations

import dataclasses

import pytest

from nextn_graph.config import GraphConfig, PoolConfig, SchedulerConfig, SpeculativeConfig
from nextn_graph.errors import InputError
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.sampling import SamplingParams

from helpers import corpus_prompts

MAX_CONTEXT = 128
# (the trained model never repeats a token unprompted: the biases make repeats, which
# the counts then penalise, drafts of the window included)
PENALTIES = [
    dict(repetition_penalty=0.5),
    dict(logit_bias={"101": 7.0}, frequency_penalty=1.0, presence_penalty=0.5),
    dict(logit_bias={"5": 9.0, "32": -100}, frequency_penalty=2.0),
]


def engine(models, spec: bool = True, backend: str = "cpu", budget: int = 0,
           penalties: bool = True) -> SpecEngine:
    graph = GraphConfig(backend="cpu", round="split") if backend == "split" else \
        GraphConfig(backend=backend)
    return SpecEngine(models.target, models.draft,
                      SpeculativeConfig(num_steps=3, num_draft_tokens=4) if spec else None,
                      PoolConfig(3, MAX_CONTEXT), dataclasses.replace(graph, penalties=penalties),
                      scheduler=SchedulerConfig(prefill_token_budget=budget))


def oracle(target, prompts, n, params, stop_ids=()):
    return reference_generate(target, prompts, n, stop_ids=set(stop_ids), max_context=MAX_CONTEXT,
                              sampling=params).outputs


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "plain"])
@pytest.mark.parametrize("backend", ["cpu", "split", "eager"])
def test_greedy_penalties_equal_the_oracle(trained, spec, backend):
    prompts = corpus_prompts(21, [9, 14, 6])
    params = [SamplingParams(seed=i, **kw) for i, kw in enumerate(PENALTIES)]
    got = engine(trained, spec, backend).generate(prompts, 16, stop_ids=[], sampling=params)
    want = oracle(trained.target, prompts, 16, params)
    assert got.outputs == want
    plain = oracle(trained.target, prompts, 16, None)
    assert all(g != p for g, p in zip(got.outputs, plain))  # the penalties did something


@pytest.mark.parametrize("budget", [0, 4], ids=["whole", "chunked"])
def test_plain_sampled_penalties_equal_the_oracle(trained, budget):
    """Plain sampling rounds draw with the oracle's keyed uniforms, from the penalised
    (and min-p filtered) distribution: the same tokens. (Speculative sampling with
    penalties is lossless in distribution: test_sampling_engine's chi-square.)"""
    prompts = corpus_prompts(22, [11, 7, 13])
    params = [SamplingParams(temperature=0.9, top_k=20, min_p=0.05, seed=40 + i, **kw)
              for i, kw in enumerate(PENALTIES)]
    eng = engine(trained, spec=False, budget=budget)
    got = eng.generate(prompts, 14, stop_ids=[], sampling=params)
    assert got.outputs == oracle(trained.target, prompts, 14, params)
    unpenalised = [dataclasses.replace(p, **{k: SamplingParams.__dataclass_fields__[k].default
                                             for k in PENALTIES[i]})
                   for i, p in enumerate(params)]
    assert got.outputs != oracle(trained.target, prompts, 14, unpenalised)


def test_min_tokens_holds_the_stop_back(trained):
    prompt = corpus_prompts(23, [10])[0]
    free = oracle(trained.target, [prompt], 12, None)[0]
    stop = free[2]  # greedy decoding stops here without min_tokens
    params = SamplingParams(seed=0, min_tokens=6)
    got = engine(trained).generate([prompt], 12, stop_ids=[stop], sampling=params).outputs[0]
    assert got == oracle(trained.target, [prompt], 12, params, [stop])[0]
    assert stop not in got[:6] and len(got) > 3
    early = engine(trained).generate([prompt], 12, stop_ids=[stop]).outputs[0]
    assert early == free[:3]


def test_neutral_requests_keep_their_tokens(trained):
    """An engine with penalties gives requests without them the plain greedy tokens, in a
    batch with penalised ones (their rows do not leak into each other)."""
    prompts = corpus_prompts(24, [8, 12, 10])
    params = [None, SamplingParams(seed=1, repetition_penalty=0.5), None]
    got = engine(trained).generate(prompts, 12, stop_ids=[], sampling=params).outputs
    plain = oracle(trained.target, prompts, 12, None)
    assert got[0] == plain[0] and got[2] == plain[2] and got[1] != plain[1]


def test_a_reused_row_starts_from_no_history(trained):
    """A row's counts and parameters are reset at admission: a request after a penalised
    one on the same row (max one at a time) decodes as if alone."""
    prompts = corpus_prompts(25, [9, 9])
    eng = SpecEngine(trained.target, trained.draft, SpeculativeConfig(num_steps=3),
                     PoolConfig(1, MAX_CONTEXT), GraphConfig(backend="cpu", penalties=True))
    first = SamplingParams(seed=0, presence_penalty=2.0, logit_bias={"40": 3.0})
    got = eng.generate(prompts, 10, stop_ids=[], sampling=[first, None]).outputs
    assert got == [oracle(trained.target, prompts[:1], 10, first)[0],
                   oracle(trained.target, prompts[1:], 10, None)[0]]


def test_bad_penalties_are_refused_by_name(trained):
    eng = engine(trained)
    for kw, name in [(dict(presence_penalty=3.0), "presence_penalty"),
                     (dict(repetition_penalty=0.0), "repetition_penalty"),
                     (dict(min_tokens=-1), "min_tokens"), (dict(min_p=1.5), "min_p"),
                     (dict(logit_bias={"x": 1.0}), "logit_bias"),
                     (dict(logit_bias={"5": 200}), "logit_bias"),
                     (dict(logit_bias={str(trained.cfg.vocab_size): 1.0}), "vocabulary")]:
        with pytest.raises(InputError, match=name):
            eng.add_request([1, 2, 3], 4, sampling=kw)
    with pytest.raises(InputError, match="graph.penalties"):
        engine(trained, penalties=False).add_request([1, 2, 3], 4,
                                                     sampling=dict(frequency_penalty=1.0))
    assert not eng.has_work


@pytest.mark.parametrize("backend", ["split", "fused"])
def test_an_interrupted_round_counts_its_tokens_once(trained, backend):
    """A round cut short by an interrupt after its verify counted the tokens is run again
    from the same committed state: the counts hold each position once (by position, not
    by round), so every request still equals the oracle."""
    from test_faults import FUSED_POINTS, POINTS, Faults, drive, schedule
    graph = GraphConfig(backend="cpu", buckets=(1, 2), round="split", penalties=True) \
        if backend == "split" else GraphConfig(backend="cpu", buckets=(2, 5), round="fused",
                                               overlap="on", penalties=True)
    eng = SpecEngine(trained.target, trained.draft, SpeculativeConfig(num_steps=3),
                     PoolConfig(5, 160), graph)
    sched = schedule(7)
    params = [SamplingParams(seed=i, **PENALTIES[i % 3]) for i in range(len(sched))]
    points = set(FUSED_POINTS if backend == "fused" else POINTS) - {"prefill"}
    faults = Faults(eng, points, KeyboardInterrupt)
    try:
        outputs, errors = drive(eng, sched, faults, fire_from=0, sampling=params)
    finally:
        faults.close()
    assert faults.fired and not errors
    for i, (_, prompt, n) in enumerate(sched):
        assert outputs[i] == oracle(trained.target, [prompt], n, params[i])[0], i
