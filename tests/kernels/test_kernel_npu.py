"""The NPU kernel set (``nextn_graph/kernels/npu.py``) through a fake torch_npu.

``tests/fake_npu_ops.py`` implements the mapped torch_npu ops from their docs, so these
tests check the mapping (argument order, layouts, cos/sin tables, index arrangement,
conventions such as comb vs comb^T) against the references, at tiny and
DeepSeek-V4-Flash widths, fp32 inputs (bf16 for mHC: npu_mhc_* take bf16/fp16 only).
Nothing here has run on an NPU. Mapped: rms_norm, rope, q_kv_norm_rope, swiglu,
moe_combine (A2 only), hc_pre and hc_post (Ascend 950 only); grouped_mm and
quant_grouped_mm (A2, A3) are tested in ``test_kernel_npu_gemm.py``. Not mapped (the reference
on every product): moe_gate (npu_moe_gating_top_k has softmax / sigmoid scores, no
sqrt-softplus), moe_route (npu_moe_init_routing_v2 matches but costs more kernels than
the reference at this interface), hc_head. Tolerances are in ULPs of the output dtype
(``ulp.py``); the measured maxima are over 20 seeds.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fake_npu_ops import A2, A3, ASCEND950, FakeTorchNpu
from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.kernels import mhc, moe, norm, npu
from nextn_graph.kernels.select import REFERENCE
from nextn_graph.model.ops import RopeTable

from ulp import max_ulps

PRESETS = ("tiny", "flash-slice")  # tiny widths, DeepSeek-V4-Flash widths
EPS = 1e-6
FIELDS = ("rms_norm", "q_kv_norm_rope", "rope", "hc_pre", "hc_post", "hc_head", "moe_gate",
          "moe_route", "swiglu", "moe_combine", "grouped_mm", "quant_linear", "quant_bmm",
          "quant_grouped_mm")
GEMMS = {"grouped_mm", "quant_grouped_mm"}  # npu_grouped_matmul: A2, A3 (test_kernel_npu_gemm)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rot(cfg, t: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """The model's rotation [T, dim/2, 2, 2] at random positions (YaRN table)."""
    positions = torch.randint(0, cfg.max_position_embeddings, (t,), generator=gen)
    return RopeTable(cfg, compressed=True).rotation(positions, dim)


# ---- the set per product ------------------------------------------------------------

@pytest.mark.parametrize("soc, mapped", [
    (A2, {"rms_norm", "q_kv_norm_rope", "rope", "swiglu", "moe_combine"} | GEMMS),
    (A3, {"rms_norm", "q_kv_norm_rope", "rope", "swiglu"} | GEMMS),  # finalize_routing: A2
    (ASCEND950, {"hc_pre", "hc_post"}),  # npu_mhc_*: 950 only; the others not listed
    (200, set()),  # Atlas 300I (310P): nothing mapped
])
def test_set_maps_what_the_product_supports(soc, mapped):
    kern = npu.npu_kernels(FakeTorchNpu(soc))
    assert kern.name == "npu" and kern.fused
    got = {f for f in FIELDS if getattr(kern, f) is not getattr(REFERENCE, f)}
    assert got == mapped
    for f in ("moe_gate", "moe_route", "hc_head", "quant_linear", "quant_bmm"):  # never mapped
        assert getattr(kern, f) is getattr(REFERENCE, f)
    assert not kern.sparse  # the sparse path is not mapped (docs/kernels_npu.md)


def test_products_by_soc_version():
    assert [npu.product(FakeTorchNpu(s)) for s in (220, 225, 250, 256, 260, 100, 240)] == [
        "A2", "A2", "A3", "A3", "950", None, None]
    assert npu.product(SimpleNamespace()) is None  # no get_soc_version: nothing mapped


def test_an_op_torch_npu_lacks_stays_reference():
    """An older torch_npu without npu_clipped_swiglu / npu_rotary_mul: only what exists."""
    fake = FakeTorchNpu(A2)
    old = SimpleNamespace(npu=fake.npu, npu_rms_norm=fake.npu_rms_norm)
    kern = npu.npu_kernels(old)
    assert kern.rms_norm is not REFERENCE.rms_norm
    assert kern.rope is REFERENCE.rope and kern.swiglu is REFERENCE.swiglu
    assert kern.q_kv_norm_rope is REFERENCE.q_kv_norm_rope


