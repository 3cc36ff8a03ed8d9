"""The bf16 guarantee (docs/guarantees_bf16.md), over random schedules.

In bf16, tokens are not stable across batch shapes: the fp32 mHC and router GEMMs
round differently for different row counts, and the casts back to bf16 turn that
into whole-ulp differences. So spec, plain and the bf16 reference may each pick
another token where two logits nearly tie. What holds, and is checked here: where
a bf16 stream first leaves the fp32 reference, the token it picked trails the
reference's choice by less than ``BF16_TOLERANCE`` fp32 logits.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.runtime.generate import plain_generate, reference_generate
from nextn_graph.graph.emulator import CpuGraph
from nextn_graph.runtime.engine import SpecEngine

from helpers import (BF16_TOLERANCE, corpus_prompts, divergence_regret, random_prompt,
                     reference_logits, top2_margins, within_tolerance)

MAX_CONTEXT = 96


@pytest.fixture(scope="module")
def trained16():
    return load_checkpoint("builtin:tiny-trained", torch.bfloat16)


def engine(models, graph: GraphConfig | None) -> SpecEngine:
    return SpecEngine(models.target, models.draft,
                      SpeculativeConfig(num_steps=3, num_draft_tokens=4),
                      PoolConfig(5, MAX_CONTEXT), graph)


@pytest.fixture(scope="module")
def engine16(trained16):
    """One bf16 engine on cpu graphs for every example: S 3, buckets (1, 2, 4), pool 5,
    so schedules of 1-6 requests hit padded buckets, splits and waiting requests."""
    return engine(trained16, GraphConfig(backend="cpu", buckets=(1, 2, 4)))


def fp32_reference(trained, prompt, max_new, stops):
    """The oracle's tokens and the fp32 logits that picked each of them [len, V]."""
    ref = reference_generate(trained.target, [prompt], max_new, stop_ids=set(stops),
                             max_context=MAX_CONTEXT).outputs[0]
    return ref, reference_logits(trained.target, prompt, ref)


def run(eng: SpecEngine, schedule) -> list[list[int]]:
    """schedule: (arrival step, prompt, max_new, stops); returns tokens per request."""
    outputs, owner, step = [[] for _ in schedule], {}, 0
    pending = list(range(len(schedule)))
    while pending or eng.has_work:
        for i in [i for i in pending if schedule[i][0] <= step]:
            _, prompt, max_new, stops = schedule[i]
            owner[eng.add_request(prompt, max_new, stop_ids=stops)] = i
            pending.remove(i)
        for out in eng.step():
            outputs[owner[out.rid]].extend(out.new_tokens)
        step += 1
        assert step < 400, "engine did not finish"
    return outputs


# -- the checker -------------------------------------------------------------------------

def test_tolerance_allows_only_tokens_near_the_reference_choice():
    logits = torch.tensor([[9.0, 0.0, 0.0], [0.0, 4.0, 3.9], [0.0, 8.0, 0.5]])
    ref = [0, 1, 1]
    assert within_tolerance([0, 1, 1], ref, logits)
    assert within_tolerance([0, 2, 0], ref, logits)  # leaves at a near tie (regret 0.1)
    assert divergence_regret([0, 2, 0], ref, logits) == pytest.approx(0.1)
    assert not within_tolerance([0, 1, 2], ref, logits)  # regret 7.5
    assert not within_tolerance([1, 1, 1], ref, logits)  # regret 9
    assert not within_tolerance([0, 1], ref, logits)  # stopped early, no differing token
    assert not within_tolerance([0, 1, 1, 2], ref, logits)
    assert within_tolerance([0, 1, 2], ref, logits, delta=8.0)


@pytest.mark.heavy
def test_tolerance_rejects_most_wrong_tokens_on_real_outputs(trained):
    """On the trained model's fp32 outputs the check has teeth: the teacher-forced logits
    pick the reference's own tokens, and swapping in any other token at any position is
    refused in at least 90% of cases; over 30 prompts (720 positions) the runner-up alone
    is refused at over 30% of positions (a statistic over few prompts swings with the
    checkpoint: 0% to 70% a prompt set of three here)."""
    prompts = corpus_prompts(3, [12, 30]) + [random_prompt(20, 4)]
    refused = wrong = 0
    for prompt in prompts:
        ref, logits = fp32_reference(trained, prompt, 24, [])
        assert logits.argmax(-1).tolist() == ref
        for i in range(len(ref)):
            for tok in range(logits.shape[1]):
                if tok != ref[i]:
                    refused += not within_tolerance(ref[:i] + [tok], ref[:i + 1], logits)
        wrong += len(ref) * (trained.cfg.vocab_size - 1)
    assert refused >= 0.9 * wrong, (refused, wrong)
    runner_up_refused = positions = 0
    for seed in range(10):
        for prompt in corpus_prompts(seed, [12, 30]) + [random_prompt(20, seed)]:
            ref, logits = fp32_reference(trained, prompt, 24, [])
            runner_up_refused += sum(m >= BF16_TOLERANCE for m in top2_margins(logits))
            positions += len(ref)
    assert runner_up_refused > 0.3 * positions, (runner_up_refused, positions)


