"""The replay benchmark on a small config: the JSON is internally consistent.

No timing is asserted: only that the counts add up and match the algorithm
(NextN forwards per round = num_steps, verify width = num_steps + 1, replays
per round = the captured kinds), and that every promised output exists.
"""

from __future__ import annotations

import json

import pytest

from torch.profiler import ProfilerActivity

from nextn_graph.bench import BenchSettings, run_bench
from nextn_graph.bench.measure import bench_prompts, measure
from nextn_graph.bench.report import table
from nextn_graph.bench.run import padding_waste
from nextn_graph.cli import main
from nextn_graph.config import PoolConfig, SpeculativeConfig, load_run_config
from nextn_graph.graph.counting import OUTSIDE_PHASES, ProfilerCounter
from nextn_graph.graph.runner import COUNTED_AS
from nextn_graph.runtime.engine import SpecEngine

SMALL = BenchSettings(warmup_rounds=1, timed_rounds=3, repeats=1)


@pytest.fixture(scope="module", params=[3, 1], ids=["steps3", "steps1"])
def report(request, tmp_path_factory):
    steps = request.param
    cfg = load_run_config(None, pool={"max_requests": 2, "max_context": 256},
                          graph={"buckets": [1, 2]},
                          speculative={"num_steps": steps, "num_draft_tokens": steps + 1})
    out = tmp_path_factory.mktemp(f"bench{steps}")
    return run_bench(cfg, "test", SMALL, out, progress=False), steps, out


def test_counts_add_up(report):
    """Per bucket: NextN forwards = num_steps, verify width = num_steps + 1, graph
    submissions = replays + the staging copy + 3 readback copies + updates + eager-fallback
    ops, replays per round = the phases of a round (3, or 2 without a rollout), and the
    eager submissions are exactly the sum of their phases and what ran outside them."""
    rep, steps, _ = report
    assert [b["bucket"] for b in rep["buckets"]] == [1, 2]
    for b in rep["buckets"]:
        assert b["nextn_forwards_per_round"] == steps
        assert b["verify_width"] == steps + 1
        g = b["graph"]
        parts = g["submissions"]
        assert g["submissions_per_round"] == sum(parts.values())
        assert set(parts) == {"replays", "staging_copies", "readback_copies", "updates",
                              "eager_fallback_ops"}
        assert g["replays_per_round"] == (3 if steps > 1 else 2) == parts["replays"]
        assert parts["staging_copies"] == 1 and parts["readback_copies"] == 1
        assert parts["updates"] == 0 and parts["eager_fallback_ops"] == 0
        assert g["counted_as"] == COUNTED_AS and "readback copies" in g["counted_as"]
        assert g["submissions_per_round"] == g["replays_per_round"] + 2
        e = b["eager"]
        phases = e["submissions"]
        kinds = ({"rollout", "target_verify", "draft_extend"} if steps > 1
                 else {"target_verify", "draft_extend"})
        assert set(phases) == kinds | {OUTSIDE_PHASES}
        assert e["submissions_per_round"] == sum(phases.values())
        assert all(phases[k] > 0 for k in kinds)
        assert phases[OUTSIDE_PHASES] == 2  # the staging copy_ and the readback copy_
        assert b["submission_ratio"] == pytest.approx(
            e["submissions_per_round"] / g["submissions_per_round"])
        sp = b["spec_vs_plain"]
        assert 1.0 <= sp["acceptance_length"] <= steps + 1
        assert 0.0 <= sp["draft_acceptance_rate"] <= 1.0
        assert sp["speedup"] > 0 and b["latency_ratio"] > 0


def test_capture_records_every_graph(report):
    """One capture record per (kind, bucket), largest bucket first, with time and memory."""
    rep, steps, _ = report
    kinds = 3 if steps > 1 else 2
    recs = rep["capture"]["records"]
    assert len(recs) == 2 * kinds
    assert [r["bucket"] for r in recs] == [2] * kinds + [1] * kinds
    assert all(r["seconds"] > 0 and r["nbytes"] > 0 and r["ops"] > 0 for r in recs)
    assert rep["capture"]["total_s"] == pytest.approx(sum(r["seconds"] for r in recs))
    assert len(rep["capture"]["plain_records"]) == 2  # plain decoding: target_verify only


