"""The npu adapter against the fake ``torch.npu`` namespace, the torchair backend
through real Dynamo with stand-ins for torchair, the lazy torch_npu import, and (on a
GPU only) the cuda backend.

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
from types import SimpleNamespace

import pytest
import torch

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.errors import ConfigError
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.graph.backends import make_backend
from nextn_graph.graph.emulator import CaptureError
from nextn_graph.graph.compile import torchair_backend
from nextn_graph.graph.npu import NpuBackend
from nextn_graph.graph.updates import UpdateContext, UpdateRegistry
from nextn_graph.runtime.engine import SpecEngine

from helpers import (IFA_OP, PA_OP, SEQLEN_OP, ifa_inputs, ifa_standin, npu_registry,
                     pa_inputs, pa_standin)
from fake_npu import make_fake_npu

SPEC = SpeculativeConfig(num_steps=3, num_draft_tokens=4)
POOL = PoolConfig(4, 128)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 30)), [40, 41, 42]]  # 3 requests > bucket 2
MAX_NEW = 12
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
# The fake's torch_npu versions (only messages read them; the API is what is checked).
NEW_NPU, OLD_NPU = "2.5.1.post1", "2.1.0.post8"




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

@pytest.mark.parametrize("round_mode,kinds", [
    ("split", ("rollout", "target_verify", "draft_extend")), ("fused", ("round",))])
def test_npu_backend_engine_equals_eager_and_reference(trained, expected, round_mode, kinds):
    """The NPU adapter engine (fake namespace) replays graphs and equals eager and the
    oracle, with split rounds and with the fused round (one NPU graph per bucket; overlap
    resolves off on NPU graphs)."""
    reg = UpdateRegistry()
    backend = NpuBackend(reg, namespace=make_fake_npu(), version=NEW_NPU)
    engine = SpecEngine(trained.target, trained.draft, SPEC, POOL,
                        GraphConfig(backend="npu", buckets=(1, 2), round=round_mode),
                        backend=backend, updates=reg)
    assert not engine.rounds.overlap
    assert {(r.name, r.bucket) for r in engine.runner.records} == {
        (k + v, b) for k in kinds for v in ("", "+sampling") for b in (1, 2)}
    res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set())
    assert res.outputs == expected.outputs
    st = res.stats
    assert st["backend"] == "npu" and st["graph_replays"] > 0 and st["bucket_splits"] > 0
    assert st["eager_fallbacks"] == 0 and st["graph_updates"] == 0  # the model has no host lens
    assert st["accepted_drafts"] == expected.stats["accepted_drafts"]
    fake_replays = sum(g.graph.replays for g in engine.runner.graphs.values())
    assert fake_replays == st["graph_replays"]


# -- 2. updates derived from what was captured, in the forms torch_npu applies --------

def _capture_both(backend, lens: torch.Tensor, ran: list | None = None):
    """A graph of fused infer attention into ``attn`` and paged attention into ``out``."""
    ifa, pa = ifa_standin(), pa_standin()
    q, k, v = ifa_inputs()
    query, key_cache, value_cache, table, out = pa_inputs()
    attn = torch.zeros(2, 1, 4)

    def fn():
        if ran is not None:
            ran.append(backend.is_capturing())
        attn.copy_(ifa(q, k, v, actual_seq_lengths_kv=[1, 1])[0])
        pa(query, key_cache, value_cache, 1, 1, 0.5, table, lens, out)

    return backend.capture(fn, backend.new_pool()), attn, out


def test_npu_updates_are_derived_from_the_captured_records():
    """Rules in the forms torch_npu applies pass the capture check; the dicts derived from
    the records reach both kernels (IFA's kwarg by name, paged attention's slot 7)."""
    reg = npu_registry()
    backend = NpuBackend(reg, namespace=make_fake_npu(), version=NEW_NPU)
    ran = []
    graph, attn, out = _capture_both(backend, torch.tensor([1, 1], dtype=torch.int32), ran)
    assert ran == [True] and not backend.is_capturing()
    assert graph.update_ops == [f"{IFA_OP}.default", f"{PA_OP}.default"]
    ctx = UpdateContext(bucket=2, width=4, rows=(2, 1), lengths=(5, 3))
    update = reg.derive(graph.update_ops, ctx)
    assert update[0] == {"actual_seq_lengths_kv": [5, 3]}
    assert update[1]["context_lens"].tolist() == [5, 3]
    graph.replay(update)
    assert graph.graph.update_calls == 1 and graph.graph.replays == 1
    q, k, v = ifa_inputs()
    assert torch.equal(attn, ifa_standin()(q, k, v, actual_seq_lengths_kv=[5, 3])[0])
    query, key_cache, value_cache, table, want = pa_inputs()
    pa_standin()(query, key_cache, value_cache, 1, 1, 0.5, table, update[1]["context_lens"], want)
    assert torch.equal(out, want)
    for bad in (None, update[:1]):
        with pytest.raises(CaptureError, match="needs 2 update dict"):
            graph.replay(bad)
    assert graph.graph.update_calls == 1 and graph.graph.replays == 1


def test_npu_capture_fails_for_recorded_op_without_rule():
    """An op torch_npu records, with no rule registered, fails at capture, naming the op."""
    backend = NpuBackend(UpdateRegistry(), namespace=make_fake_npu(), version=NEW_NPU)
    with pytest.raises(CaptureError, match=f"{IFA_OP}.default.*no update rule"):
        _capture_both(backend, torch.tensor([1, 1], dtype=torch.int32))


# A rule per case that torch_npu would not apply; "before": refused before the capture runs.
IGNORED_RULES = [
    (IFA_OP, ("kwarg", "actual_seq_lengths_kv", "kv_lens"), "'kv_lens'.*its own name", True),
    (IFA_OP, ("arg", 6, "kv_lens"), r"'kv_lens'.*\(6, 'actual_seq_lengths_kv'\)", True),
    (PA_OP, ("arg", 7, "seq_lens"), r"'seq_lens'.*\(7, 'context_lens'\)", True),
    (PA_OP, ("arg", 8, "context_lens"), r"\('arg', 8, 'context_lens'\) would be ignored", True),
    (SEQLEN_OP, ("arg", 1, "lens"), f"{SEQLEN_OP}.*never record", True),
    (f"{IFA_OP}.default", ("kwarg", "actual_seq_lengths_kv", "actual_seq_lengths_kv"),
     f"as {IFA_OP}.out", True),
    (IFA_OP, ("kwarg", "actual_seq_lengths", "actual_seq_lengths"),
     "'actual_seq_lengths'.*holds no kwarg", False),
    (IFA_OP, ("arg", 6, "actual_seq_lengths_kv"), r"args\[6\].*3 positional", False),
    (PA_OP, ("kwarg", "context_lens", "context_lens"), "'context_lens'.*holds no kwarg", False),
]


@pytest.mark.parametrize("op_name, spec, match, before", IGNORED_RULES)
def test_npu_capture_refuses_a_rule_torch_npu_would_ignore(op_name, spec, match, before):
    """A rule whose key torch_npu would skip (wrong name, wrong slot, a kwarg the call
    lacks, an op it never records) is refused at capture, naming the op and the key."""
    reg = npu_registry()
    reg.ops.pop(op_name.split(".")[0], None)
    reg.register(op_name, [spec], lambda ctx: {spec[2]: list(ctx.lengths)})
    backend = NpuBackend(reg, namespace=make_fake_npu(), version=NEW_NPU)
    ran = []
    with pytest.raises(CaptureError, match=match):
        _capture_both(backend, torch.tensor([1, 1], dtype=torch.int32), ran)
    assert ran == ([] if before else [True])


def test_derive_refuses_a_rule_returning_a_key_it_does_not_declare():
    """A rule's dict may hold only its spec's keys: any other would be dropped unseen."""
    reg = UpdateRegistry()
    reg.register(IFA_OP, [("kwarg", "actual_seq_lengths_kv", "actual_seq_lengths_kv")],
                 lambda ctx: {"actual_seq_lengths_kv": list(ctx.lengths), "kv_lens": [0]})
    ctx = UpdateContext(bucket=1, width=4, rows=(1,), lengths=(7,))
    with pytest.raises(CaptureError, match=f"{IFA_OP}.default.*'kv_lens'"):
        reg.derive([f"{IFA_OP}.default"], ctx)


# -- 3. torch_npu without the graph update API ------------------------------------------

def test_npu_backend_refuses_a_torch_npu_without_the_update_api():
    """A torch_npu whose torch.npu.graph takes no auto_dispatch_capture (before 7.1.0) is
    refused at start-up with a ConfigError naming the installed version and the need."""
    need = r"auto_dispatch_capture=True\).*7\.1\.0.*installed torch_npu 2\.1\.0\.post8 lacks"
    with pytest.raises(ConfigError, match=need):
        NpuBackend(namespace=make_fake_npu(update_api=False), version=OLD_NPU)
    with pytest.raises(ConfigError, match=need):
        make_backend("npu", namespace=make_fake_npu(update_api=False), version=OLD_NPU)
    backend = make_backend("npu", npu_registry(), namespace=make_fake_npu(), version=NEW_NPU)
    graph, _, _ = _capture_both(backend, torch.tensor([1, 1], dtype=torch.int32))
    assert len(graph.update_ops) == 2


# -- 4. torchair: the compile backend with torchair's compiler -------------------------

class _FakeTorchair:
    """What the torchair backend uses of torchair: ``CompilerConfig`` (its ``mode``) and
    ``get_npu_backend``, whose Dynamo backend is aot_eager here: real torch.compile, no NPU."""

    class CompilerConfig:
        def __init__(self):
            self.mode = "max-autotune"
            # torchair's default: copy every graph input on each replay
            self.debug = SimpleNamespace(aclgraph=SimpleNamespace(clone_input=True))

    def __init__(self):
        self.configs = []

    def get_npu_backend(self, compiler_config):
        self.configs.append(compiler_config)
        return torch._dynamo.lookup_backend("aot_eager")


def _npu_namespace() -> SimpleNamespace:
    """The torch.npu calls the compile backend makes (sync, capture state, memory)."""
    return SimpleNamespace(synchronize=lambda: None, is_current_stream_capturing=lambda: False,
                           empty_cache=lambda: None, memory_reserved=lambda: 0)


def _registered(*names):
    """A Dynamo backend lookup where ``names`` are registered (as aot_eager)."""
    return lambda name: torch._dynamo.lookup_backend("aot_eager") if name in names else None


def test_torchair_compiler_follows_what_torch_npu_offers():
    """auto is npugraph_ex where torch_npu registers it, else torchair's reduce-overhead
    mode; npugraph_ex without it, or a non-Ascend compile_backend, is a ConfigError."""
    fake = _FakeTorchair()
    kw = dict(namespace=_npu_namespace(), torchair=fake)
    ex = torchair_backend("auto", lookup=_registered("npugraph_ex"), **kw).compiler
    assert ex.label == "npugraph_ex" and ex.backend.keywords == {"options": {"clone_input": False}}
    assert fake.configs == []  # npugraph_ex is a registered backend: no torchair config
    for choice in ("auto", "reduce-overhead"):
        backend = torchair_backend(choice, lookup=_registered(), **kw)
        assert backend.name == "torchair" and backend.compiler.label == "torchair reduce-overhead"
        assert fake.configs[-1].mode == "reduce-overhead"
        assert fake.configs[-1].debug.aclgraph.clone_input is False  # inputs are static
    with pytest.raises(ConfigError, match="registers no 'npugraph_ex'.*reduce-overhead"):
        torchair_backend("npugraph_ex", lookup=_registered(), **kw)
    for bad in ("inductor", "aot_eager"):
        with pytest.raises(ConfigError, match=f"compile_backend {bad!r} is not one of"):
            make_backend("torchair", compile_backend=bad, lookup=_registered(), **kw)


@pytest.mark.compile
def test_torchair_engine_through_dynamo_equals_reference(trained):
    """A torchair engine compiles every graph through real Dynamo (its npugraph_ex stands
    in as aot_eager) and equals the oracle; each graph is replayed."""
    backend = make_backend("torchair", compile_backend="npugraph_ex", namespace=_npu_namespace(),
                           torchair=_FakeTorchair(), lookup=_registered("npugraph_ex"))
    spec = SpeculativeConfig(num_steps=1, num_draft_tokens=2)  # 2 kinds: 2 graphs, fast
    engine = SpecEngine(trained.target, trained.draft, spec, POOL,
                        GraphConfig(backend="torchair", buckets=(2,), round="split",
                                    sampling=False),  # (sampling compiles: test_compile_backend)
                        backend=backend)
    assert backend.captured == 2 and len(engine.runner.graphs) == 2
    res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set())
    ref = reference_generate(trained.target, PROMPTS, MAX_NEW, stop_ids=set(),
                             max_context=POOL.max_context)
    assert res.outputs == ref.outputs and res.stats["backend"] == "torchair"
    assert res.stats["eager_fallbacks"] == 0
    assert all(g.replays > 0 for g in engine.runner.graphs.values())


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


@pytest.mark.process
def test_importing_the_package_never_imports_torch_npu(tmp_path):
    """Importing the package never imports torch_npu; only choosing the npu backend does."""
    poison = tmp_path / "torch_npu"
    poison.mkdir()
    (poison / "__init__.py").write_text(
        "print('<torch_npu imported>', flush=True)\n"
        "raise ImportError('poisoned torch_npu')\n")
    code = textwrap.dedent("""
        import nextn_graph, nextn_graph.graph, nextn_graph.graph.backends
        import nextn_graph.graph.npu, nextn_graph.runtime.engine
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