# -- random schedules --------------------------------------------------------------------

REQUEST = st.tuples(
    st.integers(0, 5),  # arrival: the step() before which the request is added
    st.integers(1, 40),  # prompt length
    st.integers(0, 10_000),  # prompt seed
    st.booleans(),  # corpus (confident, high acceptance) or uniform random tokens
    st.integers(1, 20),  # max_new_tokens
    st.one_of(st.none(), st.integers(0, 19)),  # stop: the reference's token at this index
)


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(st.lists(REQUEST, min_size=1, max_size=6))
@pytest.mark.heavy
def test_bf16_agrees_with_fp32_reference_within_tolerance(trained, trained16, engine16, drawn):
    """Spec on cpu graphs (padded buckets, joins and leaves, waiting requests) and plain
    bf16 decoding leave the fp32 reference only for a token within BF16_TOLERANCE."""
    schedule, refs = [], []
    with torch.no_grad():
        for at, n, seed, from_corpus, max_new, stop_at in drawn:
            prompt = corpus_prompts(seed, [n])[0] if from_corpus else random_prompt(n, seed)
            full, _ = fp32_reference(trained, prompt, 20, [])
            stops = [] if stop_at is None else [full[stop_at]]
            schedule.append((at, prompt, max_new, stops))
            refs.append(fp32_reference(trained, prompt, max_new, stops))
        spec_out = run(engine16, schedule)
        for (_, prompt, max_new, stops), spec, (ref, logits) in zip(schedule, spec_out, refs):
            plain = plain_generate(trained16.target, [prompt], max_new, stop_ids=set(stops),
                                   max_context=MAX_CONTEXT).outputs[0]
            for name, got in (("spec", spec), ("plain", plain)):
                assert within_tolerance(got, ref, logits), (
                    name, divergence_regret(got, ref, logits), got, ref)


# -- graphs replay eager's kernels -------------------------------------------------------

def test_bf16_replay_is_bitwise_eager():
    """A replay recomputes exactly what eager computed: x * 1/sqrt(3) in bf16 (the
    emulator once pre-cast the scalar to bf16; eager multiplies in fp32)."""
    x = torch.randn(256, generator=torch.Generator().manual_seed(0)).bfloat16()
    graph = CpuGraph()
    out = graph.capture(lambda: x * 0.5773502691896258)
    eager = out.clone()
    graph.replay()
    assert torch.equal(out, eager), f"{int((out != eager).sum())} of 256 values differ"


# The graphs' round as ``auto`` resolves it for cpu graphs, spelled out: fused, with
# overlap (round k+1 launches before round k is read).
FUSED_OVERLAPPED = dict(round="fused", overlap="on")


@pytest.fixture(scope="module")
def eager_and_full_buckets(trained16):
    """bf16 eager on the graphs' schedule (fused rounds, overlapped), and cpu graphs with a
    bucket for every batch size (nothing padded)."""
    return (engine(trained16, GraphConfig(backend="eager", **FUSED_OVERLAPPED)),
            engine(trained16, GraphConfig(backend="cpu", buckets=(1, 2, 3, 4, 5),
                                          **FUSED_OVERLAPPED)))


@settings(max_examples=4, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 40), st.integers(0, 10_000),
                          st.booleans(), st.integers(1, 20),
                          st.one_of(st.none(), st.integers(2, 255))), min_size=1, max_size=6))
# Overlap runs an extra round with request 4 (2 tokens) after it finished: B=2 where a
# split, non-overlapped eager engine runs B=1; against that engine request 3's last token
# differed in bf16 (found at issue 19), against eager on the same schedule it must not.
@example([(0, 1, 0, False, 1, None)] * 3 + [(0, 35, 1, True, 8, None), (0, 1, 0, False, 2, None)])
def test_bf16_graphs_equal_eager_when_every_batch_fills_its_bucket(eager_and_full_buckets,
                                                                    drawn):
    """Unpadded graph replays run eager's kernels on eager's shapes: the same tokens, bf16
    included, against eager on the same schedule. (A padded bucket changes the GEMM row
    count, so only the tolerance holds.) The schedule must match too: with overlap, a
    request that finished in round k still rides round k+1 (launched before k was read),
    so the batch has another row count than a non-overlapped engine's, and bf16 rounds
    differently (the docstring at the top of this file)."""
    eager, graphs = eager_and_full_buckets
    schedule = [(at, corpus_prompts(seed, [n])[0] if corpus else random_prompt(n, seed),
                 max_new, [] if stop is None else [stop])
                for at, n, seed, corpus, max_new, stop in drawn]
    with torch.no_grad():
        assert run(graphs, schedule) == run(eager, schedule)
