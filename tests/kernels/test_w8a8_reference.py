"""The W8A8 references (``kernels/w8a8.py``) against independent int64 arithmetic, and the
modules that hold ModelSlim's tensors (``model/w8a8.py``, ``model/experts.py``)."""

from __future__ import annotations

import pytest
import torch

from nextn_graph.kernels import w8a8
from nextn_graph.model.experts import W8A8Stack, stack_projection
from nextn_graph.model.w8a8 import W8A8Linear, W8A8StaticLinear, deq_scale_values, float_bits


def _int8(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)


def _rows(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * 3).to(dtype)


def test_rows_quantize_as_dynamic_quant_does_round_half_even_and_zero_rows_give_zero():
    # amax 127 makes the multiplier exactly 1: x * m lands on halves
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, -0.5, 126.5], [0.0] * 6])
    q, s = w8a8.quantize_rows(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (2, 1)
    assert q[0].tolist() == [127, 2, 4, -2, 0, 126]
    assert q[1].tolist() == [0] * 6 and s[1].item() == 0.0
    assert s[0].item() == 1.0


def test_the_scale_is_the_reciprocal_of_the_fp32_multiplier():
    x = _rows(4, 33, seed=1)
    _, s = w8a8.quantize_rows(x)
    amax = x.abs().amax(-1, keepdim=True).double()
    m = (127.0 / amax).float()  # IEEE fp32 quotients (correctly rounded from fp64)
    assert torch.equal(s, (1.0 / m.double()).float())
    assert int(w8a8.quantize_rows(x * 1000)[0].abs().max()) == 127  # never -128


@pytest.mark.parametrize("m,k", [(1, 7), (5, 96), (3, 2500)])
def test_int_mm_is_exact_on_the_host_and_in_fp32_chunks(m, k):
    q, w = _int8(m, k, seed=2), _int8(11, k, seed=3)
    q[0] = 127
    w[0] = 127  # the largest products: a chunk's fp32 sum must still be exact
    want = (q.long() @ w.long().t()).to(torch.int32)
    assert torch.equal(w8a8.int_mm(q, w), want)
    assert torch.equal(w8a8.int_mm(q, w, chunked=True), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_the_epilogue_of_the_exact_int_product(dtype):
    x = _rows(6, 40, seed=4, dtype=dtype)
    x[3] = 0  # a padded row
    w, scale = _int8(24, 40, seed=5), torch.rand(24) + 0.01
    y = w8a8.w8a8_linear(x, w, scale, dtype)
    q, s = w8a8.quantize_rows(x)
    acc = (q.long() @ w.long().t()).float()  # exact: |acc| < 2**24
    assert y.dtype == dtype and torch.equal(y, (acc * scale * s).to(dtype))
    assert torch.equal(y[3], torch.zeros(24, dtype=dtype))
    # leading dims are rows
    assert torch.equal(w8a8.w8a8_linear(x.view(2, 3, 40), w, scale, dtype), y.view(2, 3, 24))


def test_grouped_gemm_equals_one_linear_per_group_on_both_paths():
    x = _rows(7, 50, seed=6)
    weight, scale = _int8(4, 9, 50, seed=7), torch.rand(4, 9) + 0.01
    offs = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # group 1 empty, row 6 past the end
    want = torch.cat([w8a8.w8a8_linear(x[0:2], weight[0], scale[0], torch.float32),
                      w8a8.w8a8_linear(x[2:5], weight[2], scale[2], torch.float32),
                      w8a8.w8a8_linear(x[5:6], weight[3], scale[3], torch.float32),
                      torch.zeros(1, 9)])
    for static in (False, True):
        got = w8a8.w8a8_grouped_reference(x, weight, scale, offs, torch.float32, static=static)
        assert torch.equal(got, want), static
    assert torch.equal(w8a8.w8a8_grouped_mm(x, weight, scale, offs, torch.float32), want)


def test_static_w8a8_adds_its_bias_before_the_fused_scale():
    x = _rows(3, 16, seed=8)
    w = _int8(5, 16, seed=9)
    bias = torch.arange(5, dtype=torch.int32) * 100 - 200
    in_scale, in_off = torch.tensor([0.05]), torch.tensor([3.0])
    deq = torch.rand(5) * 1e-3
    y = w8a8.w8a8_static_linear(x, w, deq, bias, in_scale, in_off, torch.float32)
    q = torch.round(x / in_scale + in_off).clamp(-128, 127).long()
    assert torch.equal(y, ((q @ w.long().t() + bias).float() * deq))


def test_deq_scale_stored_as_int64_bits_reads_back_as_fp32():
    values = torch.tensor([1e-3, 2.5e-4, 7.0])
    bits = values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the low word
    assert torch.equal(deq_scale_values(bits), values)
    assert torch.equal(deq_scale_values(values), values)


def test_modules_keep_scales_exact_through_a_dtype_cast():
    lin = W8A8Linear(8, 4)
    scale = torch.tensor([[0.1], [0.2], [0.3], [1e-7]])
    lin.weight_scale.copy_(float_bits(scale))
    lin = lin.to(torch.bfloat16)
    assert lin.weight.dtype == torch.int8 and torch.equal(lin.scale(), scale.view(-1))
    static = W8A8StaticLinear(8, 4).to(torch.float16)
    assert static.deq_scale.dtype == torch.int32 and static.quant_bias.dtype == torch.int32
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    assert torch.equal(lin(x), torch.zeros(2, 4, dtype=torch.bfloat16))


def test_experts_stack_into_one_w8a8_gemm_with_views_of_their_tensors():
    experts = [W8A8Linear(12, 6) for _ in range(3)]
    for i, m in enumerate(experts):
        m.weight.copy_(_int8(6, 12, seed=10 + i))
        m.weight_scale.copy_(float_bits(torch.rand(6, 1) + 0.1))
    stack = stack_projection(experts, "w1", torch.float32)
    assert isinstance(stack, W8A8Stack) and stack.weight.shape == (3, 6, 12)
    assert stack.weight.data_ptr() == experts[0].weight.data_ptr()  # views, not copies
    x, offs = _rows(4, 12, seed=13), torch.tensor([1, 3, 4], dtype=torch.int32)
    want = torch.cat([experts[0](x[:1]), experts[1](x[1:3]), experts[2](x[3:])])
    assert torch.equal(stack(x, offs, experts[0].kernels), want)
    down = stack_projection(experts, "w2", torch.bfloat16)
    assert down(x, offs, experts[0].kernels).dtype == torch.bfloat16


def test_weight_quantization_round_trips_within_half_a_step():
    w = _rows(10, 64, seed=14)
    w[4] = 0
    q, scale = w8a8.quantize_weight(w)
    assert q.dtype == torch.int8 and scale.shape == (10,) and scale[4].item() == 1.0
    assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all())