# ---- norm and RoPE ---------------------------------------------------------------------

@pytest.mark.parametrize("d", [64, 512, 1024, 4096])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(d, weighted):
    """npu_rms_norm vs ``rms_norm(x, eps) * weight``, fp32, 4 rows. The mean of d squares
    (no cancellation) summed in another order (torch.mean vs baddbmm's dot): a relative
    error of a few ulps in practice (bound (d-1)u), halved by rsqrt, plus the two
    products' roundings. Measured <= 5 ULPs; bound 12."""
    g = _gen(d)
    x = torch.randn(4, d, generator=g)
    w = torch.randn(d, generator=g) * 0.5 + 1 if weighted else None
    eps_t = torch.full((1, 1, 1), EPS)
    ref = norm.rms_norm(x, eps_t)
    ref = ref * w if weighted else ref
    ops = FakeTorchNpu(A2)
    got = npu.npu_kernels(ops).rms_norm(x, w, EPS, eps_t)
    assert ops.calls["npu_rms_norm"] == 1
    assert got.dtype == x.dtype and got.shape == x.shape
    assert max_ulps(got, ref) <= 12


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_is_bitwise(preset, inverse):
    """npu_rotary_mul's interleave mode with the cos/sin tables equals apply_rope
    bitwise in fp32: each output is the same two products (x0*c and x1*(-s) vs
    (-x1)*s: negation is exact) summed in the same order. Shapes [T, d], [T, H, d],
    [T, 2, 3, d], and the indexer's rotation scaled by score_scale."""
    cfg = preset_config(preset)
    g = _gen(1)
    t, hd = 3, cfg.head_dim
    rot = _rot(cfg, t, hd, g)
    ops = FakeTorchNpu(A2)
    kern = npu.npu_kernels(ops)
    for shape in ((t, hd), (t, cfg.num_attention_heads, hd), (t, 2, 3, hd)):
        x = torch.randn(shape, generator=g)
        assert torch.equal(kern.rope(x, rot, inverse), norm.apply_rope(x, rot, inverse))
    di = cfg.index_head_dim
    rot_i = _rot(cfg, t, di, g) * (di ** -0.5 * cfg.index_n_heads ** -0.5)  # Indexer.rotation
    q = torch.randn(t, cfg.index_n_heads, di, generator=g)
    assert torch.equal(kern.rope(q, rot_i, inverse), norm.apply_rope(q, rot_i, inverse))
    assert ops.calls["npu_rotary_mul"] == 4


def test_rope_outside_the_documented_limits_is_the_reference():
    """D >= 896 (npu_rotary_mul's limit): the reference, torch_npu never called."""
    g = _gen(2)
    ops = FakeTorchNpu(A2)
    x = torch.randn(2, 3, 1024, generator=g)
    rot = torch.randn(2, 512, 2, 2, generator=g)
    assert torch.equal(npu.rope(ops, x, rot, False), norm.apply_rope(x, rot, False))
    assert ops.calls["npu_rotary_mul"] == 0


def test_rotary_tables_layout():
    """cos/sin [T, 1, d], each value twice (a pair shares its angle), contiguous."""
    c, s = torch.tensor([0.6, 1.0]), torch.tensor([0.8, 0.0])
    rot = torch.stack((c, s, -s, c), dim=-1).unflatten(-1, (2, 2)).unsqueeze(0)  # [1, 2, 2, 2]
    cos, sin = npu.rotary_tables(rot, False, torch.float32)
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (1, 1, 4)
    assert cos.flatten().tolist() == pytest.approx([0.6, 0.6, 1.0, 1.0])
    assert sin.flatten().tolist() == pytest.approx([0.8, 0.8, 0.0, 0.0])
    assert npu.rotary_tables(rot, True, torch.float32)[1].flatten().tolist() == pytest.approx(
        [-0.8, -0.8, 0.0, 0.0])


