"""The NPU set's GEMMs (``nextn_graph/kernels/npu_gemm.py``) through a fake torch_npu.

``tests/fake_npu_ops.py``'s ``npu_grouped_matmul`` is written from its doc (the
non-quantized single-tensor m-split case), so these tests check the mapping (the
transposed weight view, the int64 cumsum group_list with its last end at x's rows, the
padding groups of the quantized path) against ``qgemm``'s references, at tiny and
DeepSeek-V4-Flash expert widths (D 4096, I 2048; a few rows), fp32 and bf16, with empty
groups and expert parallelism (rows past ``offs[-1]``: undefined, not compared).
Nothing here has run on an NPU.

Tolerances. The fake sums each output's K products in fp32 (torch's host GEMM per group);
the reference (``torch._grouped_mm`` on the host) in its own order. For fp32 the distance
is measured in ULPs of sum_k |x_k w_k| (the terms' magnitude: the sum may cancel): a sum of
K terms in two orders is within ~K*eps of it at worst, ~sqrt(K)*eps in practice; bound 8
(a device reorders more than the host); measured 0 over 5 seeds (both reach the same host
GEMM). For bf16 both sum exact bf16 products in fp32 and round once, so they are equal or
one output ULP apart where a sum lies by a rounding boundary; bound 1 ULP of
sum_k |x_k w_k|; measured <= 0.03 (V4 widths; 0 tiny). The quantized op's dequantized
weights are bitwise the reference's (the same ``qgemm.dequantize``), so it takes the
bf16 bound: measured <= 0.03 (fp8, V4 widths), 0 (fp4).
"""

from __future__ import annotations

import pytest
import torch

from fake_npu_ops import A2, A3, ASCEND950, FakeTorchNpu
from nextn_graph.kernels import npu, npu_gemm, qgemm
from nextn_graph.kernels.select import REFERENCE
from nextn_graph.model.quant import FP4_VALUES, as_bits, quantize

from ulp import max_ulps

