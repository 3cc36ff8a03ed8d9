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
from nextn_graph.bench.report import MODES_HEADER, PLOTS, table
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
    submissions = replays + staging copies + readback copies + updates + eager-fallback
    ops; the config's graph round is fused (round: auto, every phase captured): one replay
    and one readback, no staging (the round flipped the staged slots itself); and the
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
        assert g["replays_per_round"] == 1 == parts["replays"]
        assert parts["staging_copies"] == 0 and parts["readback_copies"] == 1
        assert parts["updates"] == 0 and parts["eager_fallback_ops"] == 0
        assert g["counted_as"] == COUNTED_AS and "readback copies" in g["counted_as"]
        assert g["submissions_per_round"] == 2
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


def test_round_modes_count_their_submissions(report):
    """Per bucket, the speculative round per graph mode (the config's round is fused):
    fused (the graph engine) is 1 replay + 1 readback, no staging; split is a replay per
    phase (3, or 2 without a rollout) + 1 staging + 1 readback; fused with overlap on is
    1 replay + 1 readback. The latency ratios are the modes' medians over each other."""
    rep, steps, _ = report
    assert rep["settings"]["round"] == "fused"
    named = ("replays", "staging_copies", "readback_copies", "updates")
    for b in rep["buckets"]:
        m = b["round_modes"]
        assert set(m) == {"split", "fused", "overlap"}
        assert m["fused"] == b["graph"]
        want = {"split": (3 if steps > 1 else 2, 1, 1, 0), "fused": (1, 0, 1, 0),
                "overlap": (1, 0, 1, 0)}
        for mode, counts in want.items():
            g = m[mode]
            assert tuple(g["submissions"][k] for k in named) == counts, mode
            assert g["replays_per_round"] == counts[0]
            assert g["submissions_per_round"] == sum(counts)
        assert b["fused_vs_split_latency"] == pytest.approx(
            m["fused"]["round_ms_median"] / m["split"]["round_ms_median"])
        assert b["overlap_vs_fused_latency"] == pytest.approx(
            m["overlap"]["round_ms_median"] / m["fused"]["round_ms_median"])


def test_host_time_outside_replays(report):
    """For every graph mode: the host's part of a steady round (wall time minus the time
    inside replay calls) is positive and below the round (each round's replay is inside
    it, so the medians keep that order)."""
    rep, _, _ = report
    for b in rep["buckets"]:
        summaries = [*b["round_modes"].values(), b["plain"]["graph"]]
        for g in summaries:
            assert 0 < g["host_ms_median"] < g["round_ms_median"]
        assert "host_ms_median" not in b["eager"]  # eager has no replays


def test_phase_times_add_up(report):
    """Eager and split-graph phase times (DIGEST 7: draft vs verify time): one entry per
    phase of the round, each positive; phases plus what ran outside them is the round
    (means over the same rounds), so the phases sum to at most the round; draft is rollout
    + draft extend. On CPU there is no device to sync. Fused has one phase: not timed."""
    rep, steps, _ = report
    kinds = (["rollout"] if steps > 1 else []) + ["target_verify", "draft_extend"]
    assert rep["settings"]["phase_rounds"] == 1  # timed_rounds 3 // 3
    for b in rep["buckets"]:
        for t in (b["eager"]["phase_times"], b["round_modes"]["split"]["phase_times"]):
            ms = t["phase_ms"]
            assert list(ms) == kinds and all(v > 0 for v in ms.values())
            assert sum(ms.values()) <= t["round_ms_mean"]
            assert t["outside_phases_ms"] == pytest.approx(t["round_ms_mean"] - sum(ms.values()))
            assert t["draft_ms"] == pytest.approx(ms["draft_extend"] + ms.get("rollout", 0))
            assert t["verify_ms"] == ms["target_verify"]
            assert t["draft_vs_verify"] == pytest.approx(t["draft_ms"] / t["verify_ms"])
            assert t["rounds"] == 1 and t["synchronized"] is False
        assert b["graph"]["phase_times"] is None and b["plain"]["eager"]["phase_times"] is None


