"""The MoE family's fused ops (``nextn_graph.kernels.moe``) against their references.

Interpreter tests (CPU tensors, ``TRITON_INTERPRET=1``) from the tiny preset's widths
(D 64, E 4, k 2) to DeepSeek-V4-Flash's (D 4096, E 256, k 6, I 2048; few rows at full
width), fp32 and bf16; the sm_90a builds of every kernel; the fakes on the meta device.
Index outputs (chosen experts, order, offs, pos) must equal the reference exactly;
values are within ULPs of the output dtype (``ulp.py``), each bound justified where it is
set, the measured maxima in the tests' docstrings.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from nextn_graph.kernels import moe
from ulp import max_ulps

SCALE = 1.5  # the presets' routed_scaling_factor
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _randint(high: int, *shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


# -- the gate ----------------------------------------------------------------------------

# T, D, E, k: tiny preset, small, non-power-of-two tails (D 100, E 20), V4-Flash (3 rows)
GATE_SHAPES = [(1, 64, 4, 2), (5, 64, 16, 4), (4, 100, 20, 6), (3, 4096, 256, 6)]
# The weights' bound, fp32 ULPs. The projection sums D fp32 products in another order than
# the host GEMM (the products are exact for bf16 inputs): |dz| <= D*eps*sum|x_i w_i| at
# worst, ~sqrt(D)*eps*|terms| in practice; sqrt-softplus halves a relative error (and
# softplus' slope sigmoid(z) < 1 shrinks it further for z < 0); normalising over k adds a
# few roundings (sum, division, scale). Measured 8 at most (V4 widths, over several seeds);
# margin 4x.
GATE_ULPS = 32


def _gate_inputs(t, d, e, k, dtype, bias_dtype, seed):
    """x [T, D], weight [E, D] with scores z ~ N(0, 1), bias [E] ~ N(0, 0.1), hash rows
    [T, k] (distinct experts, as tid2eid's)."""
    x = _randn(t, d, seed=seed, dtype=dtype)
    weight = _randn(e, d, seed=seed + 1, dtype=dtype, scale=d ** -0.5)
    bias = _randn(e, seed=seed + 2, dtype=bias_dtype, scale=0.1)
    g = torch.Generator().manual_seed(seed + 3)
    hashed = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, weight, bias, hashed


def _min_gap(x, weight, bias, k):
    """The least gap between consecutive biased scores among each row's top k + 1: the
    inputs are tie-free for the kernel's scores (within ~1e-6 of the host's) if it is
    far above that."""
    scores = F.softplus(F.linear(x.float(), weight.float())).sqrt() + bias.float()
    top = scores.topk(min(k + 1, scores.shape[1]), dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min().item()


def _tie_free_gate_inputs(t, d, e, k, dtype, bias_dtype):
    """The first seed (from a fixed one) whose top k + 1 biased scores are 1e-4 apart or
    more in every row: 100x the kernel's score error, so the selection cannot flip."""
    for seed in range(t * d + e, t * d + e + 20):
        x, weight, bias, _ = _gate_inputs(t, d, e, k, dtype, bias_dtype, seed)
        if k == e or _min_gap(x, weight, bias, k) > 1e-4:
            return x, weight, bias
    raise AssertionError("no tie-free seed")


@pytest.mark.parametrize("shape", GATE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,bias_dtype", [(torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
def test_gate_biased_top_k_matches_reference(shape, dtype, bias_dtype):
    """Same experts in the same (descending) order; weights within GATE_ULPS (measured:
    3 fp32, 4 bf16 at V4 widths; 1-4 at small widths)."""
    t, d, e, k = shape
    x, weight, bias = _tie_free_gate_inputs(t, d, e, k, dtype, bias_dtype)
    ref_chosen, ref_weights = moe.gate_reference(x, weight, bias, None, k, SCALE)
    chosen, weights = moe.moe_gate_fused(x, weight, bias, None, k, SCALE)
    assert chosen.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(chosen, ref_chosen)
    assert max_ulps(weights, ref_weights) <= GATE_ULPS


@pytest.mark.parametrize("shape", GATE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_hash_rows_match_reference(shape, dtype):
    """The hash layers' given experts come back as given, weighted as the reference
    (measured: 4 ULPs fp32, 2 bf16 at V4 widths; 0-3 at small widths)."""
    t, d, e, k = shape
    x, weight, _, hashed = _gate_inputs(t, d, e, k, dtype, dtype, seed=sum(shape) + 7)
    ref_chosen, ref_weights = moe.gate_reference(x, weight, None, hashed, k, SCALE)
    chosen, weights = moe.moe_gate_fused(x, weight, None, hashed, k, SCALE)
    assert torch.equal(chosen, ref_chosen)
    assert max_ulps(weights, ref_weights) <= GATE_ULPS


def test_gate_ties_go_to_the_lower_expert():
    """Experts with identical weight rows and bias score bitwise alike; the kernel ranks
    them by index (torch.topk's order among ties is unspecified): the same scores as the
    reference's top k, the tied experts ascending."""
    t, d, e, k = 4, 64, 16, 6
    x, weight, bias, _ = _gate_inputs(t, d, e, k, torch.float32, torch.float32, seed=3)
    weight[[2, 9, 13]] = weight[5].clone()  # experts 2, 5, 9, 13 tie...
    bias[[2, 5, 9, 13]] = 10.0  # ...and lead every row
    chosen, weights = moe.moe_gate_fused(x, weight, bias, None, k, SCALE)
    assert (chosen[:, :4] == torch.tensor([2, 5, 9, 13])).all()
    ref_chosen, ref_weights = moe.gate_reference(x, weight, bias, None, k, SCALE)
    assert torch.equal(chosen[:, 4:], ref_chosen[:, 4:])  # the rest is tie-free
    assert (ref_chosen[:, :4].sort(dim=1).values == chosen[:, :4]).all()
    assert max_ulps(weights, ref_weights) <= GATE_ULPS


# -- the route ---------------------------------------------------------------------------

# T, k, E, n_local, local_start: T = 1; tiny; many equal keys (8 experts, A = 222); foreign
# experts on both sides of this rank's; V4 prefill under 4-way expert parallelism (A 3072)
ROUTE_CASES = [(1, 6, 256, 256, 0), (5, 2, 4, 4, 0), (37, 6, 8, 8, 0), (37, 6, 8, 3, 2),
               (300, 6, 16, 5, 11), (512, 6, 256, 64, 128)]


def _route_case(t, k, e, n_local, start, seed=0):
    chosen = _randint(e, t, k, seed=seed + t)  # repeats within rows too: more equal keys
    return chosen, moe.route_reference(chosen, n_local, start, parallel=True)


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_route_matches_the_stable_sort(case):
    """order and offs equal the reference's (its parallel branch: other ranks' experts
    last); pos is order's inverse. Exact."""
    t, k, e, n_local, start = case
    chosen, (_, ref_order, ref_offs) = _route_case(*case)
    order, offs, pos = moe.moe_route_fused(chosen, n_local, start)
    assert (order.dtype, offs.dtype, pos.dtype) == (torch.int64, torch.int32, torch.int64)
    assert torch.equal(order, ref_order)
    assert torch.equal(offs, ref_offs)
    assert torch.equal(pos[order], torch.arange(t * k))
    if n_local == e:  # nothing foreign: the non-parallel reference is the same sort
        assert torch.equal(order, moe.route_reference(chosen, e, 0, parallel=False)[1])
    else:  # the case is not vacuous: some assignments are foreign, some local
        assert 0 < offs[-1].item() < t * k


# -- SwiGLU ------------------------------------------------------------------------------

# A, I: tiny preset, a V4 decode step (6 assignments of I 2048), a non-power-of-two tail
SWIGLU_SHAPES = [(1, 64), (6, 2048), (3, 1000)]
# fp32: both sides compute g / (1 + exp(-g)) * u in fp32, their exp within ~1 ULP (the
# host's SLEEF, the interpreter's numpy): ~2 ULPs each side; measured 4, bound 8. bf16:
# one rounding of fp32 results a few fp32 ULPs apart lands at most one bf16 ULP apart
# (measured 1).
SWIGLU_ULPS = {torch.float32: 8, torch.bfloat16: 1}


@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu_matches_reference(shape, dtype, limit):
    """Clamped (the presets' limit 10; inputs ~ N(0, 6^2) so the clamp engages) and
    unclamped (limit 0). Measured: fp32 4 ULPs, bf16 1."""
    gate = _randn(*shape, seed=shape[1], dtype=dtype, scale=6.0)
    up = _randn(*shape, seed=shape[1] + 1, dtype=dtype, scale=6.0)
    if limit > 0:
        assert (gate.float() > limit).any() and (up.float().abs() > limit).any()
    out = moe.swiglu_fused(gate, up, limit)
    ref = moe.swiglu_reference(gate, up, limit)
    assert out.dtype == ref.dtype == dtype
    assert max_ulps(out, ref) <= SWIGLU_ULPS[dtype]


# -- the combine -------------------------------------------------------------------------

# (route case, D): T = 1; tiny; foreign experts (NaN rows); V4 width D 4096; a D tail
COMBINE_CASES = [((1, 6, 256, 256, 0), 4096), ((5, 2, 4, 4, 0), 64),
                 ((37, 6, 8, 3, 2), 64), ((4, 6, 256, 64, 128), 4096),
                 ((9, 6, 16, 5, 11), 100)]


# The same fp32 products w * y; the kernel sums the k terms in top-k order, the host's sum
# over dim 1 does too on whole vectors but in another order on the tail columns: each
# order's error <= (k-1) u sum_j |w_j y_j| (u = eps/2), so the two are <= 2(k-1) = 10 ULPs
# apart at that magnitude (an ULP at m is more than eps*m/2).
COMBINE_ULPS = 10


@pytest.mark.parametrize("case,d", COMBINE_CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_matches_reference_and_drops_undefined_rows(case, d, dtype):
    """Rows at or past offs[-1] are NaN (undefined) and must add exactly 0; within
    COMBINE_ULPS of sum_j |w_j y_j| (measured: 0 (bitwise equal) where D is a multiple
    of 32; on the host's tail columns (D 100) 0.5 fp32, 1 bf16)."""
    t, k, e, n_local, start = case
    chosen, (key, order, offs) = _route_case(*case, seed=d)
    _, offs_fused, pos = moe.moe_route_fused(chosen, n_local, start)
    ys = _randn(t * k, d, seed=d, dtype=dtype)  # [A, D] in sorted order
    ys[offs[-1]:] = float("nan")
    weights = _randn(t, k, seed=d + 1, dtype=torch.float32).abs()  # [T, k]
    out = moe.moe_combine_fused(ys, pos, weights, offs_fused)
    ref = moe.combine_reference(ys, key, order, weights, n_local)
    assert out.dtype == torch.float32 and out.shape == (t, d)
    assert not out.isnan().any()
    terms = moe.combine_reference(ys.abs(), key, order, weights, n_local)  # sum_j |w_j y_j|
    assert max_ulps(out, ref, scale=terms) <= COMBINE_ULPS
    foreign = ~((chosen >= start) & (chosen < start + n_local)).all(dim=1)
    if n_local < e:  # not vacuous: some rows do have undefined terms
        assert foreign.any()


# -- fakes -------------------------------------------------------------------------------

def test_fakes_give_the_references_shapes_and_dtypes():
    """Each fused op on meta tensors returns what its reference returns on CPU."""
    t, d, e, k, n_local, inter = 3, 64, 16, 4, 5, 32
    x, weight, bias, hashed = _gate_inputs(t, d, e, k, torch.bfloat16, torch.float32, seed=1)
    key, order, offs = moe.route_reference(hashed, n_local, 2, parallel=True)
    _, ref_w = moe.gate_reference(x, weight, bias, None, k, SCALE)
    gate = _randn(t * k, inter, seed=2, dtype=torch.bfloat16)
    ys = _randn(t * k, d, seed=3, dtype=torch.bfloat16)
    meta = lambda v: v.to("meta")  # noqa: E731
    cases = [
        *zip(moe.moe_gate_fused(meta(x), meta(weight), meta(bias), None, k, SCALE),
             moe.gate_reference(x, weight, bias, None, k, SCALE)),
        *zip(moe.moe_gate_fused(meta(x), meta(weight), None, meta(hashed), k, SCALE),
             moe.gate_reference(x, weight, None, hashed, k, SCALE)),
        *zip(moe.moe_route_fused(meta(hashed), n_local, 2), (order, offs, order)),
        (moe.swiglu_fused(meta(gate), meta(gate), 10.0), moe.swiglu_reference(gate, gate, 10.0)),
        (moe.moe_combine_fused(meta(ys), meta(order), meta(ref_w), meta(offs)),
         moe.combine_reference(ys, key, order, ref_w, n_local)),
    ]
    for fused, ref in cases:
        assert fused.device.type == "meta"
        assert (fused.shape, fused.dtype) == (ref.shape, ref.dtype)