def test_outputs_exist(report):
    """JSON (with the keys the README promises), Markdown and three PNG plots."""
    rep, _, out = report
    data = json.loads((out / "bench.json").read_text())
    for b in data["buckets"]:
        for key in ("bucket", "nextn_forwards_per_round"):
            assert key in b
        assert {"submissions_per_round", "round_ms_median"} <= set(b["eager"])
        assert {"submissions_per_round", "replays_per_round", "round_ms_median"} <= set(b["graph"])
    assert {"speedup", "acceptance_length"} <= set(data["spec_vs_plain"])
    assert data["settings"]["backend"] == "cpu" and data["settings"]["torch"]
    assert data["kv_pool_mb"]["target"] > data["kv_pool_mb"]["draft"] > 0  # SWA-only draft
    assert "| bucket |" in (out / "bench.md").read_text()
    for name in ("round_latency.png", "submissions.png", "speedup_vs_acceptance.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_padding_waste_policy():
    """Padding per batch size follows the bucket policy, splitting above the largest."""
    waste = padding_waste((1, 2, 4), 6)
    rows = {r["batch"]: (r["padded_rows"], r["chunks"]) for r in waste["per_batch_size"]}
    assert rows == {1: (0, 1), 2: (0, 1), 3: (1, 1), 4: (0, 1), 5: (0, 2), 6: (0, 2)}
    assert waste["waste"] == pytest.approx(1 / 21)


def test_bench_cli(tmp_path, capsys):
    """`nextn-graph bench` prints the table and writes the JSON where asked."""
    cfg = tmp_path / "small.yaml"
    cfg.write_text("pool: {max_requests: 1, max_context: 128}\ngraph: {buckets: [1]}\n")
    rc = main(["bench", "--config", str(cfg), "--rounds", "2", "--warmup-rounds", "1",
               "--repeats", "1", "--out", str(tmp_path / "o"), "--json",
               str(tmp_path / "r.json"), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "graph/eager" in text and "spec/plain" in text
    assert json.loads((tmp_path / "r.json").read_text())["buckets"][0]["bucket"] == 1


def test_eager_backend_report_is_honest(tmp_path):
    """With --backend eager there are no graphs: no graph engines are run (a second eager
    run gave a 1x 'submission ratio' and a graph/eager of noise), every graph figure is
    null in the JSON, the table shows '-' in the graph columns and no padding waste (eager
    never pads), and spec/plain is the eager speed-up."""
    cfg = load_run_config(None, pool={"max_requests": 2, "max_context": 128},
                          graph={"backend": "eager", "buckets": [1, 2]})
    rep = run_bench(cfg, "test", SMALL, tmp_path, progress=False)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["settings"]["graphs"] is False and data["settings"]["backend"] == "eager"
    assert data["capture"] is None and data["padding"] is None
    for b in data["buckets"]:
        assert b["graph"] is None and b["plain"]["graph"] is None
        assert b["submission_ratio"] is None and b["latency_ratio"] is None
        assert b["eager"]["submissions_per_round"] > 0 and b["plain"]["eager"]["round_ms_median"] > 0
        sp = b["spec_vs_plain"]
        assert sp["speedup"] == sp["speedup_eager"] > 0
        assert 1.0 <= sp["acceptance_length"] <= 4
        assert b["nextn_forwards_per_round"] == 3
    assert data["kv_pool_mb"]["target"] > data["kv_pool_mb"]["draft"] > 0
    text = table(rep)
    assert "padding waste" not in text and "% of real rows" not in text
    assert "graph columns -: the eager backend has no graphs" in text
    for line in text.splitlines()[2:4]:  # the two bucket rows
        cells = line.split()
        assert cells[3:6] == ["-", "-", "-"] and cells[7:9] == ["-", "-"], line
    md = (tmp_path / "bench.md").read_text()
    assert "padding waste" not in md.lower() and "None: the eager backend has no graphs" in md
    for name in ("round_latency.png", "submissions.png", "speedup_vs_acceptance.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_graph_backend_report_keeps_graph_figures(report):
    """The graph-backend report says it has graphs and prints its padding waste."""
    rep, _, _ = report
    assert rep["settings"]["graphs"] is True and rep["padding"]["waste"] >= 0
    assert "padding waste over batch sizes 1..2" in table(rep)


def test_profiler_count_matches_dispatch_count(trained):
    """The bench's profiler path (here with CPU activity: aten ops) counts an eager round
    like the dispatch-mode count of the same round (identical start state, deterministic
    ops) within 2%, never 0, and its phases add up to its total: one profiler per round.
    Nested profilers, as the bench once had, gave phase counts and a round total of 0."""
    eng = SpecEngine(trained.target, trained.draft,
                     SpeculativeConfig(num_steps=3, num_draft_tokens=4), PoolConfig(2, 256))
    prompts = bench_prompts(trained.cfg.vocab_size, 2, seed=11)
    st = BenchSettings(warmup_rounds=0, timed_rounds=1, repeats=1)
    dispatch = measure(eng, prompts, st)
    profiler = measure(eng, prompts, st, counter=lambda device: ProfilerCounter(
        ProfilerActivity.CPU))
    assert dispatch["count_method"] == "kernel-launching aten ops"
    assert profiler["count_method"] == "profiler aten ops (CPU)"
    for run in (dispatch, profiler):
        assert set(run["phase_launches"]) == {"rollout", "target_verify", "draft_extend"}
        assert all(n > 0 for n in run["phase_launches"].values())
        assert run["eager_launches"] == (sum(run["phase_launches"].values())
                                         + run["outside_phase_launches"]) > 0
    assert profiler["eager_launches"] == pytest.approx(dispatch["eager_launches"], rel=0.02)
    for kind, n in dispatch["phase_launches"].items():
        assert profiler["phase_launches"][kind] == pytest.approx(n, rel=0.02), kind
