"""The npu and torchair adapters against the fake ``torch.npu`` namespace, the lazy
torch_npu import, and (on a GPU only) the cuda backend.

The fake namespace (``fake_npu.make_fake_npu``) backs ``NPUGraph`` with the strict
CPU emulator, so the adapters' capture / update / replay protocol runs here as it
would on Ascend. Engine outputs are compared token for token with the eager
engine and the no-cache oracle on the shipped trained checkpoint, whose draft
really predicts the target (multi-token acceptance).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.errors import ConfigError
from nextn_graph.generate import reference_generate
from nextn_graph.graph.backends import make_backend
from nextn_graph.graph.emulator import CaptureError
from nextn_graph.graph.fake_npu import make_fake_npu
from nextn_graph.graph.npu import NpuBackend, TorchairBackend
from nextn_graph.graph.updates import UpdateContext, UpdateRegistry
from nextn_graph.runtime.engine import SpecEngine

from helpers import SEQLEN_OP, seqlen_op, seqlen_registry

OP_NAME = SEQLEN_OP
SPEC = SpeculativeConfig(num_steps=3, num_draft_tokens=4)
POOL = PoolConfig(4, 128)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 30)), [40, 41, 42]]  # 3 requests > bucket 2
MAX_NEW = 12
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None




@pytest.fixture(scope="module")
def expected(trained):
    """The eager engine's result and the oracle's outputs for PROMPTS."""
    with torch.no_grad():
        eager = SpecEngine(trained.target, trained.draft, SPEC, POOL).generate(
            PROMPTS, MAX_NEW, stop_ids=set())
        ref = reference_generate(trained.target, PROMPTS, MAX_NEW, stop_ids=set(),
                                 max_context=POOL.max_context)
    assert eager.outputs == ref.outputs
    assert eager.stats["accepted_drafts"] > 0  # the trained draft really gets accepted
    return eager


# -- 1. NPUGraph adapter drives the engine --------------------------------------------

def test_npu_backend_engine_equals_eager_and_reference(trained, expected):
    """The NPU adapter engine (fake namespace) replays graphs and equals eager and the oracle."""
    reg = UpdateRegistry()
    backend = NpuBackend(reg, namespace=make_fake_npu(reg))
    engine = SpecEngine(trained.target, trained.draft, SPEC, POOL,
                        GraphConfig(backend="npu", buckets=(1, 2)), backend=backend, updates=reg)
    assert {(r.kind, r.bucket) for r in engine.runner.records} == {
        (k, b) for k in ("rollout", "target_verify", "draft_extend") for b in (1, 2)}
    res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set())
    assert res.outputs == expected.outputs
    st = res.stats
    assert st["backend"] == "npu" and st["graph_replays"] > 0 and st["bucket_splits"] > 0
    assert st["eager_fallbacks"] == 0 and st["graph_updates"] == 0  # the model has no host lens
    assert st["accepted_drafts"] == expected.stats["accepted_drafts"]
    fake_replays = sum(g.graph.replays for g in engine.runner.graphs.values())
    assert fake_replays == st["graph_replays"]


# -- 2. updates derived from what was captured ---------------------------------------

def test_npu_updates_are_derived_from_the_captured_records():
    """NPU update dicts are derived from the captured records and applied by replay(update)."""
    op = seqlen_op()
    reg = seqlen_registry()
    fake = make_fake_npu(reg)
    backend = NpuBackend(reg, namespace=fake)
    x, out, seen = torch.tensor([1.0, 2.0]), {}, []

    def fn():
        seen.append(backend.is_capturing())
        out["y"] = op(op(x, [1]), [1])

    graph = backend.capture(fn, backend.new_pool())
    assert seen == [True] and not backend.is_capturing()
    assert graph.update_ops == [f"{OP_NAME}.default"] * 2
    ctx = UpdateContext(bucket=2, width=4, rows=(2, 1), lengths=(5, 3))
    update = reg.derive(graph.update_ops, ctx)
    assert update == [{"lens": [5, 3]}, {"lens": [5, 3]}]
    graph.replay(update)
    assert graph.graph.update_calls == 1 and graph.graph.replays == 1
    assert out["y"].tolist() == [64.0, 128.0]
    for bad in (None, update[:1]):
        with pytest.raises(CaptureError, match="needs 2 update dict"):
            graph.replay(bad)
    assert graph.graph.update_calls == 1 and graph.graph.replays == 1


def test_npu_capture_fails_for_recorded_op_without_rule():
    """An updatable op recorded without a registered rule fails at capture, naming the op."""
    op = seqlen_op()
    fake = make_fake_npu(seqlen_registry())  # the graph records the op ...
    backend = NpuBackend(UpdateRegistry(), namespace=fake)  # ... we hold no rule for it
    x = torch.ones(2)
    with pytest.raises(CaptureError, match=f"{OP_NAME}.*no update rule"):
        backend.capture(lambda: op(x, [2]), backend.new_pool())


# -- 3. the fake mirrors torch_npu's refusal ------------------------------------------

def test_fake_npugraph_update_needs_auto_dispatch_capture():
    """The fake NPUGraph.update raises RuntimeError unless captured with auto_dispatch_capture."""
    op = seqlen_op()
    fake = make_fake_npu(seqlen_registry())
    x = torch.ones(2)
    plain = fake.NPUGraph()
    with fake.graph(plain, pool=fake.graph_pool_handle()):
        op(x, [1])
    assert plain.graph_dispatch_mode.graph_dispatch_records == []
    with pytest.raises(RuntimeError, match="auto_dispatch_capture=True"):
        plain.update(cpu_update_input=[{"lens": [2]}])
    assert plain.update_calls == 0
    auto = fake.NPUGraph()
    with fake.graph(auto, pool=fake.graph_pool_handle(), auto_dispatch_capture=True):
        op(x, [1])
    assert len(auto.graph_dispatch_mode.graph_dispatch_records) == 1
    auto.update(cpu_update_input=[{"lens": [2]}])
    assert auto.update_calls == 1


# -- 4. torchair: compile per graph, capture limit ------------------------------------

def test_torchair_captures_by_calling_and_enforces_limit():
    """torchair captures by compiling + calling, replays by calling, refuses past its limit."""
    compiled = []
    backend = TorchairBackend(compile_fn=lambda f: compiled.append(f) or f, capture_limit=3)
    counter = torch.zeros((), dtype=torch.int64)
    graphs = [backend.capture(lambda: counter.add_(1), None) for _ in range(3)]
    assert len(compiled) == 3 and backend.captured == 3 and int(counter) == 3
    graphs[0].replay()
    assert int(counter) == 4
    with pytest.raises(CaptureError, match="limit 3"):
        backend.capture(lambda: counter.add_(1), None)
    assert len(compiled) == 3 and int(counter) == 4  # the refused capture ran nothing


def test_torchair_engine_equals_eager(trained, expected):
    """A torchair engine (6 graphs, limit 64) equals eager; limit 5 refuses it at start-up."""
    backend = TorchairBackend(compile_fn=lambda f: f, capture_limit=64)
    graph_cfg = GraphConfig(backend="torchair", buckets=(1, 2))
    engine = SpecEngine(trained.target, trained.draft, SPEC, POOL, graph_cfg, backend=backend)
    assert backend.captured == 6 and len(engine.runner.graphs) == 6
    res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set())
    assert res.outputs == expected.outputs and res.stats["graph_replays"] > 0
    with pytest.raises(CaptureError, match="limit 5"):
        SpecEngine(trained.target, trained.draft, SPEC, POOL, graph_cfg,
                   backend=TorchairBackend(compile_fn=lambda f: f, capture_limit=5))


# -- 5. torch_npu is imported lazily --------------------------------------------------

@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed: its absence cannot be tested")
def test_npu_backends_without_torch_npu_raise_config_error(trained):
    """Without torch_npu, choosing npu or torchair raises ConfigError naming torch_npu at
    once (not at the first capture), and an engine asking for either fails at start-up."""
    import nextn_graph.graph.backends  # noqa: F401
    import nextn_graph.graph.npu  # noqa: F401

    assert "torch_npu" not in sys.modules
    with pytest.raises(ConfigError, match="torch_npu"):
        make_backend("npu")
    with pytest.raises(ConfigError, match="torch_npu"):
        make_backend("torchair")
    with pytest.raises(ConfigError, match="torch_npu"):
        SpecEngine(trained.target, trained.draft, SPEC, POOL,
                   GraphConfig(backend="torchair", buckets=(1,)))
    assert "torch_npu" not in sys.modules


def test_importing_the_package_never_imports_torch_npu(tmp_path):
    """Importing the package never imports torch_npu; only choosing the npu backend does."""
    poison = tmp_path / "torch_npu"
    poison.mkdir()
    (poison / "__init__.py").write_text(
        "print('<torch_npu imported>', flush=True)\n"
        "raise ImportError('poisoned torch_npu')\n")
    code = textwrap.dedent("""
        import nextn_graph, nextn_graph.graph, nextn_graph.graph.backends
        import nextn_graph.graph.npu, nextn_graph.graph.fake_npu, nextn_graph.runtime.engine
        from nextn_graph.graph.backends import make_backend
        make_backend("cpu"), make_backend("eager")
        print("<modules imported>", flush=True)
        try:
            make_backend("npu")
        except Exception as exc:
            print(type(exc).__name__, exc, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(tmp_path), "PATH": ""})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["<modules imported>", "<torch_npu imported>"], proc.stdout
    assert lines[2].startswith("ConfigError") and "poisoned torch_npu" in lines[2], proc.stdout


# -- 6. cuda (GPU only) ---------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="cuda backend needs a CUDA GPU: torch.cuda.is_available() is False")
class TestCudaBackend:
    """The cuda backend on a real GPU (skipped on CPU-only machines)."""

    def test_cuda_graphs_equal_eager_and_reference(self, expected):
        """CUDA graphs (buckets 1, 2, 4) equal eager on cuda and the CPU oracle, same acceptance."""
        models = load_checkpoint("builtin:tiny-trained", device="cuda")
        eager = SpecEngine(models.target, models.draft, SPEC, POOL).generate(
            PROMPTS, MAX_NEW, stop_ids=set())
        engine = SpecEngine(models.target, models.draft, SPEC, POOL,
                            GraphConfig(backend="cuda", buckets=(1, 2, 4)))
        assert engine.device.type == "cuda" and engine.runner.backend.name == "cuda"
        assert len(engine.runner.graphs) == 9
        res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set())
        assert res.outputs == eager.outputs == expected.outputs  # expected: the CPU oracle's
        assert res.stats["graph_replays"] > 0 and res.stats["eager_fallbacks"] == 0
        assert res.stats["accepted_drafts"] == eager.stats["accepted_drafts"]
