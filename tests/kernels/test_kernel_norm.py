"""The norm / RoPE family's fused ops (``nextn_graph.kernels.norm``) against their references.

Interpreter tests (CPU tensors, ``TRITON_INTERPRET=1``) from the tiny preset's widths to
DeepSeek-V4-Flash's, fp32 and bf16, rotations from real ``RopeTable``s (tiny and
flash-slice, base and YaRN'd tables) at small and large positions; the sm_90a builds of
every kernel; the fakes on the meta device. Tolerances are in ULPs of the output dtype
(``ulp.py``), each justified where it is set; the measured maxima are in the docstrings.
Below, u is the unit roundoff (half an ULP, relative); an error of e relative is at most
e/u ULPs. Triton 3.9's interpreter casts fp32 to bf16 by truncation (a GPU rounds to
nearest: ``cvt.rn.bf16.f32``), so the kernels' own bf16 rounding counts as 1 ULP here.
"""

from __future__ import annotations


import pytest
import torch

from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.kernels import norm
from nextn_graph.model.ops import RopeTable
from ulp import max_ulps

EPS = 1e-6  # both presets' rms_norm_eps
DTYPES = [torch.float32, torch.bfloat16]
# (x dtype, rot dtype): the model's (rot cast with the model) and bf16 inputs with fp32 rot
ROT_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
             (torch.bfloat16, torch.float32)]
# preset, compressed table, T positions (up to the preset's last), head dim, heads
ROPE_SHAPES = [
    ("tiny", False, [0, 1, 17, 511], 32, 4),  # attention: hd 32, rope 16
    ("tiny", True, [3, 128, 509], 32, 2),  # YaRN'd table (C4 / C128 layers)
    ("flash-slice", False, [0, 4095], 512, 64),  # V4 attention: 64 heads of 512, rope 64
    ("flash-slice", True, [7, 2048, 4095], 128, 8),  # V4 indexer width 128 (a slice of heads)
]


@pytest.fixture(scope="module")
def tables() -> dict[tuple[str, bool], RopeTable]:
    return {(p, c): RopeTable(preset_config(p), compressed=c)
            for p in ("tiny", "flash-slice") for c in (False, True)}


