"""The ``compile`` graph backend: ``torch.compile`` per (kind, bucket) through real Dynamo.

Every capture here runs Dynamo for real, with the ``aot_eager`` backend (it traces and
functionalizes like inductor, without generating kernels): the ``recompile_limit`` that
made the ninth capture fail, the static-input marks, graph breaks, and the engine's
tokens against the no-cache oracle. The graph sets of the shipped configs (21 and 24
graphs, about 5 s of compile each on this CPU) are behind the ``slow`` marker.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.config import (PHASE_NAMES, GraphConfig, PoolConfig, SpeculativeConfig,
                                load_run_config)
from nextn_graph.errors import ConfigError
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.graph.backends import CudaBackend, make_backend
from nextn_graph.graph.compile import (CompileBackend, Compiler, dynamo_compiler,
                                       held_tensors)
from nextn_graph.graph.emulator import CaptureError
from nextn_graph.graph.kinds import GraphKey, Phase
from nextn_graph.runtime.engine import SpecEngine

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 30)), [40, 41, 42]]
MAX_NEW = 10


@dataclass(frozen=True)
class _Buffers:
    x: torch.Tensor
    out: torch.Tensor


class _Phases:
    """The runner's shape in miniature: static buffers, one ``run(kind, bucket)`` method."""

    def __init__(self):
        self.bufs = _Buffers(torch.arange(1.0, 9.0), torch.zeros(8))

    def run(self, kind: str, b: int) -> None:
        scale = {"rollout": 2.0, "target_verify": 3.0, "draft_extend": 5.0}[kind]
        self.bufs.out[:b].copy_(self.bufs.x[:b] * scale + b)


def _expected(kind: str, b: int, x: torch.Tensor) -> torch.Tensor:
    scale = {"rollout": 2.0, "target_verify": 3.0, "draft_extend": 5.0}[kind]
    return x[:b] * scale + b


# -- 1. the recompile limit ----------------------------------------------------------------

@pytest.mark.compile
def test_compiling_runner_partials_directly_fails_on_the_ninth():
    """The bug: torch.compile of partial(phases.run, kind, bucket) puts every graph on one
    shared code object, and with fullgraph the (recompile_limit + 1)-th capture raises."""
    limit = torch._dynamo.config.recompile_limit
    phases = _Phases()
    todo = [(k, b) for b in range(1, 9) for k in PHASE_NAMES][: limit + 1]
    compiled = [torch.compile(functools.partial(phases.run, k, b), backend="aot_eager",
                              fullgraph=True, dynamic=False) for k, b in todo]
    for fn in compiled[:limit]:
        fn()
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        compiled[limit]()


@pytest.mark.compile
def test_compile_backend_captures_past_the_recompile_limit_each_on_its_own_code():
    """recompile_limit + 4 captures of the same method succeed, each graph on its own code
    object with one cache entry, and every replay computes its own (kind, bucket)."""
    limit = torch._dynamo.config.recompile_limit
    phases = _Phases()
    backend = CompileBackend(dynamo_compiler("aot_eager"))
    todo = [(k, b) for b in range(8, 0, -1) for k in PHASE_NAMES][: limit + 4]
    graphs = {(k, b): backend.capture(functools.partial(phases.run, k, b), None)
              for k, b in todo}
    assert backend.captured == limit + 4
    assert len({id(g.code) for g in graphs.values()}) == limit + 4
    for graph in graphs.values():
        assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(graph.code)) == 1
    phases.bufs.x.copy_(torch.arange(11.0, 19.0))  # new values, same addresses
    for (kind, b), graph in graphs.items():
        phases.bufs.out.zero_()
        graph.replay()
        assert torch.equal(phases.bufs.out[:b], _expected(kind, b, phases.bufs.x)), (kind, b)
        assert graph.replays == 1
    assert graphs[todo[0]].label == f"{todo[0][0]}_B{todo[0][1]}"


# -- 2. static inputs, graph breaks ----------------------------------------------------------

def test_held_tensors_walks_partials_closures_dataclasses_and_objects_not_modules():
    """held_tensors finds the tensors a capture callable holds, skipping nn.Module state."""
    class Pool:  # a plain object, like KVPool
        def __init__(self):
            self.layers = [{"k": torch.zeros(2)}, {"k": torch.zeros(3)}]

    phases, pool, module = _Phases(), Pool(), torch.nn.Linear(2, 2)
    free = torch.ones(1)

    def fn(kind, b):
        module(free)
        return pool, phases.run(kind, b)

    found = held_tensors(functools.partial(fn, "rollout", 1))
    expect = [phases.bufs.x, phases.bufs.out, free] + [d["k"] for d in pool.layers]
    assert {id(t) for t in found} == {id(t) for t in expect}


