"""The kernel set a model runs (``kernels: auto | reference | triton``) and the tiny trained
checkpoint on the Triton kernels under the interpreter.

With ``kernels: triton`` every fused op runs as its Triton kernel on CPU tensors
(``TRITON_INTERPRET=1``, set by the root conftest): a captured forward replays bitwise
what the same kernels computed eagerly, and speculative decoding equals the no-cache
reference (which runs the same kernels) token for token, in fp32, graphs on and off.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig, load_run_config
from nextn_graph.errors import ConfigError
from nextn_graph.graph.emulator import CpuGraph
from nextn_graph.kernels import (REFERENCE, TRITON, projected_kernels, select_kernels,
                                 triton_attn, triton_compress, triton_gemm, triton_indexer,
                                 triton_mhc, triton_moe, triton_norm)
from nextn_graph.kernels.registry import TRITON_OPS, has_device_kernel, launches
from nextn_graph.memory.batch import Chunk, ForwardBatch
from nextn_graph.memory.pool import PoolLayout
from nextn_graph.model.ops import kernels_of, use_kernels
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.generate import reference_generate

from fake_npu_ops import fake_torch_npu


# -- choosing a set ------------------------------------------------------------------------

def test_auto_is_the_reference_on_cpu_and_triton_is_refused_without_the_interpreter(
        monkeypatch):
    assert select_kernels("auto", "cpu") is REFERENCE
    assert select_kernels("reference", "cuda") is REFERENCE
    assert select_kernels("triton", "cpu") is TRITON  # TRITON_INTERPRET=1 (conftest)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        select_kernels("triton", "cpu")
    with pytest.raises(ConfigError, match="must be one of"):
        select_kernels("fast", "cpu")
    with pytest.raises(ConfigError, match="built for CUDA"):
        select_kernels("triton", "npu", npu_ops=fake_torch_npu())


def test_npu_auto_is_the_npu_set():
    kernels = select_kernels("auto", "npu", npu_ops=fake_torch_npu())
    assert kernels.name == "npu" and kernels.fused


def test_projected_sets_follow_the_device_spec():
    assert projected_kernels("auto", "cuda") is TRITON
    assert projected_kernels("auto", "npu") is REFERENCE
    assert projected_kernels("reference", "cuda") is REFERENCE
    with pytest.raises(ConfigError, match="built for CUDA"):
        projected_kernels("triton", "npu")


def test_yaml_kernels_is_checked():
    assert load_run_config(None).kernels == "auto"
    assert load_run_config(None, kernels="triton").kernels == "triton"
    with pytest.raises(ConfigError, match="'kernels' must be one of"):
        load_run_config(None, kernels="fastest")


def test_one_set_per_model(tiny):
    assert kernels_of(tiny.target) is REFERENCE
    with pytest.raises(ValueError, match="mixes"):
        tiny.target.layers[0].kernels = TRITON
        kernels_of(tiny.target)
    use_kernels(tiny.target, REFERENCE)
    assert kernels_of(tiny.target) is REFERENCE


def test_spec_engine_gives_both_models_the_set(tiny):
    pool = PoolConfig(max_requests=1, max_context=32)
    with pytest.raises(ConfigError, match="must be one of"):
        SpecEngine(tiny.target, tiny.draft, SpeculativeConfig(num_steps=2), pool,
                   kernels="fastest")
    assert kernels_of(tiny.target) is REFERENCE  # a refused setting changed nothing
    try:
        SpecEngine(tiny.target, tiny.draft, SpeculativeConfig(num_steps=2), pool,
                   kernels="triton")
        assert kernels_of(tiny.target) is TRITON and kernels_of(tiny.draft) is TRITON
    finally:
        use_kernels(tiny.target, REFERENCE)
        use_kernels(tiny.draft, REFERENCE)


# -- the tiny trained checkpoint on Triton kernels ------------------------------------------

@pytest.fixture(scope="module")
def fused():
    models = load_checkpoint("builtin:tiny-trained", kernels="triton")
    assert kernels_of(models.target) is TRITON and kernels_of(models.draft) is TRITON
    return models


# Short: under the interpreter a forward of the tiny model takes about 2 s.
PROMPTS = [[5, 17, 99, 3, 42, 7, 250, 11, 64], [8, 31, 200, 17, 5]]
NEW_TOKENS = 6


def _engine(models, graph: GraphConfig) -> SpecEngine:
    return SpecEngine(models.target, models.draft, SpeculativeConfig(num_steps=3),
                      PoolConfig(max_requests=2, max_context=64), graph)


@pytest.mark.compile
def test_triton_forward_replays_bitwise_and_differs_from_the_reference_within_rounding(fused):
    """A captured target forward on the Triton kernels replays exactly what the kernels
    compute eagerly; against the reference kernels the logits agree to fp32 rounding (the
    fused kernels sum in another order), so the fused set really ran."""
    target = fused.target
    layout = PoolLayout(2, 64, 4)
    pool_g, pool_e = target.new_pool(layout), target.new_pool(layout)
    rows = [pool_g.alloc(), pool_e.alloc()]
    prompt = ForwardBatch.from_chunks([Chunk(rows[0], 0, PROMPTS[0])])
    target(prompt, pool_g), target(prompt, pool_e)
    step = ForwardBatch.from_chunks([Chunk(rows[0], len(PROMPTS[0]), [21, 22])], pad_to=4)
    static = ForwardBatch.from_chunks([Chunk(0, 0, [0])], pad_to=4)  # row 0: padding
    graph = CpuGraph()
    out = graph.capture(lambda: target(static, pool_g))
    for name in ("input_ids", "positions", "req_index", "cache_start", "seq_end"):
        getattr(static, name).copy_(getattr(step, name))
    graph.replay()
    eager = target(step, pool_e)
    assert torch.equal(out.logits, eager.logits) and torch.equal(out.hidden, eager.hidden)
    use_kernels(target, REFERENCE)
    try:
        pool_r = target.new_pool(layout)
        row = pool_r.alloc()
        target(ForwardBatch.from_chunks([Chunk(row, 0, PROMPTS[0])]), pool_r)
        ref = target(ForwardBatch.from_chunks([Chunk(row, len(PROMPTS[0]), [21, 22])],
                                              pad_to=4), pool_r)
    finally:
        use_kernels(target, TRITON)
    scale = ref.logits[:2].abs().max()
    assert not torch.equal(ref.logits[:2], eager.logits[:2])
    torch.testing.assert_close(eager.logits[:2], ref.logits[:2], rtol=0, atol=1e-4 * scale)


@pytest.mark.compile
def test_triton_spec_equals_the_reference_token_for_token(fused):
    """Speculative decoding on the Triton kernels equals plain greedy decoding by full
    recompute on the same kernels, eagerly and on the emulator's graphs (one fused round
    per bucket); acceptance is the same both ways."""
    ref = reference_generate(fused.target, PROMPTS, NEW_TOKENS, stop_ids=set()).outputs
    eager = _engine(fused, GraphConfig(backend="eager")).generate(PROMPTS, NEW_TOKENS,
                                                                  stop_ids=[])
    graphs = _engine(fused, GraphConfig(backend="cpu", buckets=(2,), round="fused"))
    replayed = graphs.generate(PROMPTS, NEW_TOKENS, stop_ids=[])
    assert eager.outputs == ref and replayed.outputs == ref
    assert replayed.stats["graph_replays"] > 0 and replayed.stats["eager_fallbacks"] == 0
    assert eager.stats["accepted_drafts"] == replayed.stats["accepted_drafts"] > 0


# -- what the profile counts is what runs ---------------------------------------------------

class _Launches(TorchDispatchMode):
    """Each project op a forward calls, with the Triton kernels launched inside it (counted
    by the kernels' own pre-run hooks)."""

    def __init__(self):
        super().__init__()
        self.kernels = [k for module in (triton_mhc, triton_moe, triton_norm, triton_attn,
                                         triton_indexer, triton_compress, triton_gemm)
                        for k in vars(module).values()
                        if hasattr(k, "add_pre_run_hook") and not isinstance(k, type)]
        self.launched = 0
        self.per_op: dict[str, set[int]] = {}

    def _hook(self, *args, **kwargs):
        self.launched += 1

    def __enter__(self):
        for k in self.kernels:
            k.add_pre_run_hook(self._hook)
        return super().__enter__()

    def __exit__(self, *exc):
        for k in self.kernels:
            k.pre_run_hooks.remove(self._hook)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.launched
        out = func(*args, **(kwargs or {}))
        if func.namespace == "nextn_graph":
            self.per_op.setdefault(func.name().split(".")[0], set()).add(self.launched - before)
        return out


GEMMS = {f"nextn_graph::{n}" for n in ("fused_grouped_mm", "fused_quant_linear",
                                        "fused_quant_bmm", "fused_quant_grouped_mm")}


@pytest.mark.compile
def test_every_fused_op_launches_what_the_profile_counts(tiny):
    """A forward of the target and one of the draft on the Triton set call every fused op,
    and each call launches exactly the kernels ``registry.launches`` says (what the work
    profile counts), nothing else: every counted fused op is backed by Triton kernels."""
    use_kernels(tiny.target, TRITON)
    use_kernels(tiny.draft, TRITON)
    try:
        layout = PoolLayout(1, 32, 4)
        target_pool, draft_pool = tiny.target.new_pool(layout), tiny.draft.new_pool(layout)
        row = target_pool.alloc()
        assert draft_pool.alloc() == row
        batch = ForwardBatch.from_chunks([Chunk(row, 0, tiny.tokens(6, seed=3).tolist())])
        with _Launches() as mode:
            out = tiny.target(batch, target_pool)
            tiny.draft(batch, out.hidden, draft_pool)
    finally:
        use_kernels(tiny.target, REFERENCE)
        use_kernels(tiny.draft, REFERENCE)
    # every fused op but the GEMMs (quantized weights, or a device without torch's grouped
    # GEMM, call those: ``test_kernel_gemm.py``, ``test_kernel_quant_e2e.py``)
    assert set(TRITON_OPS) - GEMMS <= set(mode.per_op)
    for op, counts in mode.per_op.items():  # the others (grouped_mm) launch no Triton kernel
        assert counts == {launches(op) if op in TRITON_OPS else 0}, (op, counts)
    for op in TRITON_OPS:
        assert has_device_kernel(op, "cuda", torch.bfloat16)
        assert not has_device_kernel(op, "npu", torch.bfloat16)