def _randn(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _eps_tensor(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((1, 1, 1), EPS, dtype=dtype)  # as RMSNorm.eps_tensor


def _rope_scale(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """sum_i |x_i w_ij| per output (float64): the magnitude a two-term rotation's error is
    bounded by, whatever the cancellation between its terms."""
    return norm.apply_rope(x.double().abs(), rot.double().abs(), inverse)


# -- rms_norm --------------------------------------------------------------------------

# In ULPs of the output at its own magnitude (no cancellation anywhere: y = x * r * w).
# fp32: a sum of d squares (positive terms) in the kernel's order against the CPU bmm's:
# a relative difference s, well under 1 u for these blocked / pairwise sums of d <= 4096;
# then on each side the 1/d scaling, + eps, sqrt and division (r within ~2u + s/2 of exact,
# the sqrt halving ms's error) and the product(s) (u each): each side within 3u (4u
# weighted) of the exact value, so at most 6u-8u + s apart: bound 8 ULP.
# bf16: the reference rounds mean(x^2) + eps (u, halved by the rsqrt), the rsqrt, the
# product and the weighted product to bf16: within 2.5u (3.5u) of exact; the kernel's fp32
# math plus its truncating cast within 2u: bound 5 ULP (4.5u + fp32 noise, weighted).
RMS_ULPS = {torch.float32: 8.0, torch.bfloat16: 5.0}
RMS_SHAPES = [(3, 5, 48), (7, 64), (2, 4, 32), (4, 4096), (4, 1024), (8, 512), (8, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["weightless", "weighted"])
@pytest.mark.parametrize("shape", RMS_SHAPES, ids=str)
def test_rms_norm_matches_the_reference(shape, weighted, dtype):
    """Measured max: fp32 2 ULP weightless, 3 weighted; bf16 2 ULP weightless, 3 weighted."""
    x = _randn(*shape, seed=1, dtype=dtype, scale=3.0)
    x.view(-1, shape[-1])[1] = 0  # an all-zero row: 0 * rsqrt(eps) = 0, exactly
    weight = _randn(shape[-1], seed=2, dtype=dtype, scale=0.5) + 1 if weighted else None
    ref = norm.rms_norm(x, _eps_tensor())
    if weighted:
        ref = ref * weight  # RMSNorm.forward
    out = norm.rms_norm_fused(x, weight, EPS)
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    assert max_ulps(out, ref) <= RMS_ULPS[dtype]
    zero = out.reshape(-1, shape[-1])[1]
    assert torch.equal(zero, torch.zeros_like(zero))
    assert torch.equal(ref.reshape(-1, shape[-1])[1], zero)


def test_rms_norm_reads_strided_rows():
    """Rows with a stride (a view of every other row) give the values of their copy."""
    base = _randn(8, 512, seed=3, dtype=torch.float32)
    x = base[::2]  # [4, 512], row stride 1024
    weight = _randn(512, seed=4, dtype=torch.float32)
    out = norm.rms_norm_fused(x, weight, EPS)
    assert torch.equal(out, norm.rms_norm_fused(x.contiguous(), weight, EPS))
    assert max_ulps(out, norm.rms_norm(x, _eps_tensor()) * weight) <= RMS_ULPS[torch.float32]


# -- q_kv_norm_rope --------------------------------------------------------------------

# In ULPs of the output at sum_i |n_i w_ij| (``_rope_scale``): a rotated value is a two-term
# sum whose terms may cancel, so its error is bounded relative to the terms, not to the
# result. Each term's error relative to it is at most its share of S. fp32: the normed
# inputs differ as the rms outputs do (the 8 ULP bound above, 3 measured); each side then
# rounds two products of its own inputs and their sum (1.5 ULP at S): bound 10 ULP.
# bf16: the reference's normed rows are bf16 (the bf16 rms bound, 5 ULP, kv's weight
# included) and it rounds both products and the sum to bf16 (1.5 ULP at S); the kernel's
# fp32 math and truncating cast: 1 ULP: bound 8 ULP. fp32 rot with bf16 q: the reference
# rotates in fp32 (dtype promotion), rounded to bf16 here (0.5 ULP) to compare: bound 7 ULP.
QKV_ULPS = {(torch.float32, torch.float32): 10.0, (torch.bfloat16, torch.bfloat16): 8.0,
            (torch.bfloat16, torch.float32): 7.0}


@pytest.mark.parametrize("dtypes", ROT_CASES, ids=lambda d: f"{d[0]}-rot-{d[1]}")
@pytest.mark.parametrize("preset, compressed, positions, hd, heads",
                         [s for s in ROPE_SHAPES if s[3] in (32, 512)], ids=str)
def test_q_kv_norm_rope_matches_the_reference(tables, preset, compressed, positions, hd,
                                              heads, dtypes):
    """Measured max (at the terms' scale): fp32 4 ULP, bf16 3 ULP, bf16 with fp32 rot 3 ULP."""
    dtype, rot_dtype = dtypes
    t = len(positions)
    rot = tables[preset, compressed].rotation(torch.tensor(positions), hd).to(rot_dtype)
    q = _randn(t, heads, hd, seed=5, dtype=dtype, scale=2.0)  # [T, H, hd]
    kv = _randn(t, hd, seed=6, dtype=dtype, scale=0.3)  # [T, hd]
    q[0, 1] = 0  # an all-zero head and kv row: normed to 0, rotated to 0
    kv[1] = 0
    kv_weight = _randn(hd, seed=7, dtype=dtype, scale=0.2) + 1  # [hd]
    q_ref, kv_ref = norm.q_kv_norm_rope(q, kv, kv_weight, _eps_tensor(), rot)
    q_out, kv_out = norm.q_kv_norm_rope_fused(q, kv, kv_weight, EPS, rot)
    assert q_out.shape == q_ref.shape and kv_out.shape == kv_ref.shape
    assert q_out.dtype == kv_out.dtype == dtype
    heads_ref = norm.rms_norm(torch.cat((q, kv.unsqueeze(1)), dim=1), _eps_tensor())
    heads_ref[:, -1].mul_(kv_weight)  # the normed rows: the rotation's inputs
    scale = _rope_scale(heads_ref, rot)  # [T, H+1, hd]
    bound = QKV_ULPS[dtype, rot_dtype]
    assert max_ulps(q_out, q_ref.to(dtype), scale[:, :-1]) <= bound
    assert max_ulps(kv_out, kv_ref.to(dtype), scale[:, -1]) <= bound
    assert not q_out[0, 1].any() and not kv_out[1].any()
    assert q_out.abs().amax() > 0.5 and kv_out.abs().amax() > 0.5  # not vacuous


# -- rope ------------------------------------------------------------------------------

# In ULPs at sum_i |x_i w_ij| (see above). fp32: the same two products and one sum, rounded
# alike (the interpreter fuses nothing): bitwise in practice; bound 1 ULP for a compiled
# kernel's FMA (one product unrounded: at most 0.5 ULP at the terms' scale, plus the sum's).
# bf16: the reference rounds each product to bf16 (0.5 ULP of each term, <= 0.5 at S) and
# then rounds the sum (1.5 ULP at S); the kernel's bf16 x bf16 products are exact in fp32,
# its truncating cast 1 ULP: bound 3 ULP. fp32 rot, bf16 x: the reference's fp32 result is
# the kernel's fp32 value; rounded to nearest here, truncated by the kernel: bound 1 ULP.
ROPE_ULPS = {(torch.float32, torch.float32): 1.0, (torch.bfloat16, torch.bfloat16): 3.0,
             (torch.bfloat16, torch.float32): 1.0}


@pytest.mark.parametrize("dtypes", ROT_CASES, ids=lambda d: f"{d[0]}-rot-{d[1]}")
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("middle", [True, False], ids=["heads", "rows"])
@pytest.mark.parametrize("preset, compressed, positions, hd, heads", ROPE_SHAPES, ids=str)
def test_rope_matches_the_reference(tables, preset, compressed, positions, hd, heads,
                                    middle, inverse, dtypes):
    """Measured max (at the terms' scale): fp32 0 ULP (bitwise), bf16 2 ULP, bf16 with fp32
    rot 1 ULP."""
    dtype, rot_dtype = dtypes
    t = len(positions)
    rot = tables[preset, compressed].rotation(torch.tensor(positions), hd).to(rot_dtype)
    shape = (t, heads, hd) if middle else (t, hd)  # attention's heads, or kv / entries
    x = _randn(*shape, seed=8, dtype=dtype, scale=1.5)
    ref = norm.apply_rope(x, rot, inverse)
    out = norm.rope_fused(x, rot, inverse)
    assert out.shape == ref.shape and out.dtype == dtype
    assert max_ulps(out, ref.to(dtype), _rope_scale(x, rot, inverse)) <= ROPE_ULPS[dtypes]
    assert not torch.equal(out, x)  # the rope dims did turn (positions > 0 present)


def test_rope_inverse_undoes_the_rotation(tables):
    """rope(rope(x), inverse) = x up to fp32 rounding: the transposed weights are used."""
    rot = tables["flash-slice", False].rotation(torch.tensor([5, 4000]), 512)
    x = _randn(2, 3, 512, seed=9, dtype=torch.float32)
    back = norm.rope_fused(norm.rope_fused(x, rot, False), rot, True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-6)


# -- meta: the fakes ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fakes_give_the_references_shapes_and_dtypes(dtype):
    meta = {"device": "meta", "dtype": dtype}
    x, w = torch.empty(2, 3, 4096, **meta), torch.empty(4096, **meta)
    eps_t = torch.empty(1, 1, 1, device="meta")
    q, kv = torch.empty(5, 64, 512, **meta), torch.empty(5, 512, **meta)
    kw = torch.empty(512, **meta)
    rot = torch.empty(5, 256, 2, 2, **meta)
    cases = [
        (norm.rms_norm_fused(x, w, EPS), norm.rms_norm(x, eps_t) * w),
        (norm.rms_norm_fused(x, None, EPS), norm.rms_norm(x, eps_t)),
        (norm.rope_fused(q, rot, True), norm.apply_rope(q, rot, True)),
        (norm.rope_fused(kv, rot, False), norm.apply_rope(kv, rot)),
        *zip(norm.q_kv_norm_rope_fused(q, kv, kw, EPS, rot),
             norm.q_kv_norm_rope(q, kv, kw, eps_t, rot)),
    ]
    for fused, ref in cases:
        assert fused.device.type == "meta"
        assert (fused.shape, fused.dtype) == (ref.shape, ref.dtype)