@pytest.mark.compile
def test_capture_marks_held_tensors_static():
    """Every tensor the captured callable holds is marked static for Dynamo (no guard)."""
    phases = _Phases()
    backend = CompileBackend(dynamo_compiler("aot_eager"))
    backend.capture(functools.partial(phases.run, "rollout", 2), None)
    for t in (phases.bufs.x, phases.bufs.out):
        assert torch._dynamo.utils.get_static_address_type(t) == "unguarded"


@pytest.mark.compile
def test_graph_break_is_a_capture_error_naming_the_graph():
    """A phase Dynamo cannot trace as one graph fails its capture, naming (kind, bucket)."""
    phases = _Phases()

    def run(kind, b):
        if phases.bufs.x.sum() > 0:  # data-dependent Python branch: a graph break
            phases.bufs.out.add_(1)

    backend = CompileBackend(dynamo_compiler("aot_eager"))
    with pytest.raises(CaptureError, match=r"aot_eager.*rollout_B4.*one graph"):
        backend.capture(functools.partial(run, "rollout", 4), None)
    assert backend.captured == 0 and not backend.is_capturing()


def test_a_cuda_graph_inductor_declines_fails_the_capture():
    """reduce-overhead: when inductor skips the CUDA graph (it only logs a warning) the
    capture fails instead of running uncaptured. Here a backend declines like inductor."""
    def declining(gm, example_inputs):
        torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] += 1
        return gm.forward

    phases = _Phases()
    backend = CompileBackend(Compiler("reduce-overhead", declining, cuda_graphs=True))
    with pytest.raises(CaptureError, match="rollout_B2 but recorded no CUDA graph"):
        backend.capture(functools.partial(phases.run, "rollout", 2), None)


# -- 3. the engine on compiled graphs ---------------------------------------------------------

def _names(graphs) -> list[tuple[str, int]]:
    return sorted((k.name, k.bucket) for k in graphs)


@pytest.mark.compile
def test_compile_engine_equals_reference(trained):
    """An engine on compiled graphs (aot_eager; 3 graphs, 3 requests split over bucket 2)
    equals the no-cache oracle, replaying every graph and running nothing eagerly."""
    spec, pool = SpeculativeConfig(num_steps=3, num_draft_tokens=4), PoolConfig(4, 128)
    backend = make_backend("compile", compile_backend="aot_eager")
    engine = SpecEngine(trained.target, trained.draft, spec, pool,
                        GraphConfig(backend="compile", buckets=(2,), round="split",
                                    sampling=False), backend=backend)
    assert backend.name == "compile" and backend.compiler.label == "aot_eager"
    assert _names(engine.runner.graphs) == [(k, 2) for k in sorted(PHASE_NAMES)]
    res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set())
    ref = reference_generate(trained.target, PROMPTS, MAX_NEW, stop_ids=set(), max_context=128)
    assert res.outputs == ref.outputs
    st = res.stats
    assert st["backend"] == "compile" and st["eager_fallbacks"] == 0 and st["bucket_splits"] > 0
    assert st["accepted_drafts"] > 0
    assert all(g.replays > 0 for g in engine.runner.graphs.values())
    assert sum(g.replays for g in engine.runner.graphs.values()) == st["graph_replays"]
    for t in engine.chunks.round.static_tensors().values():  # request state, round buffers
        assert torch._dynamo.utils.get_static_address_type(t) == "unguarded"
    kv = engine.models.target_pool.layers[0].swa.data
    assert torch._dynamo.utils.get_static_address_type(kv) == "unguarded"


@pytest.mark.compile
def test_fused_round_compiles_into_one_graph_and_overlaps(trained):
    """graph.round fused on the compile backend (aot_eager): one compiled graph for the
    whole round (its in-place slot flip included), overlapped rounds, tokens equal to
    the oracle, and a steady batch staged once."""
    spec, pool = SpeculativeConfig(num_steps=3, num_draft_tokens=4), PoolConfig(4, 128)
    backend = make_backend("compile", compile_backend="aot_eager")
    engine = SpecEngine(trained.target, trained.draft, spec, pool,
                        GraphConfig(backend="compile", buckets=(4,), sampling=False),
                        backend=backend)
    assert _names(engine.runner.graphs) == [("round", 4)] and backend.captured == 1
    assert engine.runner.graphs[GraphKey(Phase.ROUND, 4)].label == "round_B4"  # (logs)
    res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set())
    ref = reference_generate(trained.target, PROMPTS, MAX_NEW, stop_ids=set(), max_context=128)
    assert res.outputs == ref.outputs
    assert res.stats["staging_copies"] < res.stats["graph_replays"]
    assert engine.chunks.counters.overlapped_rounds > 0


