"""The sampling building blocks (issue 13, first part): parameters, counter-based
uniforms, filtered distributions and inverse-CDF draws.

The statistical checks use fixed seeds, so they are deterministic: each is a
chi-square test whose threshold is the 0.999 quantile of its distribution (a
false alarm rate of 1e-3 had the draws been random), computed with the
Wilson-Hilferty approximation."""

from __future__ import annotations

import math
import re

import pytest
import torch

from nextn_graph.errors import InputError
from nextn_graph.graph.emulator import CpuGraph
from nextn_graph.sampling import (ACCEPT, DRAFT, SamplingParams, draw, filtered_probs,
                                  key_hash, uniform)


def chi2_limit(dof: int, z: float = 3.0902) -> float:
    """The 0.999 quantile of chi-square with ``dof`` degrees of freedom (z of 0.999)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


# -- parameters --------------------------------------------------------------------------

@pytest.mark.parametrize("kw,needle", [
    ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_p": 0.0}, "top_p must lie in (0, 1]"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k must be an integer >= 0"), ({"top_k": 2.0}, "top_k"),
    ({"seed": -1}, "seed must be an integer in [0, 2**63)"), ({"seed": 2**63}, "seed"),
])
def test_bad_parameters_are_named(kw, needle):
    with pytest.raises(InputError, match=re.escape(needle)):
        SamplingParams(**kw).checked("request 3")


def test_good_parameters_pass_and_zero_temperature_is_greedy():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**63 - 1).checked("r")
    assert p == SamplingParams(0.7, 0.9, 40, 2**63 - 1) and not p.greedy
    assert SamplingParams().checked("r").greedy


# -- uniforms ----------------------------------------------------------------------------

def test_one_seed_never_gives_two_keys_the_same_hash():
    """For one seed the hash is injective over keys (positions 0..4095, steps 0..15, the
    four streams: 262 144 keys, 262 144 distinct 32-bit words), so no two draws of a
    request are tied together; a second seed gives other words."""
    pos = torch.arange(4096).view(-1, 1, 1)
    step = torch.arange(16).view(1, -1, 1)
    for seed in (0, 2**62 + 12345):
        hashes = torch.cat([key_hash(torch.tensor(seed), pos, step, s).reshape(-1)
                            for s in range(4)])
        assert hashes.numel() == 262144 and hashes.unique().numel() == 262144
        assert int(hashes.min()) >= 0 and int(hashes.max()) < 2**32
    a = key_hash(torch.tensor(1), pos, step, 0)
    b = key_hash(torch.tensor(2), pos, step, 0)
    assert (a == b).float().mean() < 1e-3


def test_uniforms_are_a_function_of_their_key_only():
    """Same (seed, position, step, stream): same value, whatever else is in the batch;
    another seed, position, step or stream: another value."""
    seeds = torch.tensor([[7], [2**62 + 5], [7]])
    pos = torch.tensor([[10, 11, 12], [10, 11, 12], [40, 41, 42]])
    u = uniform(seeds, pos, 2, DRAFT)  # [3, 3]
    alone = uniform(seeds[2:], pos[2:], 2, DRAFT)
    assert torch.equal(u[2:], alone)
    assert len(set(u.flatten().tolist())) == 9
    assert not torch.equal(uniform(seeds, pos, 2, ACCEPT), u)
    assert not torch.equal(uniform(seeds, pos, 3, DRAFT), u)
    assert bool(((u >= 0) & (u < 1)).all())


def test_uniforms_are_uniform():
    """100 000 uniforms over consecutive positions of 10 seeds, in 20 bins."""
    seeds = torch.arange(10).unsqueeze(1) * 1_000_003  # [10, 1]
    u = uniform(seeds, torch.arange(10_000).unsqueeze(0), 0, DRAFT).flatten()
    counts = torch.bincount((u * 20).long(), minlength=20).double()
    assert chi2(counts, torch.full((20,), u.numel() / 20.0)) < chi2_limit(19)
    # and successive positions are not correlated (pairs in a 5 x 5 grid)
    pairs = (u[:-1] * 5).long() * 5 + (u[1:] * 5).long()
    counts = torch.bincount(pairs, minlength=25).double()
    assert chi2(counts, torch.full((25,), pairs.numel() / 25.0)) < chi2_limit(24)


# -- distributions and draws ---------------------------------------------------------------

def test_filtered_probs_match_a_brute_force_filter():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    t = torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 0.8])
    k = torch.tensor([0, 0, 5, 0, 10, 3])
    p = torch.tensor([1.0, 0.9, 1.0, 0.5, 0.7, 1.0])
    got = filtered_probs(logits, t, k, p)
    for i in range(6):
        if t[i] == 0:
            want = torch.zeros(50)
            want[logits[i].argmax()] = 1
        else:
            probs = (logits[i] / t[i]).softmax(-1)
            order = probs.argsort(descending=True)
            kk = int(k[i]) or 50
            kept, mass = [], probs[order[:kk]].sum()
            for j in order[:kk].tolist():  # the nucleus of the top-k renormalised
                kept.append(j)
                if sum(probs[kept]) / mass >= p[i]:
                    break
            want = torch.zeros(50)
            want[kept] = probs[kept] / probs[kept].sum()
        torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-5)


def test_draws_follow_their_distribution():
    """60 000 draws from a distribution with zero-mass tokens: frequencies match
    (chi-square over the tokens with mass), zero-mass tokens never drawn."""
    probs = torch.tensor([0.0, 0.1, 0.25, 0.0, 0.05, 0.3, 0.3, 0.0])
    seeds = torch.tensor([[3], [4], [5]])
    u = uniform(seeds, torch.arange(20_000).unsqueeze(0), 1, DRAFT)  # [3, 20000]
    ids = draw(probs.expand(3, 20_000, 8), u).flatten()
    counts = torch.bincount(ids, minlength=8).double()
    assert counts[probs == 0].sum() == 0
    mass = probs > 0
    assert chi2(counts[mass], probs[mass] * ids.numel()) < chi2_limit(int(mass.sum()) - 1)


def test_a_captured_draw_replays_fresh_numbers_without_rng_ops():
    """On the strict CPU emulator (which refuses RNG ops): capture a filtered draw over
    static tensors, move the positions on, replay: fresh draws equal to eager ones."""
    torch.manual_seed(1)
    logits = torch.randn(4, 32)
    seeds = torch.tensor([[1], [2], [3], [4]])
    pos = torch.tensor([[5], [9], [2], [7]])
    temp, top_k, top_p = torch.tensor([1.0, 0.7, 0.0, 1.3]), torch.tensor([0, 8, 0, 4]), \
        torch.tensor([0.9, 1.0, 1.0, 0.8])
    out = torch.zeros(4, dtype=torch.int64)

    def fn():
        probs = filtered_probs(logits, temp, top_k, top_p)
        out.copy_(draw(probs, uniform(seeds, pos, 0, DRAFT).squeeze(1)))

    graph = CpuGraph()
    graph.capture(fn)
    seen = set()
    for step in range(1, 6):
        pos.add_(1)
        graph.replay()
        want = draw(filtered_probs(logits, temp, top_k, top_p),
                    uniform(seeds, pos, 0, DRAFT).squeeze(1))
        assert torch.equal(out, want)
        assert int(out[2]) == int(logits[2].argmax())  # temperature 0: greedy
        seen.add(tuple(out.tolist()))
    assert len(seen) > 1  # the replays drew fresh numbers
