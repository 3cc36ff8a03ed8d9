"""Sparse MoE over stacked expert weights, and GEMMs on quantized weights (issue 19).

The routed sum equals the dense formula (every expert on every row, weighted by a
[T, E] routing matrix); the work follows the experts that have rows; quantized
stacks give bitwise the GEMM of the dequantized weights; everything captures."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nextn_graph.checkpoint import random_models
from nextn_graph.profile.counting import OpCounter
from nextn_graph.graph.emulator import CpuGraph
from nextn_graph.model import config_from_dict
from nextn_graph.model.moe import MoE
from nextn_graph.kernels.qgemm import dequantize, grouped_dequant_mm, grouped_mm
from nextn_graph.model.quant import FP4_VALUES, quantize
from nextn_graph.parallel.group import TPGroup
from nextn_graph.checkpoint.presets import TINY, preset_config

FP4_TABLE = torch.tensor(FP4_VALUES)

def dense_moe(moe: MoE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The pre-issue-19 formula: every local expert on every row, a [T, E] route."""
    chosen, weights = moe.gate(x, ids)
    route = torch.zeros(x.shape[0], len(moe.experts)).scatter(1, chosen, weights)
    routed = sum(route[:, e:e + 1] * moe.experts[e](x).float() for e in moe.local)
    return routed

def moe_of(cfg, hashed: bool, seed: int = 0, tp: TPGroup | None = None) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(cfg, hashed, tp or TPGroup.single())
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) / 4)
        if hashed:
            ids = torch.stack([torch.randperm(cfg.n_routed_experts)[: cfg.num_experts_per_tok]
                               for _ in range(cfg.vocab_size)])
            moe.gate.tid2eid.copy_(ids)
    return moe.eval()

@pytest.mark.parametrize("hashed", [False, True])
@torch.no_grad()
def test_sparse_routed_sum_equals_the_dense_formula(hashed):
    cfg = preset_config("tiny")
    moe = moe_of(cfg, hashed)
    x, ids = torch.randn(13, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (13,))
    chosen, weights = moe.gate(x, ids)
    got = moe._routed(x, chosen, weights)
    torch.testing.assert_close(got, dense_moe(moe, x, ids), rtol=1e-5, atol=1e-6)

@torch.no_grad()
def test_expert_parallel_ranks_sum_to_the_whole():
    """Each rank's experts (others' assignments add zero) sum to tp = 1's routed output."""
    cfg = config_from_dict({**TINY, "n_routed_experts": 8}, "test")
    whole = moe_of(cfg, hashed=False)
    x, ids = torch.randn(9, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (9,))
    chosen, weights = whole.gate(x, ids)
    parts = []
    for rank in range(4):
        tp = TPGroup(rank=rank, size=4, group=object())  # no collective is called
        part = MoE(cfg, False, tp)
        state = {k: v for k, v in whole.state_dict().items()
                 if ".experts." not in k or int(k.split(".")[1]) in part.local}
        part.load_state_dict(state)
        parts.append(part.eval()._routed(x, chosen, weights))
    torch.testing.assert_close(sum(parts), whole._routed(x, chosen, weights),
                               rtol=1e-5, atol=1e-6)

@torch.no_grad()
def test_kernels_do_not_grow_with_the_number_of_experts():
    """One MoE forward launches the same ops at 8 and at 64 routed experts (top-k 2)."""
    counts = []
    for n in (8, 64):
        cfg = config_from_dict({**TINY, "n_routed_experts": n}, "test")
        moe = moe_of(cfg, hashed=False)
        x, ids = torch.randn(8, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (8,))
        with OpCounter() as c:
            moe(x, ids)
        counts.append(c.launches)
    assert counts[0] == counts[1] < 60, counts

@torch.no_grad()
def test_moe_captures_and_replays_bitwise():
    cfg = preset_config("tiny")
    moe = moe_of(cfg, hashed=False)
    x, ids = torch.randn(8, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (8,))
    graph = CpuGraph()
    out = graph.capture(lambda: moe(x, ids))
    x.copy_(torch.randn_like(x))
    ids.copy_(torch.randint(0, cfg.vocab_size, (8,)))
    graph.replay()
    assert torch.equal(out, moe(x, ids))

@torch.no_grad()
def test_stacks_survive_to_and_load_state_dict():
    """``.to(dtype)`` re-stacks; each expert's tensor stays a view of its stack, so a
    load_state_dict writes where the grouped GEMM reads."""
    cfg = preset_config("tiny")
    moe = moe_of(cfg, hashed=False).to(torch.bfloat16)
    stack = moe.stacks["w2"].weight
    assert stack.dtype == torch.bfloat16 and stack.shape == (4, cfg.hidden_size, 64)
    for e in moe.local:
        assert moe.experts[e].w2.weight.data_ptr() == stack[e].data_ptr()
    state = moe.state_dict()
    state["experts.3.w2.weight"] = torch.full_like(state["experts.3.w2.weight"], 0.5)
    moe.load_state_dict(state)
    assert bool((moe.stacks["w2"].weight[3] == 0.5).all())