@pytest.mark.compile
def test_sampling_round_compiles_and_draws_what_eager_draws(trained):
    """The fused round's sampling variant through Dynamo (aot_eager, fullgraph: no graph
    break in the filtering, the keyed uniforms or the rejection step): seeded requests
    beside a greedy one take the eager engine's tokens."""
    spec, pool = SpeculativeConfig(num_steps=3), PoolConfig(4, 128)
    backend = make_backend("compile", compile_backend="aot_eager")
    engine = SpecEngine(trained.target, trained.draft, spec, pool,
                        GraphConfig(backend="compile", buckets=(4,)), backend=backend)
    assert _names(engine.runner.graphs) == [("round", 4), ("round+sampling", 4)]
    smp = [{"temperature": 1.0, "seed": 4}, None, {"temperature": 0.6, "top_k": 5, "seed": 8}]
    eager = SpecEngine(trained.target, trained.draft, spec, pool, None)
    want = eager.generate(PROMPTS, MAX_NEW, stop_ids=set(), sampling=smp).outputs
    res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set(), sampling=smp)
    assert res.outputs == want and res.stats["eager_fallbacks"] == 0
    assert engine.runner.graphs[GraphKey(Phase.ROUND, 4, sampled=True)].replays > 0


def _shipped_on_cpu(path: Path, **graph):
    """A shipped config's speculative settings, pool rows and graph set, on the CPU with the
    tiny trained checkpoint (context 128) and the compile backend (aot_eager); split
    rounds, so each phase is a graph of its own (the graph counts below); greedy graphs
    only (the sampling variants compile in ``test_sampling_round_compiles``)."""
    return load_run_config(path, checkpoint="builtin:tiny-trained", dtype="fp32", device="cpu",
                           pool={"max_context": 128},
                           graph={"backend": "compile", "compile_backend": "aot_eager",
                                  "round": "split", "sampling": False, **graph})


def _run_every_bucket(trained, cfg, expect_graphs: int) -> None:
    backend = make_backend(cfg.graph.backend, compile_backend=cfg.graph.compile_backend)
    engine = SpecEngine(trained.target, trained.draft, cfg.speculative, cfg.pool, cfg.graph,
                        backend=backend)
    graphs = engine.runner.graphs
    assert len(graphs) == expect_graphs == backend.captured
    for n in cfg.graph.buckets:  # a batch of n requests replays bucket n's graphs
        prompts = [[2 + (7 * i + j) % 250 for j in range(3 + i % 5)] for i in range(n)]
        res = engine.generate(prompts, 6, stop_ids=set())
        ref = reference_generate(trained.target, prompts, 6, stop_ids=set(), max_context=128)
        assert res.outputs == ref.outputs, n
    assert res.stats["eager_fallbacks"] == 0
    assert [key for key, g in graphs.items() if g.replays == 0] == []


@pytest.mark.slow
def test_ascend_flash_graph_set_compiles_and_equals_reference(trained):
    """The shipped Ascend config's 21 graphs (2 steps, buckets 1..64, 3 kinds) through real
    torch.compile (aot_eager) on the CPU: each replayed, tokens equal the oracle. Slow: 21
    compiles of about 5 s each on a 2-core CPU."""
    cfg = _shipped_on_cpu(REPO / "capture_configs" / "deepseek_v4_flash_ascend.yaml")
    assert cfg.graph.buckets == (1, 2, 4, 8, 16, 32, 64) and cfg.speculative.num_steps == 2
    _run_every_bucket(trained, cfg, 21)


@pytest.mark.slow
def test_24_graphs_compile_and_equal_reference(trained):
    """Buckets 1..8 on all three kinds, 24 graphs (three times Dynamo's recompile limit):
    each captured and replayed, tokens equal the oracle. Slow: 24 compiles of about 5 s."""
    cfg = _shipped_on_cpu(REPO / "capture_configs" / "cpu_default.yaml",
                          buckets=list(range(1, 9)))
    _run_every_bucket(trained, cfg, 24)


@pytest.mark.slow
def test_inductor_engine_equals_reference(trained):
    """inductor (C++ kernels on the CPU) compiles the graphs and equals the oracle. Slow:
    20 to 160 s per graph on a 2-core CPU, so 2 graphs only (1 step, bucket 2)."""
    spec = SpeculativeConfig(num_steps=1, num_draft_tokens=2)
    backend = make_backend("compile", compile_backend="inductor")
    engine = SpecEngine(trained.target, trained.draft, spec, PoolConfig(4, 128),
                        GraphConfig(backend="compile", buckets=(2,), round="split"), backend=backend)
    res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set())
    ref = reference_generate(trained.target, PROMPTS, MAX_NEW, stop_ids=set(), max_context=128)
    assert res.outputs == ref.outputs and res.stats["eager_fallbacks"] == 0
    assert all(g.replays > 0 for g in engine.runner.graphs.values())


# -- 4. the config key -------------------------------------------------------------------------

