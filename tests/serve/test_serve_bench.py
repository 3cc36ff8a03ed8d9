"""``bench-serve`` on a small load: both modes serve the same greedy jobs over loopback,
agree token for token, and the JSON, Markdown table and plot are written; with both
engine hosts, four servers agree and the split / thread ratio is reported."""

from __future__ import annotations

import json

import pytest

from nextn_graph.cli import main
from nextn_graph.config import load_run_config
from nextn_graph.serve.bench.command import (engines_of, make_jobs, prefix_summary,
                                             run_bench_serve)
from nextn_graph.serve.bench.load import Load


@pytest.mark.heavy
def test_bench_serve_small_load(tmp_path):
    cfg = load_run_config(None, pool={"max_requests": 2, "max_context": 256},
                          graph={"sampling": False})
    jobs = make_jobs(256, 6, seed=3)
    loads = [Load("concurrency", 2, 6, 60.0), Load("rate", 50.0, 4, 60.0)]
    report = run_bench_serve(cfg, loads, jobs, tmp_path, engines=("thread",))  # (a fast start)
    rows = report["rows"]
    assert [(r["mode"], r["load"]) for r in rows] == [
        ("spec", "c=2"), ("plain", "c=2"), ("spec", "50 req/s"), ("plain", "50 req/s")]
    for r in rows:
        assert r["failed"] == 0 and r["ok"] == r["sent"]
        assert r["same_tokens"] == f"{r['sent']}/{r['sent']}"
        assert r["output_tokens"] > 0 and r["ttft_p50_ms"] > 0
    spec = rows[0]
    assert 1 <= spec["acceptance_length"] <= 4 and len(spec["acceptance_per_position"]) == 3
    assert rows[1]["acceptance_length"] is None  # plain decoding drafts nothing
    assert json.loads((tmp_path / "serve_bench.json").read_text())["rows"] == rows
    assert "| c=2 | spec | thread | on | 6/6 |" in (tmp_path / "serve_bench.md").read_text()
    assert (tmp_path / "serve_bench.png").stat().st_size > 0
    assert report["split_over_thread"] == {}  # one host: nothing to compare


@pytest.mark.process
def test_bench_serve_both_engines_repeated(tmp_path):
    """``--engine both --repeats 2``: every mode from an engine process and an engine
    thread, each load twice per server, the median run reported with both runs'
    throughputs; the four servers agree token for token; the ratio is that of the rows."""
    cfg = load_run_config(None, pool={"max_requests": 2, "max_context": 256},
                          graph={"sampling": False})
    jobs = make_jobs(256, 4, seed=5)
    report = run_bench_serve(cfg, [Load("concurrency", 2, 4, 60.0)], jobs, tmp_path,
                             engines=engines_of("both"), repeats=2)
    rows = {(r["mode"], r["engine"]): r for r in report["rows"]}
    assert set(rows) == {(m, e) for m in ("spec", "plain") for e in ("process", "thread")}
    for r in rows.values():
        assert r["failed"] == 0 and r["same_tokens"] == "4/4"
        assert len(r["throughput_each"]) == 2 and r["throughput_tok_s"] in r["throughput_each"]
    ratio = report["split_over_thread"]["c=2"]
    for mode in ("spec", "plain"):
        want = rows[mode, "process"]["throughput_tok_s"] / rows[mode, "thread"]["throughput_tok_s"]
        assert ratio[mode] == pytest.approx(want, rel=1e-3)
    md = (tmp_path / "serve_bench.md").read_text()
    assert "engine process / engine thread, c=2: spec" in md
    c = report["config"]  # dated, with the machine named
    assert c["date"].endswith(" UTC") and c["cpu"] and c["cores"] >= 1
    assert md.startswith(f"Serving bench, {c['date']} on {c['cpu']} x{c['cores']}: ")


@pytest.mark.parametrize("argv", [["bench-serve", "--concurrency", "0"],
                                  ["bench-serve", "--rates", "fast"]])
def test_bench_serve_refuses_bad_levels(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "expected" in capsys.readouterr().err


def test_bench_serve_bounds_requests(capsys):
    assert main(["bench-serve", "--requests", "5000"]) == 2
    assert "bounded" in capsys.readouterr().err


def test_shared_prefix_jobs_and_their_ideal_hit_rate():
    """--shared-prefix: each group of prompts starts with the same tokens, the next group
    with others; the ideal hit rate is every job but its group's first finding the prefix.
    Without it the jobs are those of before (the same draws)."""
    plain = make_jobs(256, 6, seed=3)
    assert make_jobs(256, 6, seed=3, shared_prefix=0) == plain
    jobs = make_jobs(256, 6, seed=3, shared_prefix=40, group=4)
    heads = [tuple(j.prompt[:40]) for j in jobs]
    assert heads[0] == heads[1] == heads[2] == heads[3] != heads[4] == heads[5]
    assert [len(j.prompt) - 40 for j in jobs] == [len(j.prompt) for j in plain]
    s = prefix_summary(jobs, 40, 4)
    prompt = sum(len(j.prompt) for j in jobs)
    assert s["shareable_tokens"] == 4 * 40 and s["prompt_tokens"] == prompt
    assert s["ideal_hit_rate"] == round(160 / prompt, 4)
    assert prefix_summary(plain, 0, 4)["ideal_hit_rate"] == 0.0


def test_a_shared_prefix_too_long_for_the_context_is_refused(capsys):
    assert main(["bench-serve", "--shared-prefix", "1000", "--requests", "1"]) == 2
    err = capsys.readouterr().err
    assert "--shared-prefix 1000" in err and "pool.max_context 512" in err


@pytest.mark.heavy
def test_bench_serve_with_shared_prefixes(tmp_path):
    """Prompts sharing a prefix serve like any others (both modes agree) and the report
    says what a prefix cache could serve of them."""
    cfg = load_run_config(None, pool={"max_requests": 2, "max_context": 256},
                          graph={"sampling": False})
    jobs = make_jobs(256, 4, seed=7, shared_prefix=48, group=2)
    report = run_bench_serve(cfg, [Load("concurrency", 2, 4, 60.0)], jobs, tmp_path,
                             engines=("thread",), shared_prefix=48, prefix_group=2)
    assert all(r["failed"] == 0 and r["same_tokens"] == "4/4" for r in report["rows"])
    j = report["jobs"]
    assert j["shared_prefix"] == 48 and j["shareable_tokens"] == 2 * 48
    assert "Shared prefixes: 48 tokens per group of 2 prompts" in (
        tmp_path / "serve_bench.md").read_text()