@pytest.mark.parametrize("preset", PRESETS)
def test_q_kv_norm_rope(preset):
    """Two npu_rms_norm and two rotations vs the reference's cat, norm, in-place weight and
    RoPE, fp32, T=2 (V4: H=64, hd=512). The norms differ by a few ULPs (test_rms_norm);
    the rotation adds two products that may cancel, so the error is measured in ULPs of
    |x0*c| + |x1*s| (the terms' magnitudes). Measured <= 5 ULPs; bound 16."""
    cfg = preset_config(preset)
    g = _gen(3)
    t, h, hd = 2, cfg.num_attention_heads, cfg.head_dim
    q, kv = torch.randn(t, h, hd, generator=g), torch.randn(t, hd, generator=g)
    w = torch.randn(hd, generator=g) * 0.5 + 1
    rot = _rot(cfg, t, hd, g)
    eps_t = torch.full((1, 1, 1), EPS)
    ops = FakeTorchNpu(A3)
    got_q, got_kv = npu.npu_kernels(ops).q_kv_norm_rope(q, kv, w, EPS, eps_t, rot)
    ref_q, ref_kv = norm.q_kv_norm_rope(q, kv, w, eps_t, rot)
    heads = norm.rms_norm(torch.cat((q, kv.unsqueeze(1)), dim=1), eps_t)
    heads[:, -1].mul_(w)
    terms = norm.apply_rope(heads.abs(), rot.abs())  # [T, H+1, hd]: |x0 c| + |x1 s|
    assert got_q.shape == ref_q.shape and got_kv.shape == ref_kv.shape
    assert max_ulps(got_q, ref_q, terms[:, :-1]) <= 16
    assert max_ulps(got_kv, ref_kv, terms[:, -1]) <= 16
    assert ops.calls["npu_rms_norm"] == 2 and ops.calls["npu_rotary_mul"] == 2


# ---- MoE -------------------------------------------------------------------------------

@pytest.mark.parametrize("a, inter", [(6, 64), (12, 2048)])
def test_swiglu(a, inter):
    """npu_clipped_swiglu(alpha=1, bias=0, halves) vs clamp, silu, multiply, fp32, limit
    10 (inputs up to ~16 so both clamps act). silu as a*sigmoid(a) vs F.silu's own
    formula, then one product: measured <= 2 ULPs; bound 4."""
    g = _gen(a)
    gate, up = torch.randn(a, inter, generator=g) * 4, torch.randn(a, inter, generator=g) * 4
    ops = FakeTorchNpu(A2)
    got = npu.npu_kernels(ops).swiglu(gate, up, 10.0)
    assert ops.calls["npu_clipped_swiglu"] == 1 and got.dtype == gate.dtype
    assert max_ulps(got, moe.swiglu_reference(gate, up, 10.0)) <= 4
    # no limit: no clamp in the reference, so not the clipped op
    assert torch.equal(npu.swiglu(ops, gate, up, 0.0), moe.swiglu_reference(gate, up, 0.0))
    assert ops.calls["npu_clipped_swiglu"] == 1


@pytest.mark.parametrize("t, k, n, d", [(5, 2, 4, 64), (4, 6, 8, 4096)])
@pytest.mark.parametrize("parallel", [False, True])
def test_moe_combine(t, k, n, d, parallel):
    """npu_moe_finalize_routing (dropless, indices by row) vs the reference's weight,
    mask, un-permute and sum, fp32. Under expert parallelism rank 1 of 2 holds experts
    [n, 2n): the other rank's rows (past offs[-1]) are NaN and must add exactly 0. A sum
    of k weighted terms in top-k order: bound 2 ULPs of sum_j |w_j y_j|; measured 0."""
    g = _gen(t * d)
    experts = 2 * n if parallel else n
    chosen = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(t)])
    start = n if parallel else 0
    key, order, offs = moe.route_reference(chosen, n, start, parallel)
    ys = torch.randn(t * k, d, generator=g)
    ys[int(offs[-1]):] = float("nan")  # another rank's rows: undefined
    w = torch.rand(t, k, generator=g)
    ops = FakeTorchNpu(A2)
    got = npu.npu_kernels(ops).moe_combine(ys, order, key, w, offs, n, parallel)
    ref = moe.combine_reference(ys, key, order, w, n)
    terms = moe.combine_reference(ys.abs(), key, order, w, n)  # sum_j |w_j y_j|
    assert ops.calls["npu_moe_finalize_routing"] == 1
    assert got.dtype == torch.float32 and not got.isnan().any()
    assert max_ulps(got, ref, terms) <= 2