def test_tpot_and_end_to_end(report):
    """TPOT per mode (round over tokens per request-round: a plain round gives each
    request 1 token), the break-even acceptance length, and the end-to-end run: B
    requests of 32 tokens each, spec vs plain on the graph engines, latencies and ratios."""
    rep, _, _ = report
    for b in rep["buckets"]:
        plain, sp = b["plain"]["graph"], b["spec_vs_plain"]
        assert plain["tpot_ms"] == pytest.approx(plain["round_ms_median"])
        assert 0 < b["graph"]["tpot_ms"] <= b["graph"]["round_ms_median"]  # >= 1 token each
        assert sp["tpot_ms"] == {"spec": b["graph"]["tpot_ms"], "plain": plain["tpot_ms"]}
        assert sp["break_even_acceptance_length"] == pytest.approx(
            b["graph"]["round_ms_median"] / plain["round_ms_median"])
        e = b["e2e"]
        assert e["requests"] == b["bucket"] and e["max_new_tokens"] == 32
        for side in (e["spec"], e["plain"]):
            assert 0 < side["latency_ms_median"] <= side["latency_ms_max"]
            assert side["output_tokens_per_s"] > 0
        assert e["latency_ratio"] == pytest.approx(
            e["spec"]["latency_ms_median"] / e["plain"]["latency_ms_median"])
        assert e["throughput_ratio"] == pytest.approx(
            e["spec"]["output_tokens_per_s"] / e["plain"]["output_tokens_per_s"])
    assert rep["spec_vs_plain"]["e2e_latency_ratio"] > 0


def test_mode_outputs(report):
    """The table's mode columns, the Markdown's round-mode and cost-model sections, the
    JSON's new keys and the round-modes plot."""
    rep, _, out = report
    text = table(rep)
    assert all(h in text for h in MODES_HEADER)
    assert "round modes per steady round: fused 1 replay + 1 readback, split" in text
    assert "end to end (B requests of 32 tokens" in text
    md = (out / "bench.md").read_text()
    assert "## Round modes" in md and "## Cost model" in md and "## JSON keys" in md
    assert "| 1 | overlap | 1 | 0 | 1 | 0 | 2 |" in md
    data = json.loads((out / "bench.json").read_text())
    b = data["buckets"][0]
    assert {"round_modes", "fused_vs_split_latency", "overlap_vs_fused_latency", "e2e"} <= set(b)
    assert {"host_ms_median", "tpot_ms", "phase_times"} <= set(b["round_modes"]["split"])
    assert (out / "round_modes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_capture_records_every_graph(report):
    """One capture record per (kind, bucket), largest bucket first, with time and memory:
    the config's engines capture one fused round per bucket, the split engine one graph
    per phase and bucket, the overlap engine one fused round per bucket."""
    rep, steps, _ = report
    kinds = 3 if steps > 1 else 2
    cap = rep["capture"]
    recs = cap["records"]
    assert [(r["kind"], r["bucket"]) for r in recs] == [("round", 2), ("round", 1)]
    assert all(r["seconds"] > 0 and r["nbytes"] > 0 and r["ops"] > 0 for r in recs)
    assert cap["total_s"] == pytest.approx(sum(r["seconds"] for r in recs))
    assert len(cap["plain_records"]) == 2  # plain decoding: one round per bucket
    split = cap["split_records"]
    assert [r["bucket"] for r in split] == [2] * kinds + [1] * kinds
    assert {r["kind"] for r in split} == {"rollout", "target_verify", "draft_extend"} - (
        set() if steps > 1 else {"rollout"})
    assert [r["kind"] for r in cap["overlap_records"]] == ["round", "round"]


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
    assert "round_modes.png" in PLOTS
    for name in PLOTS:
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
        assert cells[11:16] == ["-"] * len(MODES_HEADER), line  # no graph modes
    md = (tmp_path / "bench.md").read_text()
    assert "padding waste" not in md.lower() and "None: the eager backend has no graphs" in md
    assert data["settings"]["round"] is None
    for b in data["buckets"]:
        assert b["round_modes"] == {"split": None, "fused": None, "overlap": None}
        assert b["fused_vs_split_latency"] is None and b["overlap_vs_fused_latency"] is None
        assert b["eager"]["phase_times"]["phase_ms"]  # eager phases are still timed
        assert b["e2e"]["latency_ratio"] > 0  # eager spec vs eager plain
    for name in PLOTS:
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
