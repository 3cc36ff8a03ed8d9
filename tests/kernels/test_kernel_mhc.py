"""The mHC family's fused ops (``nextn_graph.kernels.mhc``) against their references.

Interpreter tests (CPU tensors, ``TRITON_INTERPRET=1``) from tiny widths (hc 4, D 64) to
DeepSeek-V4-Flash's (D 4096: K = hc*D = 16384, 3 rows); T = 1 and T = 37 (not a multiple of
the projection's 16-row block); D 520 (tails of every block); fp32 and bf16 streams; fp32
and bf16 parameters at a trained model's scale (fn ~ N(0, 1/sqrt(K)), scale and base O(1));
20 Sinkhorn iterations. Each output is compared with the reference and with a float64
evaluation of the same formulas ("exact"), in ULPs of the output dtype (``ulp.py``); the
bounds are justified where they are set. Measured maxima here (fp32 / bf16 streams):
hc_pre y 11 / 1 ULPs from the reference (at its terms' magnitude; 4 / 1 from exact), post
21 / 17 (exact: 8 / 10), comb 59 / 142 (exact: 12 / 15; the reference itself is 57 / 142
from exact); bf16 parameters: post 4, comb 22; hc_head 15 / 1 (exact: 5 / 1); hc_post 2 / 1.
Also: strided inputs give the contiguous results bitwise, so do the GPU's one-row tiles the
interpreter's many-row ones, each op is one op to a dispatch mode and launches 2 / 1 / 2
Triton kernels, the fakes on meta, the sm_90a builds.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from nextn_graph.kernels import mhc
from nextn_graph.kernels import triton_mhc as tk
from oplog import OpLog
from ulp import max_ulps

HC, ITERS, EPS = 4, 20, 1e-6  # both presets' hc_mult, hc_sinkhorn_iters, hc_eps = rms_norm_eps
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 64), (37, 64), (5, 520), (3, 4096)]  # (T, D)
IDS = [f"T{t}-D{d}" for t, d in SHAPES]

# -- tolerances -------------------------------------------------------------------------
# A mix is a K-term dot (K = 4D) summed in another order than the reference's BLAS: its
# absolute error is ~eps * kappa, kappa = sum_k |x_k fn_nk| * rsqrt(ms) * |scale| ~ 0.64
# sqrt(K) |scale| (10-16 at K 256, 80-125 at K 16384); the reference's sum is up to 2.4
# eps*kappa from exact, the fused (blocked) one 0.3. post = 2 sigmoid(m) turns it into a
# relative error no larger (|d log post| <= |dm|): ~2.4 kappa ULPs, bound 256. comb: the
# softmax doubles a logit's error and the 20 normalisations pass it on with a gain of a few
# (measured 6 kappa): bound 1024. (Over 5 more seeds: 91 and 263.) Against float64 the fused
# op is much closer (correctly rounded div and sqrt; only exp approximate): bounds 32 / 64.
POST_VS_REF, COMB_VS_REF = 256.0, 1024.0
POST_VS_EXACT, COMB_VS_EXACT = 32.0, 64.0
# y = sum_i pre_i x_i may cancel: ULPs at its terms' magnitude sum_i pre_i |x_i|. pre = sigmoid
# + eps carries its mix's error as post does (its scale ~1/2 of post's), plus a reordered
# 4-term sum (<= 4 ULPs): fp32 bound 64 (16 over more seeds), 16 from exact. bf16: both round
# fp32 values ~1e-5 apart (relative), far under a bf16 ULP (2^-8): one rounding flip at most.
Y_VS_REF = {torch.float32: 64.0, torch.bfloat16: 1.0}
Y_VS_EXACT = {torch.float32: 16.0, torch.bfloat16: 1.0}
# hc_post: 4 products and one more term in another order (FMA-contracted on the GPU):
# <= 5 eps relative to the terms' magnitude m, <= 10 ULPs there (ulp(m) >= m*eps/2): fp32
# bound 10; bf16 one rounding flip: 1.
NEW_VS_REF = {torch.float32: 10.0, torch.bfloat16: 1.0}


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32,
           std: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * std).to(dtype)


def _params(rows: int, d: int, n_scale: int, seed: int, dtype: torch.dtype = torch.float32):
    """fn [rows, HC*d] ~ N(0, 1/sqrt(K)), scale [n_scale] in [0.5, 1.5), base [rows] ~ N(0, 1)."""
    k = HC * d
    g = torch.Generator().manual_seed(seed + 1000)
    scale = (torch.rand(n_scale, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return (_randn(rows, k, seed=seed + 1, dtype=dtype, std=k ** -0.5), scale,
            _randn(rows, seed=seed + 2, dtype=dtype))


def _exact_mixes(x: torch.Tensor, fn: torch.Tensor, scales: torch.Tensor, base: torch.Tensor,
                 norm_eps: float = EPS) -> torch.Tensor:
    """The mixes in float64: x [T, HC, D] -> [T, rows of fn] (``_mixes``' formula)."""
    flat = x.flatten(1).double()
    r = torch.rsqrt(flat.pow(2).mean(dim=1, keepdim=True) + norm_eps)  # [T, 1]
    return base.double() + flat @ fn.double().T * r * scales.double()


def _collapse(pre: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (sum_i pre_i x_i, sum_i pre_i |x_i|): the value and its terms' magnitude."""
    xd = x.double()
    return ((pre.unsqueeze(1) @ xd).squeeze(1), (pre.unsqueeze(1) @ xd.abs()).squeeze(1))


def _exact_pre(x, fn, scale, base, hc_eps=EPS, norm_eps=EPS):
    """hc_pre in float64: (y, y's terms' magnitude, post, comb)."""
    scales = torch.cat((scale[0:1].expand(HC), scale[1:2].expand(HC), scale[2:3].expand(HC * HC)))
    m = _exact_mixes(x, fn, scales, base, norm_eps)  # [T, (2+HC)*HC]
    y, mag = _collapse(torch.sigmoid(m[:, :HC]) + hc_eps, x)
    comb = mhc.sinkhorn(m[:, 2 * HC:].reshape(-1, HC, HC), ITERS, hc_eps)  # the reference's
    return y, mag, 2 * torch.sigmoid(m[:, HC:2 * HC]), comb


# -- hc_pre ------------------------------------------------------------------------------

def _check_pre(x, fn, scale, base, hc_eps=EPS, norm_eps=EPS) -> tuple[torch.Tensor, ...]:
    """hc_pre_fused's outputs, checked against the reference and float64."""
    got = mhc.hc_pre_fused(x, fn, scale, base, ITERS, hc_eps, norm_eps)
    ref = mhc.hc_pre(x, fn, scale, base, ITERS, hc_eps, norm_eps)
    for g, r in zip(got, ref):
        assert (g.shape, g.dtype) == (r.shape, r.dtype)
    y64, mag, post64, comb64 = _exact_pre(x, fn, scale, base, hc_eps, norm_eps)
    dt = x.dtype
    assert max_ulps(got[0], ref[0], mag) <= Y_VS_REF[dt]
    assert max_ulps(got[0], y64.to(dt), mag) <= Y_VS_EXACT[dt]
    assert max_ulps(got[1], ref[1]) <= POST_VS_REF
    assert max_ulps(got[1], post64.float()) <= POST_VS_EXACT
    assert max_ulps(got[2], ref[2]) <= COMB_VS_REF
    assert max_ulps(got[2], comb64.float()) <= COMB_VS_EXACT
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,d", SHAPES, ids=IDS)
def test_hc_pre_matches_reference(t, d, dtype):
    """y, post and comb within the stated ULPs of the reference and of float64; comb's
    columns sum to 1 (the alternation ends on columns)."""
    x = _randn(t, HC, d, seed=t + d, dtype=dtype)  # [T, HC, D]
    comb = _check_pre(x, *_params((2 + HC) * HC, d, 3, seed=d))[2]
    torch.testing.assert_close(comb.sum(dim=1), torch.ones(t, HC), atol=1e-5, rtol=0)


def test_hc_pre_bf16_parameters():
    """A bf16 model's mHC parameters: the kernels upcast them (bitwise the fp32 upcast's
    result) and match the reference, which upcasts them too."""
    x = _randn(5, HC, 520, seed=3, dtype=torch.bfloat16)
    params = _params((2 + HC) * HC, 520, 3, seed=4, dtype=torch.bfloat16)
    got = _check_pre(x, *params)
    upcast = mhc.hc_pre_fused(x, *(p.float() for p in params), ITERS, EPS, EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, upcast))


def test_hc_pre_eps_placement():
    """Large epsilons (at 1e-6 they are within rounding): hc_eps where the reference adds
    it (pre, softmax, each normalisation's sums), norm_eps under the square root."""
    x = _randn(5, HC, 520, seed=16)
    _check_pre(x, *_params((2 + HC) * HC, 520, 3, seed=17), hc_eps=0.05, norm_eps=0.5)


def test_hc_pre_sums_many_k_slices():
    """Decode at D 4160: 68 K-slices, more than one step of the mixing kernel's sum."""
    x = _randn(1, HC, 4160, seed=14)
    params = _params((2 + HC) * HC, 4160, 3, seed=15)
    assert mhc._project(tk, x, params[0])[0].shape[0] > mhc.MAX_BLOCK_S
    _check_pre(x, *params)


# -- hc_head -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,d", SHAPES, ids=IDS)
def test_hc_head_matches_reference(t, d, dtype):
    """The collapse with sigmoid weights (fn [HC, K], one scale) within the ULPs of hc_pre's y
    (the same error path: a K-term dot through a sigmoid, then a 4-term sum)."""
    x = _randn(t, HC, d, seed=t * d, dtype=dtype)  # [T, HC, D]
    fn, scale, base = _params(HC, d, 1, seed=d + 7)
    got = mhc.hc_head_fused(x, fn, scale, base, EPS, EPS)
    ref = mhc.hc_head(x, fn, scale, base, EPS, EPS)
    assert (got.shape, got.dtype) == (ref.shape, ref.dtype)
    y64, mag = _collapse(torch.sigmoid(_exact_mixes(x, fn, scale, base)) + EPS, x)
    assert max_ulps(got, ref, mag) <= Y_VS_REF[dtype]
    assert max_ulps(got, y64.to(dtype), mag) <= Y_VS_EXACT[dtype]


# -- hc_post -----------------------------------------------------------------------------

def _post_inputs(t: int, d: int, dtype: torch.dtype, seed: int):
    out = _randn(t, d, seed=seed, dtype=dtype)  # [T, D]
    residual = _randn(t, HC, d, seed=seed + 1, dtype=dtype)  # [T, HC, D]
    post = 2 * torch.sigmoid(_randn(t, HC, seed=seed + 2))  # [T, HC] in (0, 2)
    comb = mhc.sinkhorn(_randn(t, HC, HC, seed=seed + 3), ITERS, EPS)  # [T, HC, HC]
    return out, residual, post, comb


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,d", SHAPES, ids=IDS)
def test_hc_post_matches_reference(t, d, dtype):
    """C^T @ X + post (x) out within the stated ULPs at the magnitude of the terms, for a
    comb that is not symmetric (the transposed orientation would be far off)."""
    out, residual, post, comb = _post_inputs(t, d, dtype, seed=t + d)
    got = mhc.hc_post_fused(out, residual, post, comb)
    ref = mhc.hc_post(out, residual, post, comb)
    assert (got.shape, got.dtype) == (ref.shape, ref.dtype)
    mag = (comb.double().transpose(1, 2) @ residual.double().abs()  # the terms' magnitude
           + post.double().unsqueeze(-1) * out.double().abs().unsqueeze(1))  # [T, HC, D]
    assert max_ulps(got, ref, mag) <= NEW_VS_REF[dtype]
    wrong = mhc.hc_post(out, residual, post, comb.transpose(1, 2))
    assert max_ulps(wrong, ref, mag) > 64 * NEW_VS_REF[dtype]  # the check can tell


# -- strides -----------------------------------------------------------------------------

def test_strided_inputs_read_as_contiguous():
    """The first layer's streams are an expanded embedding (stride 0 over hc), and post is
    a view of the gates: the kernels read through the strides, bitwise as on copies."""
    t, d = 3, 520
    emb = _randn(t, d, seed=5)  # [T, D]
    x = emb.unsqueeze(1).expand(-1, HC, -1)  # [T, HC, D], stride 0 over HC
    params = _params((2 + HC) * HC, d, 3, seed=6)
    got = mhc.hc_pre_fused(x, *params, ITERS, EPS, EPS)
    want = mhc.hc_pre_fused(x.contiguous(), *params, ITERS, EPS, EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    head = _params(HC, d, 1, seed=7)
    assert torch.equal(mhc.hc_head_fused(x, *head, EPS, EPS),
                       mhc.hc_head_fused(x.contiguous(), *head, EPS, EPS))

    out, _, post, comb = _post_inputs(t, d, torch.float32, seed=8)
    wide = _randn(t, 2 * d, seed=9)[:, :d]  # [T, D] with row stride 2D
    gates = torch.cat((torch.rand(t, HC), post), dim=1)[:, HC:]  # [T, HC], row stride 2HC
    comb_t = comb.transpose(1, 2).contiguous().transpose(1, 2)  # same values, column-major
    got = mhc.hc_post_fused(wide, x, gates, comb_t)
    want = mhc.hc_post_fused(wide.contiguous(), x.contiguous(), post, comb)
    assert got.is_contiguous() and torch.equal(got, want)


# -- tiles -------------------------------------------------------------------------------

def test_gpu_tiles_give_the_interpreted_results(monkeypatch):
    """The GPU launches one row a mixing / hc_post program in [HC, 512] tiles, the
    interpreter up to 16 rows side by side in wide ones (``mhc._tiles``); each row's
    operations are the same: bitwise the same results. T 17: two 16-row blocks, the second
    a tail; D 520: column tails, and two 512-column steps of an interpreted collapse."""
    t, d = 17, 520
    x = _randn(t, HC, d, seed=18)
    pre, head = _params((2 + HC) * HC, d, 3, seed=19), _params(HC, d, 1, seed=20)
    out, residual, post, comb = _post_inputs(t, d, torch.float32, seed=21)

    def run():  # 3 Sinkhorn iterations: the GPU's tiles run 17 of its programs
        return (*mhc.hc_pre_fused(x, *pre, 3, EPS, EPS), mhc.hc_head_fused(x, *head, EPS, EPS),
                mhc.hc_post_fused(out, residual, post, comb))

    assert mhc._tiles(x) == (16, 512, 1024)  # rows, columns a step, columns a mixing program
    want = run()
    monkeypatch.setattr(mhc, "_tiles", lambda _: (1, mhc.BLOCK_D, mhc.BLOCK_D))  # the GPU's
    assert all(torch.equal(a, b) for a, b in zip(run(), want))


# -- launches ----------------------------------------------------------------------------


class _Launches:
    """Counts the launches of triton_mhc's kernels through Triton's own pre-run hooks
    (called once per launch, compiled or interpreted); removed on exit."""

    KERNELS = (tk.hc_project_kernel, tk.hc_mix_kernel, tk.hc_post_kernel)

    def __enter__(self) -> Counter:
        self.count: Counter = Counter()
        self.hooks = [(k, lambda *a, _n=k.fn.__name__, **kw: self.count.update([_n]))
                      for k in self.KERNELS]
        for k, hook in self.hooks:
            k.add_pre_run_hook(hook)
        return self.count

    def __exit__(self, *exc) -> None:
        for k, hook in self.hooks:
            k.pre_run_hooks.remove(hook)


def test_each_op_is_one_op_of_at_most_two_kernels():
    """A dispatch mode sees each fused op as ONE op (nothing else: no casts, no copies);
    inside, hc_pre and hc_head launch 2 Triton kernels (projection, mixing) and hc_post 1."""
    t, d = 2, 64
    x = _randn(t, HC, d, seed=10)
    out, residual, post, comb = _post_inputs(t, d, torch.float32, seed=11)
    pre, head = _params((2 + HC) * HC, d, 3, seed=12), _params(HC, d, 1, seed=13)
    ops = torch.ops.nextn_graph
    calls = [
        (lambda: mhc.hc_pre_fused(x, *pre, ITERS, EPS, EPS), ops.hc_pre.default,
         {"hc_project_kernel": 1, "hc_mix_kernel": 1}),
        (lambda: mhc.hc_post_fused(out, residual, post, comb), ops.hc_post.default,
         {"hc_post_kernel": 1}),
        (lambda: mhc.hc_head_fused(x, *head, EPS, EPS), ops.hc_head.default,
         {"hc_project_kernel": 1, "hc_mix_kernel": 1}),
    ]
    for call, op, kernels in calls:
        with OpLog() as log, _Launches() as launched:
            call()
        assert log.ops == [op]
        assert dict(launched) == kernels


# -- meta --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fakes_match_the_reference_on_meta(dtype):
    """On the meta device (the work profile) the fakes give the reference's shapes/dtypes."""
    t, d = 7, 4096
    meta = torch.device("meta")
    x = torch.empty(t, HC, d, dtype=dtype, device=meta)
    pre = [torch.empty(s, device=meta) for s in (((2 + HC) * HC, HC * d), (3,), ((2 + HC) * HC,))]
    head = [torch.empty(s, device=meta) for s in ((HC, HC * d), (1,), (HC,))]
    out = torch.empty(t, d, dtype=dtype, device=meta)
    post = torch.empty(t, HC, device=meta)
    comb = torch.empty(t, HC, HC, device=meta)
    cases = [
        (mhc.hc_pre_fused(x, *pre, ITERS, EPS, EPS), mhc.hc_pre(x, *pre, ITERS, EPS, EPS)),
        ((mhc.hc_post_fused(out, x, post, comb),), (mhc.hc_post(out, x, post, comb),)),
        ((mhc.hc_head_fused(x, *head, EPS, EPS),), (mhc.hc_head(x, *head, EPS, EPS),)),
    ]
    for fused, ref in cases:
        assert len(fused) == len(ref)
        for f, r in zip(fused, ref):
            assert f.device.type == "meta"
            assert (f.shape, f.dtype) == (r.shape, r.dtype)
