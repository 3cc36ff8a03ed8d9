"""The replay benchmark on a small config: the JSON is internally consistent.

No timing is asserted: only that the counts add up and match the algorithm
(NextN forwards per round = num_steps, verify width = num_steps + 1, replays
per round = the captured kinds), and that every promised output exists.
"""

from __future__ import annotations

import json
import re
import statistics

import pytest

from nextn_graph.bench import BenchSettings, run_bench
from nextn_graph.bench.report import MODES_HEADER, PLOTS, table
from nextn_graph.bench.trace import TRACE_ROUNDS
from nextn_graph.cli import main
from nextn_graph.config import load_run_config
from nextn_graph.profile.counting import OUTSIDE_PHASES
from nextn_graph.runtime.chunks import COUNTED_AS

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


def test_greedy_vs_sampling_end_to_end(report):
    """bench.temperature (default 0.8): per bucket the end-to-end pair runs greedy (`e2e`)
    and with every request sampling (`e2e_sampled`, in the sampling graph variants only);
    each has an acceptance length in [1, N] (1 + S x the strict acceptance rate: S drafts
    proposed per request-round) and positive spec/plain ratios; the top-level `sampling`
    summarises both over buckets; the table, Markdown and JSON show them."""
    rep, steps, out = report
    for b in rep["buckets"]:
        greedy, sampled = b["e2e"], b["e2e_sampled"]
        assert (greedy["temperature"], sampled["temperature"]) == (0.0, 0.8)
        assert greedy["sampled_chunks"] == {"spec": 0, "plain": 0}
        assert sampled["sampled_chunks"]["spec"] > 0 and sampled["sampled_chunks"]["plain"] > 0
        for e in (greedy, sampled):
            assert e["requests"] == b["bucket"] and e["max_new_tokens"] == 32
            assert 1.0 <= e["acceptance_length"] <= steps + 1
            assert e["acceptance_length"] == pytest.approx(1 + steps * e["draft_acceptance_rate"])
            assert e["latency_ratio"] > 0 and e["throughput_ratio"] > 0
            assert e["latency_ratio"] == pytest.approx(
                e["spec"]["latency_ms_median"] / e["plain"]["latency_ms_median"])
    smp = rep["sampling"]
    assert (smp["temperature"], smp["top_p"], smp["top_k"]) == (0.8, 1.0, 0)
    for side, key in (("greedy", "e2e"), ("sampled", "e2e_sampled")):
        runs = [b[key] for b in rep["buckets"]]
        assert smp[side]["acceptance_length"] == pytest.approx(
            statistics.mean(r["acceptance_length"] for r in runs))
        assert smp[side]["latency_ratio"] == pytest.approx(
            statistics.geometric_mean(r["latency_ratio"] for r in runs))
        assert smp[side]["throughput_ratio"] > 0
    g, s = smp["greedy"], smp["sampled"]
    assert (f"greedy vs sampling at temperature 0.8 (seed = request index), end to end: "
            f"acceptance length {g['acceptance_length']:.2f} vs "
            f"{s['acceptance_length']:.2f}") in table(rep)
    md = (out / "bench.md").read_text()
    assert "## Greedy vs sampling" in md and "`e2e_sampled`" in md
    b = rep["buckets"][0]
    assert (f"| {b['bucket']} | {b['e2e']['acceptance_length']:.2f} | "
            f"{b['e2e_sampled']['acceptance_length']:.2f} |") in md
    data = json.loads((out / "bench.json").read_text())
    assert data["sampling"] == smp and data["buckets"][0]["e2e_sampled"] == b["e2e_sampled"]


def test_mode_outputs(report):
    """The table's mode columns, the Markdown's round-mode, trace and cost-model sections,
    the JSON's new keys and the round-modes and round-trace plots."""
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
    # the per-round trace: a summary line, a Markdown section, its JSON keys and a plot
    assert ("fused + overlap: launch k+1 before read k, 1.00 overlapped per round" in text
            and "fused: read k before launch k+1, 0.00 overlapped per round" in text)
    assert "## Per-round trace" in md and "| 1 | fused + overlap | `L0 R-1 L1 R0" in md
    for mode in ("fused", "overlap"):
        assert set(b["round_trace"][mode]) == TRACE_KEYS
        assert set(b["round_trace"][mode]["events"][0]) == {"event", "round", "start_ms",
                                                            "end_ms"}
    assert (out / "round_trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TRACE_KEYS = {"rounds", "events", "read_wait_ms", "overlapped_rounds", "pairs",
              "launch_before_prev_read", "read_before_next_launch", "repeats",
              "read_wait_ms_median", "overlapped_per_round"}


