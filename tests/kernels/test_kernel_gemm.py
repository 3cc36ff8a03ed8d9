"""The GEMM family's fused ops (``nextn_graph.kernels.gemm``) against the references
(``kernels.qgemm``: ``dequant_linear``, ``dequant_bmm``, ``grouped_dequant_mm``,
``float_grouped_mm``).

Interpreter tests (CPU tensors, ``TRITON_INTERPRET=1``) at DeepSeek-V4-Flash widths with
a few rows (FP8 linears wq_a, wkv, wq_b, wo_b; wo_a's quant_bmm, G 8; the FP4 routed
experts w1 / w2, G 8) and at small widths with tails (out / in not multiples of 128 for
FP8, of the kernel's 128-wide K step for FP4), fp32 and bf16 activations, e8m0 (uint8) and
fp32-as-int32 scales; one launch per call; the fakes on the meta device; the sm_90a builds.
The stored bits are random (every e4m3 code but NaN, every e2m1 code), the scales random
powers of two.

Tolerance. The reference dequantizes W exactly (in x's dtype) and runs the host GEMM; the
kernel sums the same products in another order (BLOCK_K-wide dots, accumulated over the K
steps, fp32). Each order's error is at most ~in * u * sum_i |x_i w_i| (u = eps/2), so the
two are within in * eps of ``terms = |x| @ |W|^T``: ``max_ulps(out, ref, scale=terms)``,
ULPs at that magnitude. That worst case (in * eps / ULP(terms) <= 2 * in fp32 ULPs) is far
from what rounding errors of random sign do (they grow as sqrt(in)): the bounds below are
the worst case's sqrt, which a dropped product or a wrong scale block (an error of one
term, ~terms / in, i.e. ~2^23 / in ULPs) still exceeds by orders of magnitude. bf16
outputs: the fp32 sums, then one rounding each (1 bf16 ULP), plus one for the
interpreter's truncating cast; their fp32 difference is under 2^-16 * in bf16 ULPs.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from nextn_graph.kernels import gemm, qgemm, triton_gemm
from nextn_graph.model.quant import FP4_VALUES
from oplog import OpLog
from ulp import max_ulps

FP4 = torch.tensor(FP4_VALUES)  # [16] the e2m1 values (unused by the kernel)
DTYPES = [torch.float32, torch.bfloat16]


def _bound(dtype: torch.dtype, inp: int) -> float:
    """ULPs of ``dtype`` at |x| @ |W|^T allowed for an ``inp``-term sum (module docstring):
    fp32 sqrt(2 * in), 2 at least; bf16 the output rounding, the interpreter's truncation
    and the fp32 difference (2^-16 * in bf16 ULPs)."""
    if dtype == torch.float32:
        return max(2.0, math.sqrt(2 * inp))
    return 2 + inp * 2.0 ** -16


def _randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _stored(fmt: str, groups: int, out: int, inp: int, fp32_scale: bool,
            seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random stored bits [G, out, in | in/2] uint8 (no e4m3 NaN) and scales
    [G, ceil(out/128), ceil(in/128) | out, in/32], powers of two 2^-4..2^2, as uint8 e8m0
    or int32 fp32 bits."""
    g = torch.Generator().manual_seed(seed)
    if fmt == "fp8":
        w = torch.randint(0, 256, (groups, out, inp), generator=g, dtype=torch.uint8)
        w = torch.where((w & 0x7F) == 0x7F, w ^ 1, w)  # 0x7F / 0xFF (NaN) -> 0x7E / 0xFE
        shape = (groups, -(-out // qgemm.FP8_BLOCK), -(-inp // qgemm.FP8_BLOCK))
    else:
        w = torch.randint(0, 256, (groups, out, inp // 2), generator=g, dtype=torch.uint8)
        shape = (groups, out, inp // qgemm.FP4_BLOCK)
    exp = torch.randint(-4, 3, shape, generator=g)
    if fp32_scale:
        return w, torch.pow(2.0, exp.double()).float().view(torch.int32)
    return w, (exp + 127).to(torch.uint8)


def _dequantized(fmt: str, w: torch.Tensor, s: torch.Tensor, inp: int) -> torch.Tensor:
    return qgemm.dequantize(fmt, w, s, w.shape[-2], inp, FP4, torch.float32)  # [.., out, in]


def _terms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|x| @ |W|^T in fp32: the magnitude the sums' rounding is relative to."""
    return x.float().abs() @ w.abs().transpose(-2, -1)


def _check(out: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor, inp: int) -> float:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    got = max_ulps(out, ref, scale=terms)
    assert got <= _bound(ref.dtype, inp), got
    return got


# -- quant_linear --------------------------------------------------------------------------

# fmt, out, in, rows (x's leading dims), activations, fp32 scales. V4-Flash: wq_a, wkv,
# wq_b, wo_b (a few rows); tails: out and in off the 128 blocks, out over two interpreted
# N tiles (2048), FP4's K step partial (in 224 = 128 + 96), T = 1, leading dims [2, 3].
LINEAR_CASES = [
    ("fp8", 1024, 4096, (4,), torch.bfloat16, False),  # wq_a
    ("fp8", 512, 4096, (1,), torch.float32, True),  # wkv
    ("fp8", 32768, 1024, (2,), torch.bfloat16, True),  # wq_b
    ("fp8", 4096, 8192, (1,), torch.float32, False),  # wo_b
    ("fp8", 300, 200, (2, 3), torch.float32, False),
    ("fp8", 300, 200, (5,), torch.bfloat16, True),
    ("fp8", 2200, 260, (1,), torch.bfloat16, False),
    ("fp8", 2200, 260, (3,), torch.float32, True),
    ("fp4", 100, 96, (2, 3), torch.bfloat16, False),
    ("fp4", 130, 224, (5,), torch.float32, True),
    ("fp4", 130, 224, (1,), torch.bfloat16, True),
    ("fp4", 2048, 4096, (3,), torch.bfloat16, False),  # an expert's w1 as a linear
]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: "-".join(map(str, c)))
def test_quant_linear_matches_dequant_linear(case):
    """Measured over 3 seeds (ULPs at |x| @ |W|^T; bounds ``_bound``): fp32 4 at small
    widths (bound 20-23), 1.4 at V4 widths (bound 91-128); bf16 1 (bound 2.0-2.1)."""
    fmt, out, inp, lead, dtype, fp32_scale = case
    w, s = _stored(fmt, 1, out, inp, fp32_scale, seed=out + inp)
    w, s = w[0], s[0]
    x = _randn(*lead, inp, seed=inp, dtype=dtype)
    got = gemm.fused_quant_linear(x, w, s, FP4, fmt, inp)
    ref = qgemm.dequant_linear(x, w, s, FP4, fmt, inp)
    _check(got, ref, _terms(x, _dequantized(fmt, w, s, inp)), inp)


# -- quant_bmm -----------------------------------------------------------------------------

# fmt, G, out, in, T, activations, fp32 scales: wo_a (G 8 of [1024, 4096]) at decode;
# tails; T = 1; T 80 (two interpreted row tiles of 64 a group)
BMM_CASES = [
    ("fp8", 8, 1024, 4096, 2, torch.bfloat16, False),  # wo_a
    ("fp8", 3, 200, 300, 1, torch.float32, True),
    ("fp8", 3, 200, 300, 5, torch.bfloat16, False),
    ("fp4", 2, 64, 96, 80, torch.float32, False),
    ("fp4", 2, 64, 160, 3, torch.bfloat16, True),
]


@pytest.mark.parametrize("case", BMM_CASES, ids=lambda c: "-".join(map(str, c)))
def test_quant_bmm_matches_dequant_bmm(case):
    """Measured over 3 seeds: fp32 5 (in 96: bound 13.9); bf16 1, 0.25 for wo_a."""
    fmt, groups, out, inp, t, dtype, fp32_scale = case
    w, s = _stored(fmt, groups, out, inp, fp32_scale, seed=groups * out + inp)
    x = _randn(groups, t, inp, seed=t + inp, dtype=dtype)  # [G, T, in]
    got = gemm.fused_quant_bmm(x, w, s, FP4, fmt, inp)
    ref = qgemm.dequant_bmm(x, w, s, FP4, fmt, inp)
    _check(got, ref, _terms(x, _dequantized(fmt, w, s, inp)), inp)


# -- quant_grouped_mm ----------------------------------------------------------------------

def _grouped_case(counts: list[int], foreign: int, inp: int, dtype: torch.dtype, seed: int):
    """offs [G] int32 from the rows each group has, x [A, in] with ``foreign`` rows past
    offs[-1] (another rank's: NaN, never read)."""
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)  # [G]
    x = _randn(int(offs[-1]) + foreign, inp, seed=seed, dtype=dtype)  # [A, in]
    x[int(offs[-1]):] = float("nan")
    return x, offs


def _grouped_terms(x: torch.Tensor, offs: torch.Tensor, weight_of) -> torch.Tensor:
    """|x| @ |W_g|^T for each group's rows, those below offs[-1]: [offs[-1], out];
    ``weight_of(g)`` is W_g [out, in] fp32 (asked of the groups with rows only)."""
    parts, start = [], 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            parts.append(_terms(x[start:end], weight_of(g)))
        start = end
    return torch.cat(parts)


# fmt, counts (rows per group), foreign rows, out, in, activations, fp32 scales. V4-Flash:
# w1 / w3 [2048, 4096] and w2 [4096, 2048] of G 8 at decode (two groups with rows); G 24
# with most groups empty; a group of 150 rows (three row tiles of 64); tails (bf16 rows
# of 264: torch._grouped_mm, the reference, takes strides of 16 bytes only).
GROUPED_CASES = [
    ("fp4", [0, 3, 0, 0, 0, 2, 0, 0], 2, 2048, 4096, torch.bfloat16, False),  # w1 / w3
    ("fp4", [1, 0, 0, 0, 0, 0, 0, 4], 1, 4096, 2048, torch.float32, True),  # w2
    ("fp4", [0, 1, 2, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 1, 0, 0, 2],
     3, 96, 160, torch.bfloat16, True),
    ("fp4", [150, 0, 7], 0, 64, 96, torch.float32, False),
    ("fp8", [2, 0, 5, 1], 4, 200, 264, torch.bfloat16, False),
    ("fp8", [0, 6, 0, 1], 0, 200, 300, torch.float32, True),
    ("fp8", [0, 0, 0], 5, 200, 300, torch.float32, False),  # no rows anywhere
]


@pytest.mark.parametrize("case", GROUPED_CASES, ids=lambda c: f"{c[0]}-G{len(c[1])}-{c[3]}x"
                         f"{c[4]}-{str(c[5])[6:]}-{'f32s' if c[6] else 'e8m0'}")
def test_quant_grouped_mm_matches_reference_and_zeros_the_rest(case):
    """Rows below offs[-1] as ``grouped_dequant_mm(static=False)``; rows past it (NaN
    input) are zeros. Measured over 3 seeds: fp32 6 (in 96: bound 13.9), 1 at V4 widths
    (bound 64); bf16 1, 0.25 at V4 widths."""
    fmt, counts, foreign, out, inp, dtype, fp32_scale = case
    w, s = _stored(fmt, len(counts), out, inp, fp32_scale, seed=out + inp + len(counts))
    x, offs = _grouped_case(counts, foreign, inp, dtype, seed=inp + foreign)
    got = gemm.fused_quant_grouped_mm(x, w, s, FP4, offs, fmt, inp)
    end = int(offs[-1])
    assert got.shape == (x.shape[0], out) and got.dtype == dtype
    assert torch.equal(got[end:], torch.zeros(x.shape[0] - end, out, dtype=dtype))
    if end:
        ref = qgemm.grouped_dequant_mm(x, w, s, FP4, offs, fmt, inp, static=False)
        terms = _grouped_terms(x, offs, lambda g: _dequantized(fmt, w[g], s[g], inp))
        _check(got[:end], ref[:end], terms, inp)


# -- the float grouped GEMM ----------------------------------------------------------------

# counts, foreign, out, in, dtype: V4's w1 shape in fp32 (CUDA fp32's case) and bf16; tails
FLOAT_CASES = [
    ([0, 2, 0, 0, 0, 0, 3, 0], 1, 2048, 4096, torch.float32),
    ([2, 0, 5, 1], 3, 200, 264, torch.bfloat16),
    ([0, 70, 1], 0, 100, 132, torch.float32),
]


@pytest.mark.parametrize("case", FLOAT_CASES, ids=lambda c: f"G{len(c[0])}-{c[2]}x{c[3]}-"
                         f"{str(c[4])[6:]}")
def test_grouped_mm_matches_float_grouped_mm(case):
    """Measured over 3 seeds: fp32 1.1 (bound 16), 0.44 at V4 widths (bound 91); bf16
    0.5."""
    counts, foreign, out, inp, dtype = case
    w = _randn(len(counts), out, inp, seed=out, dtype=dtype)  # [G, out, in]
    x, offs = _grouped_case(counts, foreign, inp, dtype, seed=inp)
    got = gemm.fused_grouped_mm(x, w, offs)
    end = int(offs[-1])
    assert torch.equal(got[end:], torch.zeros(x.shape[0] - end, out, dtype=dtype))
    ref = qgemm.float_grouped_mm(x, w, offs)
    _check(got[:end], ref[:end], _grouped_terms(x, offs, lambda g: w[g].float()), inp)


# -- one launch per call, the fakes ---------------------------------------------------------

def _small_calls(device: str = "cpu"):
    """(op name, reference, args) of each op at small widths."""
    w8, s8 = _stored("fp8", 3, 200, 264, False, seed=1)
    w4, s4 = _stored("fp4", 3, 64, 96, True, seed=2)
    x8, offs = _grouped_case([2, 0, 3], 1, 264, torch.bfloat16, seed=3)
    x4 = _randn(3, 2, 96, seed=4, dtype=torch.float32)
    wf = _randn(3, 64, 96, seed=5, dtype=torch.float32)
    x8 = x8.nan_to_num()
    calls = [
        ("fused_quant_linear", qgemm.dequant_linear, (x8, w8[0], s8[0], FP4, "fp8", 264)),
        ("fused_quant_bmm", qgemm.dequant_bmm, (x4, w4, s4, FP4, "fp4", 96)),
        ("fused_quant_grouped_mm", lambda *a: qgemm.grouped_dequant_mm(*a, static=False),
         (x8, w8, s8, FP4, offs, "fp8", 264)),
        ("fused_grouped_mm", qgemm.float_grouped_mm,
         (x4[0], wf, torch.tensor([1, 1, 2], dtype=torch.int32))),
    ]
    return [(name, ref, tuple(a.to(device) if isinstance(a, torch.Tensor) else a
                              for a in args)) for name, ref, args in calls]


def test_each_op_is_one_op_and_one_launch():
    """The dispatcher sees the one op; it launches qgemm_kernel once (Triton's pre-run
    hook)."""
    launched: Counter = Counter()
    kernel = triton_gemm.qgemm_kernel

    def hook(*a, **kw):
        launched.update(["qgemm_kernel"])
    kernel.add_pre_run_hook(hook)
    try:
        for name, _, args in _small_calls():
            launched.clear()
            with OpLog() as log:
                getattr(gemm, name)(*args)
            assert log.ops == [getattr(torch.ops.nextn_graph, name).default], name
            assert launched == Counter(qgemm_kernel=1), name
    finally:
        kernel.pre_run_hooks.remove(hook)


def test_fakes_give_the_references_shapes_and_dtypes():
    """On the meta device (the work profile) each op returns what its reference does."""
    for (name, _, meta_args), (_, ref, args) in zip(_small_calls("meta"), _small_calls()):
        fused = getattr(gemm, name)(*meta_args)
        want = ref(*args)
        assert fused.device.type == "meta"
        assert (fused.shape, fused.dtype) == (want.shape, want.dtype)


def test_unknown_format_is_refused():
    args = _small_calls()[0][2]
    with pytest.raises(ValueError, match="unknown quantized format"):
        gemm.fused_quant_linear(*args[:4], "int4", 264)


# -- sm_90a builds ------------------------------------------------------------------------
