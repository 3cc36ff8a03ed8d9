"""Logprobs from the round: every committed token's raw logprob and top-k, read back with
the round's tokens, equal the no-cache oracle's log-softmax, speculative and plain, graphs
on and off, greedy and sampled; prompt logprobs from the (chunked) prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nextn_graph.config import GraphConfig, PoolConfig, SchedulerConfig, SpeculativeConfig
from nextn_graph.errors import InputError
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.tolerance import reference_logits

from helpers import corpus_prompts

K = 4
TOL = 1e-4


def engine(models, spec: bool, backend: str = "cpu", budget: int = 0, k: int = K,
           sampling: bool = False) -> SpecEngine:
    """``backend`` "split": the CPU emulator's split rounds (three graphs, no overlap)."""
    graph = GraphConfig(backend="cpu", round="split") if backend == "split" else \
        GraphConfig(backend=backend)
    return SpecEngine(models.target, models.draft,
                      SpeculativeConfig(num_steps=3, num_draft_tokens=4) if spec else None,
                      PoolConfig(3, 128),
                      dataclasses.replace(graph, logprobs=k, sampling=sampling),
                      scheduler=SchedulerConfig(prefill_token_budget=budget))


def run(eng: SpecEngine, prompts, n: int, **kw):
    """-> {rid: (tokens, logprobs, prompt_logprobs)} of a batch run to the end."""
    rids = [eng.add_request(p, n, stop_ids=[], **kw) for p in prompts]
    out = {r: ([], [], None) for r in rids}
    while eng.has_work:
        for o in eng.step():
            assert o.error is None, o.error
            out[o.rid][0].extend(o.new_tokens)
            if o.logprobs is not None:
                assert len(o.logprobs) == len(o.new_tokens)
                out[o.rid][1].extend(o.logprobs)
            if o.prompt_logprobs is not None:
                out[o.rid] = (out[o.rid][0], out[o.rid][1], o.prompt_logprobs)
    return [out[r] for r in rids]


def oracle(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log-softmax [len(tokens), V] of the no-cache full recompute at each output."""
    return reference_logits(target, prompt, tokens).log_softmax(-1)


def check(lps, tokens: list[int], want: torch.Tensor, k: int) -> None:
    assert [t.token for t in lps] == tokens
    for i, t in enumerate(lps):
        assert abs(t.logprob - float(want[i, t.token])) < TOL, i
        assert len(t.top) == k
        top = want[i].topk(k)
        for (tok, lp), v in zip(t.top, top.values.tolist()):
            assert abs(lp - v) < TOL and abs(float(want[i, tok]) - v) < TOL, i


@pytest.mark.parametrize("spec", [True, False], ids=["spec", "plain"])
@pytest.mark.parametrize("backend", ["cpu", "split", "eager"])
def test_logprobs_equal_the_oracle(trained, spec, backend):
    prompts = corpus_prompts(11, [7, 12, 5])
    got = run(engine(trained, spec, backend), prompts, 9, logprobs=2)
    for p, (tokens, lps, prompt_lps) in zip(prompts, got):
        assert prompt_lps is None and len(tokens) == 9
        check(lps, tokens, oracle(trained.target, p, tokens), 2)
        # the greedy token is the top-1, as the same float (lm-eval's is_greedy test)
        assert all(t.logprob == t.top[0][1] for t in lps)


def test_spec_and_plain_give_the_same_logprobs(trained):
    prompts = corpus_prompts(12, [9, 6])
    spec = run(engine(trained, True), prompts, 10, logprobs=K)
    plain = run(engine(trained, False), prompts, 10, logprobs=K)
    for (ts, ls, _), (tp, lp, _) in zip(spec, plain):
        assert ts == tp
        for a, b in zip(ls, lp):
            assert abs(a.logprob - b.logprob) < TOL
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("budget", [0, 5], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_the_oracle(trained, budget):
    """Chunked prefill included: each chunk gives its rows, the last row of a chunk
    that stops inside the prompt the logprob of the prompt's next token."""
    prompts = corpus_prompts(13, [11, 4])
    got = run(engine(trained, True, budget=budget), prompts, 3, logprobs=1,
              prompt_logprobs=3)
    for p, (tokens, lps, prompt_lps) in zip(prompts, got):
        assert len(prompt_lps) == len(p) and prompt_lps[0] is None
        seq = torch.tensor(p + tokens[:-1])
        want = trained.target.reference(seq).logits.float().log_softmax(-1)  # [T, V]
        check(prompt_lps[1:], p[1:], want[:len(p) - 1], 3)
        check(lps, tokens, want[len(p) - 1:], 1)


def test_sampled_logprobs_are_the_raw_distribution(trained):
    """Sampled requests report the target's raw log-softmax at the token drawn (not the
    tempered, filtered distribution it was drawn from)."""
    prompts = corpus_prompts(14, [8, 10])
    eng = engine(trained, True, sampling=True)
    got = run(eng, prompts, 8, logprobs=1,
              sampling={"temperature": 1.5, "top_k": 5, "seed": 3})
    for p, (tokens, lps, _) in zip(prompts, got):
        check(lps, tokens, oracle(trained.target, p, tokens), 1)


def test_a_stop_cuts_the_logprobs_with_the_tokens(trained):
    prompt = corpus_prompts(15, [9])[0]
    eng = engine(trained, True)
    (tokens, _, _), = run(eng, [prompt], 8)
    stop = tokens[4]
    rid = eng.add_request(prompt, 8, stop_ids=[stop], logprobs=0)
    outs = []
    while eng.has_work:
        outs += [o for o in eng.step() if o.rid == rid]
    got = [t for o in outs for t in o.logprobs]
    assert [t.token for t in got] == tokens[:tokens.index(stop) + 1]
    assert all(t.top == () for t in got)


def test_logprobs_beyond_the_engine_are_refused(trained):
    eng = engine(trained, True, k=2)
    with pytest.raises(InputError, match=r"logprobs must be None or an integer in \[0, 2\]"):
        eng.add_request([1, 2, 3], 4, logprobs=3)
    with pytest.raises(InputError, match="prompt_logprobs"):
        eng.add_request([1, 2, 3], 4, prompt_logprobs=True)
    off = engine(trained, True, k=0)
    with pytest.raises(InputError, match="computes no logprobs"):
        off.add_request([1, 2, 3], 4, logprobs=0)
    assert not eng.has_work and not off.has_work