CONFIG = """\
# test config
checkpoint: builtin:tiny-trained
device: {device}
graph:
  backend: {backend}
  compile_backend: {compile_backend}
"""


def _load(tmp_path: Path, device: str, backend: str, compile_backend: str):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.format(device=device, backend=backend,
                                  compile_backend=compile_backend))
    return path, load_run_config(path)


@pytest.mark.parametrize("device,backend,given,want", [
    ("cpu", "compile", "auto", ("compile", "inductor")),
    ("cpu", "compile", "aot_eager", ("compile", "aot_eager")),
    ("cuda", "compile", "auto", ("compile", "inductor")),
    ("cuda", "compile", "reduce-overhead", ("compile", "reduce-overhead")),
    ("npu", "compile", "auto", ("torchair", "auto")),  # torchair picks at start-up
    ("npu", "torchair", "npugraph_ex", ("torchair", "npugraph_ex")),
    ("npu", "torchair", "reduce-overhead", ("torchair", "reduce-overhead")),
    ("cpu", "cpu", "npugraph_ex", ("cpu", "npugraph_ex")),  # not read by other backends
])
def test_compile_backend_resolves_per_device(tmp_path, device, backend, given, want):
    """graph.compile_backend: auto is inductor on CPU/CUDA; compile on Ascend is torchair."""
    _, cfg = _load(tmp_path, device, backend, given)
    assert (cfg.graph.backend, cfg.graph.compile_backend) == want


@pytest.mark.parametrize("device,backend,value,match", [
    ("cuda", "compile", "cudagraphs", "must be one of"),  # see graph/compile.py
    ("cpu", "compile", "reduce-overhead", "cannot run on device 'cpu'"),
    ("cpu", "compile", "npugraph_ex", "cannot run on device 'cpu'"),
    ("cuda", "compile", "npugraph_ex", "cannot run on device 'cuda'"),
    ("npu", "torchair", "inductor", "cannot run on device 'npu'"),
    ("cpu", "compile", "tvm", "must be one of"),
])
def test_bad_compile_backend_names_file_and_key(tmp_path, device, backend, value, match):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG.format(device=device, backend=backend, compile_backend=value))
    with pytest.raises(ConfigError, match=match) as info:
        load_run_config(path)
    assert str(info.value).startswith(str(path)) and "graph.compile_backend" in str(info.value)


def test_make_backend_compile_refuses_what_it_cannot_run():
    """Built in code (no config resolution), the compile backend still refuses an Ascend or
    CUDA-only compile_backend where it cannot run."""
    assert make_backend("compile").compiler.label == "inductor"  # auto
    with pytest.raises(ConfigError, match="npugraph_ex: use graph backend 'torchair'"):
        make_backend("compile", compile_backend="npugraph_ex")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            make_backend("compile", compile_backend="reduce-overhead")


# -- 5. CUDA (GPU only) --------------------------------------------------------------------------

NO_GPU = "needs a CUDA GPU: torch.cuda.is_available() is False"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_backend_warms_up_and_captures_on_one_side_stream_and_counts_pool_bytes():
    """The cuda backend runs warm-up and capture on its one side stream, and a graph's
    nbytes is the pool memory it reserved (memory_allocated would read about 0)."""
    backend = CudaBackend()
    x = torch.zeros(1 << 20, device="cuda")  # 4 MiB
    streams = []

    def fn():
        streams.append(torch.cuda.current_stream())
        x.copy_(x + 1)  # x + 1: a 4 MiB temporary, from the graph's pool at capture

    pool = backend.new_pool()
    with backend.warmup_context():
        fn()
    graph = backend.capture(fn, pool)
    assert streams[0] == streams[1] == backend.stream != torch.cuda.current_stream()
    assert graph.nbytes >= x.nbytes
    graph.replay()
    torch.cuda.synchronize()
    assert float(x[0]) == 2.0  # the warm-up and the replay (a capture only records)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("compile_backend", ["inductor", "reduce-overhead"])
def test_cuda_compile_engine_equals_reference(compile_backend):
    """On a GPU the compiled graphs (inductor, and recorded into CUDA graphs) equal the oracle."""
    models = load_checkpoint("builtin:tiny-trained", device="cuda")
    backend = make_backend("compile", compile_backend=compile_backend)
    spec = SpeculativeConfig(num_steps=3, num_draft_tokens=4)
    engine = SpecEngine(models.target, models.draft, spec, PoolConfig(4, 128),
                        GraphConfig(backend="compile", buckets=(1, 2), round="split",
                                    sampling=False), backend=backend)
    res = engine.generate(PROMPTS, MAX_NEW, stop_ids=set())
    ref = reference_generate(models.target, PROMPTS, MAX_NEW, stop_ids=set(), max_context=128)
    assert res.outputs == ref.outputs
    assert all(g.replays > 0 for g in engine.runner.graphs.values())
