"""The bench outside the shared small run of ``test_bench.py``: the eager backend, a
config whose round is split, the phase timer, the per-round trace's check, the
profiler count, the padding policy and the end-to-end output length."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity

from nextn_graph.bench import BenchSettings, run_bench
from nextn_graph.bench.e2e import e2e_modes
from nextn_graph.bench.measure import (E2E_MAX_NEW, PhaseTimer, bench_prompts, e2e_max_new,
                                       e2e_run, measure)
from nextn_graph.bench.report import MODES_HEADER, PLOTS, table
from nextn_graph.bench.run import padding_waste
from nextn_graph.bench.trace import record_trace, round_trace
from nextn_graph.config import PoolConfig, SpeculativeConfig, load_run_config
from nextn_graph.profile.counting import ProfilerCounter
from nextn_graph.runtime.engine import SpecEngine

SMALL = BenchSettings(warmup_rounds=1, timed_rounds=3, repeats=1)


def test_split_config_measures_split_only(tmp_path):
    """A config whose round is split: its graph engine is the split one, no fused or
    overlap engine is built (their figures null, '-' in the table), and its phases are
    timed. With bench.temperature 0 the end-to-end pair runs greedy only: no sampled
    figures (null in the JSON, no table line, 'None' in the Markdown)."""
    cfg = load_run_config(None, pool={"max_requests": 1, "max_context": 128},
                          graph={"buckets": [1], "round": "split"}, bench={"temperature": 0})
    st = BenchSettings(warmup_rounds=0, timed_rounds=2, repeats=1)
    rep = run_bench(cfg, "test", st, tmp_path, progress=False)
    assert rep["settings"]["round"] == "split" and set(rep["capture"]) >= {"plain_records"}
    assert "split_records" not in rep["capture"] and "overlap_records" not in rep["capture"]
    (b,) = rep["buckets"]
    m = b["round_modes"]
    assert m["split"] == b["graph"] and m["fused"] is None and m["overlap"] is None
    assert b["graph"]["submissions"]["replays"] == 3 and b["graph"]["phase_times"]["phase_ms"]
    assert b["fused_vs_split_latency"] is None and b["overlap_vs_fused_latency"] is None
    cells = table(rep).splitlines()[2].split()
    assert cells[11:13] == ["5", f"{b['graph']['round_ms_median']:.2f}"]
    assert cells[13:15] == ["-", "-"]
    assert "graph.round split, so no fused or overlap mode" in table(rep)
    assert b["round_trace"] == {"fused": None, "overlap": None}  # no fused round to trace
    assert "per-round trace" not in table(rep)
    assert "None: graph.round split, so no fused round" in (tmp_path / "bench.md").read_text()
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["sampling"] is None and data["buckets"][0]["e2e_sampled"] is None
    assert b["e2e"]["sampled_chunks"] == {"spec": 0, "plain": 0}
    assert 1 <= b["e2e"]["acceptance_length"] <= 4  # greedy is still measured
    assert "greedy vs sampling" not in table(rep)
    assert "None: bench.temperature is 0" in (tmp_path / "bench.md").read_text()


def test_phase_timer_sums_per_kind_in_round_order():
    """The timer keeps one sum per phase kind, in the order the phases ran, adds a
    kind's repeated runs, and never syncs on CPU (every kernel has run on return)."""
    timer = PhaseTimer(torch.device("cpu"))
    assert timer.synchronized is False
    for _ in range(2):
        for kind in ("rollout", "target_verify", "draft_extend"):
            with timer.phase(kind, True):
                torch.ones(8).sum()
    assert list(timer.seconds) == ["rollout", "target_verify", "draft_extend"]
    assert all(v > 0 for v in timer.seconds.values())


def test_e2e_output_length_fits_the_context(trained):
    """The end-to-end run asks E2E_MAX_NEW tokens, fewer where the context cannot hold
    them after the longest prompt and the verify lookahead (S - 1)."""
    spec = SpeculativeConfig(num_steps=3, num_draft_tokens=4)
    big = SpecEngine(trained.target, trained.draft, spec, PoolConfig(1, 128))
    small = SpecEngine(trained.target, trained.draft, spec, PoolConfig(1, 48))
    prompts = [[5] * 10, [6] * 30]
    assert e2e_max_new(big, prompts) == E2E_MAX_NEW
    assert e2e_max_new(small, prompts) == 48 - 30 - 2


