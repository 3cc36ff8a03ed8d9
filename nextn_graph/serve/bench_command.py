"""``nextn-graph bench-serve``: the same load on a speculative and a plain server.

Each mode gets its own server on a loopback port of this process (``ServerThread``,
127.0.0.1 only; its engine in a process of its own, or with ``--engine thread`` on a
thread; both up at once, each load level run on one and then the other, so a
machine's drifting load hits both alike), built from the same config: speculative
decoding, and plain decoding (``speculative`` None) over the same pool and graphs.
Every load level (fixed concurrency, then Poisson rates) sends the same greedy jobs, so
the two modes' tokens must agree; the report says whether they did. Writes ``serve_bench.json``,
``serve_bench.md`` and ``serve_bench.png`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from ..checkpoint.corpus import corpus  # noqa: E402
from ..checkpoint.loader import resolve_checkpoint  # noqa: E402
from ..config import RunConfig, load_run_config  # noqa: E402
from ..errors import InputError  # noqa: E402
from ..model.config import load_config  # noqa: E402
from .bench import MAX_REQUESTS, Job, Load, run_load  # noqa: E402
from .limits import ServeSettings  # noqa: E402
from .thread import ServerThread  # noqa: E402

PROMPT_LENGTHS = (8, 16, 32, 64)  # mixed prompts, in the trained corpus' distribution
OUTPUT_LENGTHS = (16, 32, 64)
MODES = ("spec", "plain")
MAX_POOL = 32


def make_jobs(vocab: int, n: int, seed: int) -> list[Job]:
    rng, drawn = random.Random(seed), corpus(vocab, seed)
    return [Job(drawn.sample(rng.choice(PROMPT_LENGTHS)), rng.choice(OUTPUT_LENGTHS))
            for _ in range(n)]


def bench_config(args: argparse.Namespace) -> RunConfig:
    rows = args.max_requests or min(max(args.concurrency), MAX_POOL)
    # greedy jobs: no sampling graphs to capture
    return load_run_config(args.config, checkpoint=args.checkpoint,
                           pool={"max_requests": rows}, graph={"sampling": False})


def run_bench_serve(cfg: RunConfig, loads: list[Load], jobs: list[Job], out: Path,
                    seed: int = 0, engine: str = ServeSettings.engine) -> dict:
    rows, tokens = [], {}
    settings = ServeSettings(port=0, max_waiting=MAX_REQUESTS, engine=engine)
    with contextlib.ExitStack() as stack:
        servers = {}
        for mode in MODES:
            start = time.perf_counter()
            servers[mode] = stack.enter_context(ServerThread(cfg, settings, plain=mode == "plain"))
            servers[mode].startup_s = round(time.perf_counter() - start, 2)
        for load in loads:  # the modes back to back, so drifting machine load hits both
            for mode, srv in servers.items():
                summary, samples = run_load(srv.url, load, jobs, seed)
                rows.append({"mode": mode, "startup_s": srv.startup_s, **summary})
                tokens[(mode, load.label)] = [s.tokens if s and not s.error else None
                                              for s in samples]
    for row in rows:  # greedy: speculative and plain decoding agree token for token
        a, b = tokens[("spec", row["load"])], tokens[("plain", row["load"])]
        both = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
        row["same_tokens_as_other_mode"] = f"{sum(x == y for x, y in both)}/{len(both)}"
    report = {"config": {"checkpoint": cfg.checkpoint, "num_steps": cfg.speculative.num_steps,
                         "pool": vars(cfg.pool), "graph_backend": cfg.graph.backend,
                         "buckets": list(cfg.graph.buckets), "device": cfg.device,
                         "engine": engine},
              "jobs": {"count": len(jobs), "prompt_lengths": PROMPT_LENGTHS,
                       "output_lengths": OUTPUT_LENGTHS, "seed": seed},
              "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "serve_bench.md").write_text(markdown(report) + "\n")
    plot(rows, out / "serve_bench.png")
    return report


def _pair(row: dict, key: str) -> str:
    lo, hi = row[f"{key}_p50_ms"], row[f"{key}_p99_ms"]
    return "-" if lo is None else f"{lo:.1f} / {hi:.1f}"


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"Serving bench: {c['checkpoint']} on {c['device']} ({c['graph_backend']} graphs, "
             f"buckets {c['buckets']}), num_steps {c['num_steps']}, "
             f"{c['pool']['max_requests']} pool rows, engine in a {c['engine']}; greedy, prompts "
             f"{report['jobs']['prompt_lengths']} x outputs {report['jobs']['output_lengths']} "
             f"tokens.", "",
             "| load | mode | ok/sent | tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| ITL p50 / p99 ms | accept len | accept per position | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = list(dict.fromkeys(r["load"] for r in report["rows"]))
    for r in sorted(report["rows"], key=lambda r: (order.index(r["load"]), r["mode"] != "spec")):
        accept = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        per = ", ".join(f"{p:.2f}" for p in r["acceptance_per_position"]) or "-"
        lines.append(f"| {r['load']} | {r['mode']} | {r['ok']}/{r['sent']} | "
                     f"{r['throughput_tok_s']} | {r['requests_per_s']} | {_pair(r, 'ttft')} | "
                     f"{_pair(r, 'tpot')} | {_pair(r, 'itl')} | {accept} | {per} | "
                     f"{r['same_tokens_as_other_mode']} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    loads = list(dict.fromkeys(r["load"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode, style in zip(MODES, ("o-", "s--")):
        mine = {r["load"]: r for r in rows if r["mode"] == mode}
        for ax, key, title in zip(axes, ("throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms"),
                                  ("output tokens / s", "TTFT p50 (ms)", "TPOT p50 (ms)")):
            ax.plot(loads, [mine[x][key] or 0 for x in loads], style, label=mode)
            ax.set_title(title)
            ax.set_xlabel("load")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench_serve_command(args: argparse.Namespace) -> int:
    if args.requests > MAX_REQUESTS:
        raise InputError(f"bench-serve: --requests is bounded by {MAX_REQUESTS}")
    cfg = bench_config(args)
    loads = [Load("concurrency", c, args.requests, args.time_limit) for c in args.concurrency]
    loads += [Load("rate", r, args.requests, args.time_limit) for r in args.rates]
    vocab = load_config(resolve_checkpoint(cfg.checkpoint) / "config.json").vocab_size
    jobs = make_jobs(vocab, args.requests, args.seed)
    report = run_bench_serve(cfg, loads, jobs, Path(args.out), args.seed, args.engine)
    print(markdown(report))
    print(f"wrote serve_bench.json, serve_bench.md and serve_bench.png in {args.out}")
    return 0
