"""The bench's compile peer (``bench.compile_peer``) and compiled graphs under a dispatch mode.

The peer is the config's graph set on ``torch.compile`` (here ``aot_eager``, which runs
the same aten ops as eager, so the profiler sees every launch): the bench measures it
beside eager and the hand-captured graphs, counted by one profiler per round with the
compiled calls inside their phases. A compiled graph called under a TorchDispatchMode
would be marked uncompilable by Dynamo for good (torch 2.13); the backend refuses the
call first, so only that step fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nextn_graph.bench import BenchSettings, run_bench
from nextn_graph.bench.report import PEER_HEADER, table
from nextn_graph.cli import main
from nextn_graph.config import (GraphConfig, PoolConfig, SpeculativeConfig, compile_peer,
                                load_run_config)
from nextn_graph.errors import ConfigError
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.graph.backends import make_backend
from nextn_graph.profile.counting import OUTSIDE_PHASES, OpCounter
from nextn_graph.runtime.engine import SpecEngine

pytestmark = pytest.mark.compile  # torch.compile'd peers

REPO = Path(__file__).resolve().parents[2]
KINDS = {"rollout", "target_verify", "draft_extend"}


@pytest.fixture(scope="module")
def peer_report(tmp_path_factory):
    """One bucket of 2 requests: eager, cpu graphs and the aot_eager compile peer."""
    cfg = load_run_config(None, pool={"max_requests": 2, "max_context": 256},
                          graph={"buckets": [2]}, bench={"compile_peer": "aot_eager"})
    out = tmp_path_factory.mktemp("peer")
    st = BenchSettings(warmup_rounds=1, timed_rounds=3, repeats=1)
    return run_bench(cfg, "test", st, out, progress=False), out


def test_peer_counts_every_launch_by_phase(peer_report):
    """The peer's round: 3 compiled calls (one per phase), every aten op they run counted
    inside its phase, and outside the phases the staging and readback copies only. aot_eager
    runs what eager runs, decomposed: its count is within 5% of eager's, never 0."""
    rep, _ = peer_report
    assert rep["settings"]["compile_peer"] == "aot_eager"
    (b,) = rep["buckets"]
    p, e = b["compile"], b["eager"]
    assert p["compile_backend"] == "aot_eager" and p["counts_every_launch"]
    assert p["calls_per_round"] == 3
    assert set(p["submissions"]) == KINDS | {OUTSIDE_PHASES}
    assert p["submissions"][OUTSIDE_PHASES] == 2
    assert all(p["submissions"][k] > 0 for k in KINDS)
    assert p["submissions_per_round"] == sum(p["submissions"].values())
    assert p["submissions_per_round"] == pytest.approx(e["submissions_per_round"], rel=0.05)
    assert "profiler" in p["counted_as"]
    assert b["compile_vs_graph_latency"] == pytest.approx(
        p["round_ms_median"] / b["graph"]["round_ms_median"])
    assert b["compile_vs_eager_latency"] == pytest.approx(
        p["round_ms_median"] / e["round_ms_median"])


def test_peer_capture_and_outputs(peer_report):
    """The peer's 3 graphs are recorded with their compile time; the table, the Markdown and
    the JSON carry the peer's columns."""
    rep, out = peer_report
    recs = rep["compile_capture"]["records"]
    assert sorted(r["name"] for r in recs) == sorted(KINDS) and all(r["bucket"] == 2 for r in recs)
    assert rep["compile_capture"]["total_s"] > 0
    text = table(rep)
    assert all(h in text for h in PEER_HEADER) and "compile peer: torch.compile (aot_eager)" in text
    assert "compile ms" in (out / "bench.md").read_text()
    data = json.loads((out / "bench.json").read_text())
    assert data["buckets"][0]["compile"]["calls_per_round"] == 3


def test_no_peer_no_columns(tmp_path):
    """Without a peer (the default) the report has no compile figures and no columns."""
    cfg = load_run_config(None, pool={"max_requests": 1, "max_context": 128},
                          graph={"buckets": [1]})
    st = BenchSettings(warmup_rounds=0, timed_rounds=1, repeats=1)
    rep = run_bench(cfg, "test", st, tmp_path, progress=False)
    assert rep["settings"]["compile_peer"] is None and rep["compile_capture"] is None
    assert rep["buckets"][0]["compile"] is None
    assert not any(h in table(rep) for h in PEER_HEADER)


@pytest.mark.parametrize("overrides, match", [
    ({"graph": {"backend": "compile", "compile_backend": "aot_eager"}},
     r"bench.compile_peer.*already 'compile'"),
    ({"bench": {"compile_peer": "reduce-overhead"}},
     r"key 'bench.compile_peer' 'reduce-overhead' cannot run on device 'cpu'"),
    ({"bench": {"compile_peer": "npugraph_ex"}}, r"bench.compile_peer.*npugraph_ex"),
    ({"bench": {"compile_peer": "cudagraphs"}}, r"bench.compile_peer.*must be one of"),
])
def test_bad_peer_is_refused_before_any_work(tmp_path, overrides, match):
    """A peer that cannot run is refused by the bench before it loads or captures anything
    (an unknown name already at load); ``generate`` never reads the key."""
    overrides = {"bench": {"compile_peer": "inductor"}, **overrides}
    with pytest.raises(ConfigError, match=match):
        cfg = load_run_config(None, **overrides)
        compile_peer(cfg, "test")
    with pytest.raises(ConfigError, match=match):
        run_bench(load_run_config(None, **overrides), "test", BenchSettings(), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_generate_ignores_the_bench_key():
    """cuda.yaml moved to the CPU still loads for generate: its reduce-overhead peer is the
    bench's business, refused only when a bench runs it."""
    cfg = load_run_config(REPO / "capture_configs" / "cuda.yaml", device="cpu",
                          graph={"backend": "cpu"})
    assert cfg.bench.compile_peer == "reduce-overhead"
    with pytest.raises(ConfigError, match="cannot run on device 'cpu'"):
        compile_peer(cfg)


def test_cli_compile_peer_flag_is_checked_before_any_work(tmp_path, capsys):
    """`bench --compile-peer` overrides the YAML; a peer the device cannot run is one line."""
    rc = main(["bench", "--compile-peer", "reduce-overhead", "--out", str(tmp_path / "o"),
               "--quiet"])
    err = capsys.readouterr().err
    assert rc != 0 and "bench.compile_peer" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "bench.json").exists()


def test_dispatch_mode_fails_the_step_not_the_graphs(trained):
    """A step under a TorchDispatchMode fails its requests with an error naming the mode,
    and the compiled graphs keep working: later requests equal the oracle (without the
    refusal, Dynamo would have marked every graph uncompilable for good)."""
    spec, pool = SpeculativeConfig(num_steps=2, num_draft_tokens=3), PoolConfig(2, 128)
    engine = SpecEngine(trained.target, trained.draft, spec, pool,
                        GraphConfig(backend="compile", buckets=(2,), round="split"),
                        backend=make_backend("compile", compile_backend="aot_eager"))
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    rids = [engine.add_request(p, 12, stop_ids=[]) for p in prompts]
    engine.step()  # prefill and a first round
    with OpCounter():
        outs = engine.step()
    assert {o.rid for o in outs} == set(rids)
    assert all(o.finished and "TorchDispatchMode OpCounter" in str(o.error) for o in outs)
    assert engine.models.target_pool.free_rows == 2
    res = engine.generate(prompts, 8, stop_ids=set())
    ref = reference_generate(trained.target, prompts, 8, stop_ids=set(), max_context=128)
    assert res.outputs == ref.outputs and res.stats["eager_fallbacks"] == 0