def test_training_reaches_the_experts():
    """With grad enabled the stack is rebuilt differentiably: every routed expert with
    rows gets a gradient."""
    cfg = preset_config("tiny")
    moe = moe_of(cfg, hashed=False).train()
    x, ids = torch.randn(32, cfg.hidden_size), torch.randint(0, cfg.vocab_size, (32,))
    with torch.enable_grad():  # the suite runs under no_grad (conftest)
        moe(x, ids).square().sum().backward()
    assert all(moe.experts[e].w1.weight.grad is not None for e in moe.local)
    assert sum(float(moe.experts[e].w2.weight.grad.abs().sum()) for e in moe.local) > 0

def _quantized_stack(fmt: str, groups: int, out: int, inp: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    bits, scales = [], []
    for _ in range(groups):
        w, s = quantize(torch.randn(out, inp, generator=gen), fmt)
        bits.append(w.view(torch.uint8))
        scales.append(s.view(torch.uint8))
    return torch.stack(bits), torch.stack(scales)

@pytest.mark.parametrize("fmt,static", [("fp4", False), ("fp4", True), ("fp8", False),
                                        ("fp8", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_grouped_mm_is_the_dequantized_gemm_bitwise(fmt, static, dtype):
    """Only groups with rows (some empty, one past the rows) -- host or static selection
    -- give exactly the grouped GEMM of the whole dequantized stack."""
    out, inp = 64, 256
    weight, scale = _quantized_stack(fmt, 6, out, inp, seed=1)
    x = torch.randn(10, inp).to(dtype)
    offs = torch.tensor([0, 3, 3, 7, 10, 10], dtype=torch.int32)
    got = grouped_dequant_mm(x, weight, scale, FP4_TABLE, offs, fmt, inp, static=static)
    full = dequantize(fmt, weight, scale, out, inp, FP4_TABLE, dtype)
    assert torch.equal(got, grouped_mm(x, full, offs))

def test_dequantize_makes_no_int64_temporaries():
    weight, scale = _quantized_stack("fp4", 2, 64, 128, seed=2)
    seen = []

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.extend(t.dtype for t in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(t, torch.Tensor))
            return out

    with Dtypes():
        dequantize("fp4", weight, scale, 64, 128, FP4_TABLE, torch.bfloat16)
    assert seen and torch.int64 not in seen, seen

def test_quantized_model_runs_one_kernel_per_linear(tmp_path):
    """A QuantLinear forward is one ``quant_linear`` op; routed experts are three
    ``quant_grouped_mm`` ops per MoE whatever the number of experts."""
    from nextn_graph.checkpoint import save_checkpoint
    from nextn_graph.checkpoint.loader import load_checkpoint
    root = save_checkpoint(random_models(preset_config("tiny"), 0), tmp_path / "q",
                           quantize="fp8")
    q = load_checkpoint(root)
    with OpCounter() as c, torch.no_grad():
        q.target.layers[1].ffn(torch.randn(4, 64), torch.arange(4))
    assert c.ops["nextn_graph.quant_grouped_mm"] == 3
    assert c.ops["nextn_graph.quant_linear"] == 3  # the shared expert's w1, w3, w2


@pytest.mark.parametrize("fmt,rows", [("fp8", 128), ("fp8", 32), ("fp4", 32)])
def test_grouped_linear_on_stored_bits_is_the_float_bmm_bitwise(fmt, rows):
    """Attention's block-diagonal ``wo_a``: on the stored bits (one quant_bmm) or, where
    FP8 scale blocks straddle groups (32 rows a group), on the whole dequantized weight:
    bitwise the bmm of the dequantized model."""
    from torch import nn
    from nextn_graph.model.quant import QuantLinear, grouped_linear
    g, inp = 4, 256
    w = torch.randn(g * rows, inp)
    bits, scale = quantize(w, fmt)
    q = QuantLinear(inp, g * rows, fmt, fp32_scale=False)
    q.weight.copy_(bits.view(torch.uint8))
    q.scale.copy_(scale.view(torch.uint8))
    plain = nn.Linear(inp, g * rows, bias=False)
    plain.weight.data = q.dequantized(torch.float32)
    x = torch.randn(g, 5, inp)
    with OpCounter() as c:
        got = grouped_linear(q, x)
    assert torch.equal(got, grouped_linear(plain, x))
    assert (c.ops["nextn_graph.quant_bmm"] == 1) == (fmt == "fp4" or rows % 128 == 0)
