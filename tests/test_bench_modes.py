"""The bench's round modes outside the shared small run of ``test_bench.py``: a config
whose round is split, the phase timer, and the end-to-end output length."""

from __future__ import annotations

import torch

from nextn_graph.bench import BenchSettings, run_bench
from nextn_graph.bench.measure import E2E_MAX_NEW, PhaseTimer, e2e_max_new
from nextn_graph.bench.report import table
from nextn_graph.config import PoolConfig, SpeculativeConfig, load_run_config
from nextn_graph.runtime.engine import SpecEngine


def test_split_config_measures_split_only(tmp_path):
    """A config whose round is split: its graph engine is the split one, no fused or
    overlap engine is built (their figures null, '-' in the table), and its phases are
    timed."""
    cfg = load_run_config(None, pool={"max_requests": 1, "max_context": 128},
                          graph={"buckets": [1], "round": "split"})
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


def test_phase_timer_sums_per_kind_in_round_order():
    """The tracer keeps one sum per phase kind, in the order the phases ran, adds a
    kind's repeated runs, and never syncs on CPU (every kernel has run on return)."""
    timer = PhaseTimer(torch.device("cpu"))
    assert timer.synchronized is False
    for _ in range(2):
        for kind in ("rollout", "target_verify", "draft_extend"):
            with timer(kind, True):
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