def _span(events: list[dict], kind: str, k: int) -> dict:
    (e,) = [e for e in events if e["event"] == kind and e["round"] == k]
    return e


def test_round_trace_puts_the_read_off_the_critical_path(report):
    """Issue 12, per bucket: the fused round traced over TRACE_ROUNDS steady rounds. With
    overlap each step launches round k+1, then reads round k (launched one step before:
    one overlapped round per round), so round k+1's launch starts before round k's read;
    without, each step reads its own round (none overlapped), and round k's read ends
    before round k+1's launch. Checked here from the events themselves."""
    rep, _, _ = report
    n = TRACE_ROUNDS
    for b in rep["buckets"]:
        t = b["round_trace"]
        assert set(t) == {"fused", "overlap"} and t["overlap"]["repeats"] == 1
        fused, overlap = t["fused"], t["overlap"]
        assert overlap["overlapped_rounds"] == [1] * n and overlap["overlapped_per_round"] == 1
        assert fused["overlapped_rounds"] == [0] * n and fused["overlapped_per_round"] == 0
        assert [(e["event"], e["round"]) for e in overlap["events"]] == [
            x for k in range(n) for x in (("launch", k), ("read", k - 1))]
        assert [(e["event"], e["round"]) for e in fused["events"]] == [
            x for k in range(n) for x in (("launch", k), ("read", k))]
        for k in range(-1, n - 1):  # round k read, round k+1 launched, inside the window
            launch = _span(overlap["events"], "launch", k + 1)
            assert launch["start_ms"] < _span(overlap["events"], "read", k)["start_ms"]
        for k in range(n - 1):
            read = _span(fused["events"], "read", k)
            assert read["end_ms"] <= _span(fused["events"], "launch", k + 1)["start_ms"]
        assert overlap["launch_before_prev_read"] and not overlap["read_before_next_launch"]
        assert fused["read_before_next_launch"] and not fused["launch_before_prev_read"]
        assert (overlap["pairs"], fused["pairs"]) == (n, n - 1)
        for trace in (fused, overlap):
            assert trace["rounds"] == n and len(trace["read_wait_ms"]) == n
            assert all(w >= 0 for w in trace["read_wait_ms"]) and trace["read_wait_ms_median"] >= 0
            events = trace["events"]
            assert events[0]["start_ms"] == 0
            assert all(e["start_ms"] <= e["end_ms"] for e in events)
            assert all(a["end_ms"] <= b["start_ms"] for a, b in zip(events, events[1:]))


def test_capture_records_every_graph(report):
    """One capture record per (kind, bucket), largest bucket first, with time and memory,
    the config's engines (which also run the sampled end-to-end pair) capture one fused
    round and its sampling variant per bucket, the greedy-only split engine one graph per
    phase and bucket, the greedy-only overlap engine one fused round per bucket."""
    rep, steps, _ = report
    phases = ["rollout", "target_verify", "draft_extend"][(steps == 1):]
    rounds = ["round", "round+sampling"]
    cap = rep["capture"]
    recs = cap["records"]
    assert [(r["name"], r["bucket"]) for r in recs] == [(k, b) for b in (2, 1) for k in rounds]
    assert all(r["seconds"] > 0 and r["nbytes"] > 0 and r["ops"] > 0 for r in recs)
    assert cap["total_s"] == pytest.approx(sum(r["seconds"] for r in recs))
    assert len(cap["plain_records"]) == 4  # plain decoding: one round (and variant) per bucket
    split = [(r["name"], r["bucket"]) for r in cap["split_records"]]
    assert split == [(k, b) for b in (2, 1) for k in phases]
    assert [r["name"] for r in cap["overlap_records"]] == ["round"] * 2


def test_outputs_exist(report):
    """JSON (with the keys the README promises), Markdown and every PNG plot."""
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
    md = (out / "bench.md").read_text()
    assert "| bucket |" in md
    # dated, with the machine named (the README's figures quote them)
    s = data["settings"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", s["date"]) and s["cpu"] and s["cores"] >= 1
    assert f"Run {s['date']} on {s['cpu']} ({s['cores']} cores" in md
    assert {"round_modes.png", "round_trace.png"} <= set(PLOTS)
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_graph_backend_report_keeps_graph_figures(report):
    """The graph-backend report says it has graphs and prints its padding waste."""
    rep, _, _ = report
    assert rep["settings"]["graphs"] is True and rep["padding"]["waste"] >= 0
    assert "padding waste over batch sizes 1..2" in table(rep)