def test_e2e_sampling_is_seeded_by_request_index(trained):
    """The sampled end-to-end requests: temperature as given, request i with seed i (so a
    rerun draws the same tokens: the same acceptance counts), in the sampling variants;
    temperature 0 is greedy only (no sampled runs)."""
    assert list(e2e_modes(0.0, 2)) == ["e2e"]
    modes = e2e_modes(0.8, 2)
    assert modes["e2e"] is None
    assert [(p.temperature, p.seed) for p in modes["e2e_sampled"]] == [(0.8, 0), (0.8, 1)]
    eng = SpecEngine(trained.target, trained.draft,
                     SpeculativeConfig(num_steps=3, num_draft_tokens=4), PoolConfig(2, 128))
    prompts = bench_prompts(trained.cfg.vocab_size, 2, seed=11)
    with torch.no_grad():
        first, again = (e2e_run(eng, prompts, 8, modes["e2e_sampled"]) for _ in range(2))
        greedy = e2e_run(eng, prompts, 8)
    counts = ("accepted_drafts", "proposed_drafts", "request_rounds", "sampled_chunks")
    assert [first[k] for k in counts] == [again[k] for k in counts]
    assert first["tokens"] == 16 and first["sampled_chunks"] > 0
    assert greedy["sampled_chunks"] == 0 and greedy["request_rounds"] > 0


def _event(kind: str, start: float, end: float) -> dict:
    return {"event": kind, "start": start, "end": end}


@pytest.mark.parametrize("overlapped", [0, 1])
def test_round_trace_names_rounds_and_checks_the_order(overlapped):
    """Synthetic steps of launch then read (ms apart): a step's read is its own round
    without overlap, the round before with one (1 overlapped round per step). The check
    tells the orders apart: in step, read k ends before launch k+1 (2 pairs in 3 rounds);
    overlapped, launch k+1 starts before read k (3 pairs: round -1's read too)."""
    steps = [{"events": [_event("launch", 1.0 + i, 1.0 + i + 0.0005),
                         _event("read", 1.0 + i + 0.0006, 1.0 + i + 0.0007)],
              "read_wait_s": 0.0001, "overlapped_rounds": overlapped} for i in range(3)]
    t = round_trace(steps)
    assert [(e["event"], e["round"]) for e in t["events"]] == [
        x for k in range(3) for x in (("launch", k), ("read", k - overlapped))]
    assert t["events"][0]["start_ms"] == 0 and t["events"][1]["start_ms"] == pytest.approx(0.6)
    assert t["read_wait_ms"] == [0.1] * 3 and t["overlapped_rounds"] == [overlapped] * 3
    assert t["pairs"] == 2 + overlapped
    assert t["launch_before_prev_read"] is bool(overlapped)
    assert t["read_before_next_launch"] is not bool(overlapped)


def test_round_trace_neither_order():
    """Reads that start before the next launch but end after it satisfy neither check."""
    steps = [{"events": [_event("launch", 0.0, 1.0), _event("read", 1.0, 3.0)],
              "read_wait_s": 0.0, "overlapped_rounds": 0},
             {"events": [_event("launch", 2.0, 4.0), _event("read", 4.0, 5.0)],
              "read_wait_s": 0.0, "overlapped_rounds": 0}]
    t = round_trace(steps)
    assert t["pairs"] == 1
    assert not t["launch_before_prev_read"] and not t["read_before_next_launch"]


def test_record_trace_sets_the_trace_for_its_rounds_only():
    """The chunks have an event log as observer during the traced rounds only, unset
    after, even when a round raises; each round gets its own events and counter deltas."""
    runner = SimpleNamespace(observer=None, counters=SimpleNamespace(overlapped_rounds=7))

    def step():
        runner.observer.event("launch", 0.0, 1.0)
        runner.observer.event("read_wait", 2.0, 2.25)
        runner.observer.event("replay", 0.5, 0.75)  # neither a half nor a wait: not kept
        runner.counters.overlapped_rounds += 1

    steps = record_trace(runner, step, 2)
    assert runner.observer is None and len(steps) == 2
    assert all(s["events"] == [_event("launch", 0.0, 1.0)] for s in steps)
    assert [(s["read_wait_s"], s["overlapped_rounds"]) for s in steps] == [(0.25, 1)] * 2
    with pytest.raises(ZeroDivisionError):
        record_trace(runner, lambda: 1 / 0, 2)
    assert runner.observer is None


def test_padding_waste_policy():
    """Padding per batch size follows the bucket policy, splitting above the largest."""
    waste = padding_waste((1, 2, 4), 6)
    rows = {r["batch"]: (r["padded_rows"], r["chunks"]) for r in waste["per_batch_size"]}
    assert rows == {1: (0, 1), 2: (0, 1), 3: (1, 1), 4: (0, 1), 5: (0, 2), 6: (0, 2)}
    assert waste["waste"] == pytest.approx(1 / 21)


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
        assert b["round_trace"] == {"fused": None, "overlap": None}
        assert b["fused_vs_split_latency"] is None and b["overlap_vs_fused_latency"] is None
        assert b["eager"]["phase_times"]["phase_ms"]  # eager phases are still timed
        assert b["e2e"]["latency_ratio"] > 0  # eager spec vs eager plain
        assert b["e2e_sampled"]["latency_ratio"] > 0  # and sampling on eager engines
        assert b["e2e_sampled"]["sampled_chunks"]["spec"] > 0
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