# ---- mHC -------------------------------------------------------------------------------

def _hc_inputs(cfg, t: int, gen: torch.Generator):
    hc, d = cfg.hc_mult, cfg.hidden_size
    mix = (2 + hc) * hc
    x = torch.randn(t, hc, d, generator=gen).bfloat16()  # npu_mhc_*: bf16/fp16 streams
    fn = torch.randn(mix, hc * d, generator=gen) * (hc * d) ** -0.5
    return x, fn, torch.rand(3, generator=gen) + 0.5, torch.randn(mix, generator=gen) * 0.1


@pytest.mark.parametrize("preset", PRESETS)
def test_hc_pre(preset):
    """npu_mhc_pre + npu_mhc_sinkhorn vs the reference, x bf16 [2, hc, D] (V4: hc 4,
    D 4096), params fp32. The RMS factor's mean of hc*D = 16384 squares is summed in
    another order (measured 68 ULPs apart at V4 widths; bound (n-1)u), rsqrt halves it,
    and the mixes inherit it: post = 2 sigmoid(m) measured <= 137 ULPs (tiny 8), bound
    512; comb, the softmax and 20 Sinkhorn rounds of the logits, measured <= 283 ULPs
    (tiny 15), bound 1024 (a layout or transpose slip is O(1): millions of ULPs); Sinkhorn alone
    on the same logits is bitwise the reference. y (bf16) rounds once: measured <= 1 bf16
    ULP of sum_i pre_i |x_i|; bound 1."""
    cfg = preset_config(preset)
    g = _gen(4)
    x, fn, scale, base = _hc_inputs(cfg, 2, g)
    args = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    ops = FakeTorchNpu(ASCEND950)
    kern = npu.npu_kernels(ops)
    y, post, comb = kern.hc_pre(x, fn, scale, base, *args, None)
    ref_y, ref_post, ref_comb = mhc.hc_pre(x, fn, scale, base, *args)
    assert ops.calls["npu_mhc_pre"] == 1 and ops.calls["npu_mhc_sinkhorn"] == 1
    assert (y.dtype, post.dtype, comb.dtype) == (ref_y.dtype, ref_post.dtype, ref_comb.dtype)
    hc = cfg.hc_mult
    consts = mhc.HcConstants.make(hc, cfg.hc_eps, x.device)
    scales = torch.cat((scale[0:1].expand(hc), scale[1:2].expand(hc), scale[2:3].expand(hc * hc)))
    mixes = mhc._mixes(x, fn, scales, base, cfg.rms_norm_eps, consts.ones)  # [T, (2+hc)hc]
    pre = torch.sigmoid(mixes[:, :hc]) + cfg.hc_eps
    y_terms = torch.bmm(pre.unsqueeze(1), x.float().abs()).squeeze(1)  # sum_i pre_i |x_i|
    assert max_ulps(y, ref_y, y_terms) <= 1
    assert max_ulps(post, ref_post) <= 512
    assert max_ulps(comb, ref_comb) <= 1024
    logits = mixes[:, 2 * hc:].reshape(-1, hc, hc)
    assert torch.equal(ops.npu_mhc_sinkhorn(logits, cfg.hc_eps, cfg.hc_sinkhorn_iters)[0],
                       mhc.sinkhorn(logits, cfg.hc_sinkhorn_iters, cfg.hc_eps))