DTYPES = [torch.float32, torch.bfloat16]
BOUND = {torch.float32: 8, torch.bfloat16: 1}  # ULPs of sum_k |x_k w_k| (module docstring)
# (rows A, groups G, K in, N out): tiny, tails (widths off the powers of two; multiples of 8:
# the host reference, torch._grouped_mm, wants 16-byte bf16 strides), V4-Flash w1/w3 and w2
SHAPES = [(6, 4, 64, 64), (9, 5, 104, 40), (6, 3, 4096, 2048), (6, 3, 2048, 4096)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _counts(a: int, g: int, gen: torch.Generator) -> list[int]:
    """A rows over g groups, group 1 always empty (an expert with no rows)."""
    cuts = sorted(torch.randint(0, a + 1, (g - 2,), generator=gen).tolist())
    sizes = [b - c for b, c in zip(cuts + [a], [0] + cuts)]
    return sizes[:1] + [0] + sizes[1:]


def _terms(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """sum_k |x_k w_k| per output, [offs[-1], N] fp32 (the GEMM's terms' magnitude)."""
    return qgemm.grouped_mm(x.abs().float(), w.abs().float(), offs)[: int(offs[-1])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a, g, k, n", SHAPES)
def test_grouped_mm(a, g, k, n, dtype):
    gen = _gen(a * k + g)
    x = torch.randn(a, k, generator=gen).to(dtype)
    w = (torch.randn(g, n, k, generator=gen) * k ** -0.5).to(dtype)
    offs = _offs(_counts(a, g, gen))
    ops = FakeTorchNpu(A2)
    got = npu.npu_kernels(ops).grouped_mm(x, w, offs)
    ref = qgemm.grouped_mm(x, w, offs)
    assert ops.calls["npu_grouped_matmul"] == 1
    assert got.dtype == dtype and got.shape == (a, n)
    assert max_ulps(got, ref, _terms(x, w, offs)) <= BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mm_under_expert_parallelism(dtype):
    """offs[-1] < A (the other rank's rows, NaN here): the doc wants group_list to end at
    A, so the last group computes them; the local rows are the reference's."""
    gen = _gen(7)
    a, g, k, n = 10, 4, 256, 128
    x = torch.randn(a, k, generator=gen).to(dtype)
    x[7:] = float("nan")  # past offs[-1] = 7: undefined rows
    w = (torch.randn(g, n, k, generator=gen) * k ** -0.5).to(dtype)
    offs = _offs([2, 0, 4, 1])
    ops = FakeTorchNpu(A3)
    got = npu.npu_kernels(ops).grouped_mm(x, w, offs)[:7]
    ref = qgemm.grouped_mm(x, w, offs)[:7]
    assert not got.isnan().any()
    assert max_ulps(got, ref, _terms(x, w, offs)) <= BOUND[dtype]
    assert npu_gemm.group_list(offs, a).tolist() == [2, 2, 6, 10]
    assert offs.tolist() == [2, 2, 6, 7]  # the caller's offs are not touched


def _stack(fmt: str, g: int, n: int, k: int, fp32_scale: bool, gen: torch.Generator):
    """g experts' weights [g, n, k] quantized as the release stores them (bits)."""
    parts = [quantize(torch.randn(n, k, generator=gen) * k ** -0.5, fmt) for _ in range(g)]
    weight = torch.stack([as_bits(q) for q, _ in parts])
    scales = [s.float() if fp32_scale else s for _, s in parts]
    return weight, torch.stack([as_bits(s) for s in scales])


@pytest.mark.parametrize("fmt, fp32_scale", [("fp8", False), ("fp8", True), ("fp4", False)])
@pytest.mark.parametrize("a, g, k, n", [(6, 4, 64, 96), (5, 8, 256, 128), (6, 3, 4096, 2048)])
def test_quant_grouped_mm(fmt, fp32_scale, a, g, k, n):
    """The reference's dequantization of min(A, G) groups (those with rows, then padding
    groups: a=5 < g=8), then npu_grouped_matmul; bf16 activations as the model runs."""
    gen = _gen(a + g + k)
    x = torch.randn(a, k, generator=gen).bfloat16()
    weight, scale = _stack(fmt, g, n, k, fp32_scale, gen)
    fp4 = torch.tensor(FP4_VALUES)
    offs = _offs(_counts(a, g, gen))
    ops = FakeTorchNpu(A2)
    got = npu.npu_kernels(ops).quant_grouped_mm(x, weight, scale, fp4, offs, fmt, k)
    ref = qgemm.quant_grouped_mm(x, weight, scale, fp4, offs, fmt, k)
    w = qgemm.dequantize(fmt, weight, scale, n, k, fp4, torch.float32)
    assert ops.calls["npu_grouped_matmul"] == 1 and got.dtype == torch.bfloat16
    assert max_ulps(got, ref, _terms(x, w, offs)) <= BOUND[torch.bfloat16]


def test_outside_the_doc_is_the_reference():
    """No rows, more than 1024 groups, autograd (the op is for inference): the reference,
    torch_npu never called."""
    gen = _gen(3)
    ops = FakeTorchNpu(A2)
    x = torch.randn(4, 32, generator=gen)
    w = torch.randn(2, 16, 32, generator=gen)
    offs = _offs([1, 3])
    assert npu_gemm.grouped_mm(ops, x[:0], w, offs.new_zeros(2)).shape == (0, 16)
    many = torch.randn(1025, 16, 32, generator=gen)
    npu_gemm.grouped_mm(ops, x, many, _offs([1] * 4 + [0] * 1021))
    leaf = w.clone().requires_grad_()
    with torch.enable_grad():  # (the suite runs under no_grad)
        npu_gemm.grouped_mm(ops, x, leaf, offs).sum().backward()
    assert leaf.grad is not None and ops.calls["npu_grouped_matmul"] == 0


@pytest.mark.parametrize("soc, mapped", [(A2, True), (A3, True), (ASCEND950, False)])
def test_set_maps_the_gemms_where_the_doc_lists_the_product(soc, mapped):
    """npu_grouped_matmul lists Atlas A2, A3 (and Atlas inference, fp16 only); never the
    quantized linears; the sparse path stays None (not mapped: docs/kernels_npu.md)."""
    kern = npu.npu_kernels(FakeTorchNpu(soc))
    for f in ("grouped_mm", "quant_grouped_mm"):
        assert (getattr(kern, f) is not getattr(REFERENCE, f)) == mapped
    assert kern.quant_linear is REFERENCE.quant_linear and kern.quant_bmm is REFERENCE.quant_bmm
    assert not kern.sparse and kern.index_scores is None and kern.compress_pool is None


def test_fake_grouped_matmul_follows_its_doc():
    """Cumsum vs sizes group lists, and the doc's constraint that the list ends at M."""
    ops = FakeTorchNpu(A2)
    x = torch.arange(3.0).unsqueeze(1)  # [3, 1]: row r holds r
    w = torch.tensor([[[1.0]], [[10.0]]])  # [g=2, K=1, N=1]
    cum = ops.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 3]), split_item=3,
                                 group_type=0, group_list_type=0)[0]
    sizes = ops.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 2]), split_item=3,
                                   group_type=0, group_list_type=1)[0]
    assert cum.flatten().tolist() == sizes.flatten().tolist() == [0.0, 10.0, 20.0]
    with pytest.raises(RuntimeError, match="end at"):
        ops.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 2]), split_item=3,
                               group_type=0, group_list_type=0)