def test_hc_pre_fp32_streams_are_the_reference():
    """fp32 streams (npu_mhc_pre takes bf16/fp16): the reference, bitwise, no call."""
    cfg = preset_config("tiny")
    x, fn, scale, base = _hc_inputs(cfg, 2, _gen(5))
    x = x.float()
    ops = FakeTorchNpu(ASCEND950)
    args = (cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    got = npu.npu_kernels(ops).hc_pre(x, fn, scale, base, *args, None)
    for a, b in zip(got, mhc.hc_pre(x, fn, scale, base, *args)):
        assert torch.equal(a, b)
    assert ops.calls["npu_mhc_pre"] == 0


@pytest.mark.parametrize("preset", PRESETS)
def test_hc_post(preset):
    """npu_mhc_post(residual, comb, out, post) vs the reference's C^T @ X + post (x) out:
    fp32 sums of hc + 1 terms in another order, one rounding to bf16: measured <= 1 bf16
    ULP; bound 1. comb is not symmetric, so passing comb^T would fail by O(1)."""
    cfg = preset_config(preset)
    g = _gen(6)
    x, fn, scale, base = _hc_inputs(cfg, 2, g)
    _, post, comb = mhc.hc_pre(x, fn, scale, base, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                               cfg.rms_norm_eps)
    out = torch.randn(2, cfg.hidden_size, generator=g).bfloat16()
    ops = FakeTorchNpu(ASCEND950)
    got = npu.npu_kernels(ops).hc_post(out, x, post, comb)
    ref = mhc.hc_post(out, x, post, comb)
    assert ops.calls["npu_mhc_post"] == 1 and got.dtype == ref.dtype == torch.bfloat16
    assert max_ulps(got, ref) <= 1
    assert max_ulps(npu.hc_post(ops, out, x, post, comb.transpose(1, 2)), ref) > 1000


# ---- the fake follows the docs -------------------------------------------------------------

def test_fake_ops_follow_their_docs():
    """The documented conventions the mapping relies on, on hand-made inputs."""
    ops = FakeTorchNpu(A2)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])  # [T=1, N=1, D=4]
    zero, one = torch.zeros(1, 1, 4), torch.ones(1, 1, 4)
    # npu_rotary_mul: rotate(x) interleaved = (-x1, x0, -x3, x2); half = (-x2, -x3, x0, x1)
    assert ops.npu_rotary_mul(x, zero, one, "interleave").flatten().tolist() == [-2, 1, -4, 3]
    assert ops.npu_rotary_mul(x, zero, one, "half").flatten().tolist() == [-3, -4, 1, 2]
    with pytest.raises(RuntimeError, match="T1D"):  # cos [1, 1, D] for T=2: not T1D
        ops.npu_rotary_mul(x.expand(2, 1, 4).contiguous(), zero, one, "interleave")
    # npu_clipped_swiglu: halves A | B, A clamped above, B both ways, (B + bias)
    y = ops.npu_clipped_swiglu(torch.tensor([[20.0, 0.0, -30.0, 3.0]]), alpha=1.0, limit=10.0,
                               bias=0.0, interleaved=False)
    assert y.flatten().tolist() == pytest.approx([10 / (1 + torch.e ** -10) * -10, 0.0])
    # npu_moe_finalize_routing: mode 2 reads src_to_dst by row (i*K + k), mode 0 by column
    rows = torch.arange(4.0).unsqueeze(1)  # row r holds r
    idx = torch.tensor([3, 2, 1, 0], dtype=torch.int32)
    scales = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])
    by_row = ops.npu_moe_finalize_routing(rows, None, None, None, scales, idx, None, 2)
    by_col = ops.npu_moe_finalize_routing(rows, None, None, None, scales, idx, None, 0)
    assert by_row.flatten().tolist() == [3 + 20, 100 + 0]
    assert by_col.flatten().tolist() == [3 + 10, 200 + 0]
    # npu_mhc_post: y[j] = sum_i h_res[i, j] x[i] + post[j] out (the op's CPU golden)
    streams = torch.arange(4.0).view(1, 4, 1).expand(1, 4, 16).bfloat16()  # stream i holds i
    h_res = torch.zeros(1, 4, 4)
    h_res[0, 2, 1] = 1.0  # h_res[i=2, j=1]: stream 2 into output 1 (h_res^T: 1 into 2)
    post = torch.tensor([[0.0, 0.0, 0.0, 0.5]])
    y = ops.npu_mhc_post(streams, h_res, torch.full((1, 16), 4.0).bfloat16(), post)
    assert y[0, :, 0].tolist() == [0.0, 2.0, 0.0, 2.0]
