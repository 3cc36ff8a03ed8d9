"""``nextn-graph bench-serve``: the same load on a speculative and a plain server, with
the engine in its own process, on a thread of the server's, or both.

Each (mode, engine) pair gets its own server on a loopback port of this process
(``ServerThread``, 127.0.0.1 only), all built from one config and up at once:
speculative decoding, and plain decoding (``speculative`` None) over the same pool and
graphs; ``--engine both`` serves each mode from an engine process and from an engine
thread (the split server against the in-thread one). Each load level (fixed
concurrency, then Poisson rates) runs on every server in turn, ``--repeats`` times, so
a machine's drifting load hits all alike; the load's client is a process of its own.
Every level sends the same greedy jobs, so all servers' tokens must agree; the report
says whether they did. Writes ``serve_bench.json``, ``serve_bench.md`` and
``serve_bench.png`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from ...checkpoint.corpus import corpus  # noqa: E402
from ...checkpoint.loader import resolve_checkpoint  # noqa: E402
from ...config import RunConfig, load_run_config  # noqa: E402
from ...errors import InputError  # noqa: E402
from ...machine import run_stamp  # noqa: E402
from ...model.config import load_config  # noqa: E402
from ..front.limits import ENGINE_HOSTS, ServeSettings  # noqa: E402
from ..thread import ServerThread  # noqa: E402
from . import prefix as prefix_bench  # noqa: E402
from .load import MAX_REQUESTS, Job, Load, run_load  # noqa: E402
from .prefix import CACHES, prefix_summary, with_cache  # noqa: E402

PROMPT_LENGTHS = (8, 16, 32, 64)  # mixed prompts, in the trained corpus' distribution
OUTPUT_LENGTHS = (16, 32, 64)
MODES = ("spec", "plain")
MAX_POOL = 32


def make_jobs(vocab: int, n: int, seed: int, shared_prefix: int = 0,
              group: int = 4) -> list[Job]:
    """Mixed prompts and output lengths. ``shared_prefix`` > 0: each run of ``group``
    consecutive jobs starts with the same ``shared_prefix`` tokens (a system prompt or a
    few-shot template), then its own prompt; the next group has another prefix."""
    rng, drawn = random.Random(seed), corpus(vocab, seed)
    jobs, prefix = [], []
    for i in range(n):
        if shared_prefix and i % group == 0:
            prefix = drawn.sample(shared_prefix)
        jobs.append(Job(prefix + drawn.sample(rng.choice(PROMPT_LENGTHS)),
                        rng.choice(OUTPUT_LENGTHS)))
    return jobs


def bench_config(args: argparse.Namespace) -> RunConfig:
    rows = args.max_requests or min(max(args.concurrency), MAX_POOL)
    # greedy jobs: no sampling graphs to capture
    return load_run_config(args.config, checkpoint=args.checkpoint,
                           pool={"max_requests": rows}, graph={"sampling": False})


def engines_of(choice: str) -> tuple[str, ...]:
    """``--engine``: one host, or ``both`` (the split server against the in-thread one)."""
    return ENGINE_HOSTS if choice == "both" else (choice,)


def run_bench_serve(cfg: RunConfig, loads: list[Load], jobs: list[Job], out: Path,
                    seed: int = 0, engines: tuple[str, ...] = (ServeSettings.engine,),
                    repeats: int = 1, shared_prefix: int = 0, prefix_group: int = 4,
                    vocab: int | None = None) -> dict:
    """Every (mode, engine, cache) server up at once; each load level runs ``repeats``
    times on every server in turn (a machine's drifting load hits all alike), and the
    repeat with the median throughput stands for it. The load's client runs in a process
    of its own, so this process holds the servers' HTTP sides (and the thread servers'
    engines) alone. ``shared_prefix``: the prefix cache on and off (``prefix.py``),
    and with ``vocab``, fresh prefixes for every level and repeat after the first."""
    caches = CACHES if shared_prefix else ("on" if cfg.pool.prefix_cache else "off",)
    keys = [(mode, engine, cache) for cache in caches for engine in engines for mode in MODES]
    rows, tokens, run = [], {}, 0
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")))
        servers = {}
        for mode, engine, cache in keys:
            start = time.perf_counter()
            settings = ServeSettings(port=0, max_waiting=MAX_REQUESTS, engine=engine)
            srv = stack.enter_context(ServerThread(with_cache(cfg, cache), settings,
                                                   plain=mode == "plain"))
            servers[mode, engine, cache] = srv, round(time.perf_counter() - start, 2)
        for load in loads:
            runs: dict[tuple, list[dict]] = {key: [] for key in keys}
            for _ in range(repeats):
                level_jobs = jobs if not (shared_prefix and vocab and run) else make_jobs(
                    vocab, len(jobs), seed + run, shared_prefix, prefix_group)
                ideal = prefix_summary(level_jobs, shared_prefix, prefix_group,
                                       cfg.pool.page_size)
                run += 1
                for key, (srv, _) in servers.items():
                    summary, samples = client.submit(run_load, srv.url, load, level_jobs,
                                                     seed).result()
                    runs[key].append({**summary, "ideal_paged_hit_rate":
                                      ideal.get("ideal_paged_hit_rate", 0.0)})
                    tokens[key + (load.label,)] = [s.tokens if s and not s.error else None
                                                   for s in samples]
            for (mode, engine, cache), mine in runs.items():
                each = [r["throughput_tok_s"] or 0.0 for r in mine]
                median = sorted(mine, key=lambda r: r["throughput_tok_s"] or 0.0)[len(mine) // 2]
                rows.append({"mode": mode, "engine": engine, "cache": cache,
                             "startup_s": servers[mode, engine, cache][1],
                             **median, "throughput_each": each,
                             "failed": sum(r["failed"] for r in mine)})
    for row in rows:  # greedy: every server gives every job the same tokens
        mine = tokens[(row["mode"], row["engine"], row["cache"], row["load"])]
        others = [tokens[key + (row["load"],)] for key in keys
                  if key != (row["mode"], row["engine"], row["cache"])]
        pairs = [(x, [o[i] for o in others]) for i, x in enumerate(mine) if x is not None]
        same = sum(all(y is None or y == x for y in ys) for x, ys in pairs)
        row["same_tokens"] = f"{same}/{len(pairs)}"
    report = {"config": {"checkpoint": cfg.checkpoint, "num_steps": cfg.speculative.num_steps,
                         "pool": vars(cfg.pool), "graph_backend": cfg.graph.backend,
                         "buckets": list(cfg.graph.buckets), "device": cfg.device,
                         "engines": list(engines), "repeats": repeats, **run_stamp()},
              "jobs": {"count": len(jobs), "prompt_lengths": PROMPT_LENGTHS,
                       "output_lengths": OUTPUT_LENGTHS, "seed": seed,
                       **prefix_summary(jobs, shared_prefix, prefix_group,
                                        cfg.pool.page_size)},
              "rows": rows, "split_over_thread": split_ratios(rows),
              "prefix_cache": prefix_bench.comparisons(rows)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "serve_bench.md").write_text(markdown(report) + "\n")
    plot(rows, out / "serve_bench.png")
    return report


def split_ratios(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{load: {mode: the engine process's output throughput / the engine thread's}},
    where both ran."""
    by = {(r["load"], r["mode"], r["engine"]): r["throughput_tok_s"] for r in rows
          if r["cache"] == rows[0]["cache"]}
    ratios: dict[str, dict[str, float]] = {}
    for (load, mode, engine), value in by.items():
        thread = by.get((load, mode, "thread"))
        if engine == "process" and value and thread:
            ratios.setdefault(load, {})[mode] = round(value / thread, 3)
    return ratios


def _pair(row: dict, key: str) -> str:
    lo, hi = row[f"{key}_p50_ms"], row[f"{key}_p99_ms"]
    return "-" if lo is None else f"{lo:.1f} / {hi:.1f}"


def markdown(report: dict) -> str:
    c = report["config"]
    lines = [f"Serving bench, {c['date']} on {c['cpu']} x{c['cores']}: "
             f"{c['checkpoint']} on {c['device']} ({c['graph_backend']} graphs, "
             f"buckets {c['buckets']}), num_steps {c['num_steps']}, "
             f"{c['pool']['max_requests']} pool rows, engine in a "
             f"{' and in a '.join(c['engines'])}, the median of {c['repeats']} repeat(s); "
             f"greedy, prompts {report['jobs']['prompt_lengths']} x outputs "
             f"{report['jobs']['output_lengths']} tokens.", "",
             "| load | mode | engine | prefix cache | ok/sent | tok/s | req/s "
             "| TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | accept len "
             "| accept per position | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = list(dict.fromkeys(r["load"] for r in report["rows"]))
    for r in sorted(report["rows"], key=lambda r: (order.index(r["load"]), r["mode"] != "spec",
                                                   r["engine"] != "process", r["cache"])):
        accept = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        per = ", ".join(f"{p:.2f}" for p in r["acceptance_per_position"]) or "-"
        lines.append(f"| {r['load']} | {r['mode']} | {r['engine']} | {r['cache']} | "
                     f"{r['ok']}/{r['sent']} | "
                     f"{r['throughput_tok_s']} | {r['requests_per_s']} | {_pair(r, 'ttft')} | "
                     f"{_pair(r, 'tpot')} | {_pair(r, 'itl')} | {accept} | {per} | "
                     f"{r['same_tokens']} |")
    for load, ratio in report["split_over_thread"].items():
        each = ", ".join(f"{mode} {value:.2f}x" for mode, value in ratio.items())
        lines.append(f"\nOutput throughput, engine process / engine thread, {load}: {each}")
    return "\n".join(lines + prefix_bench.markdown(report))


def plot(rows: list[dict], path: Path) -> None:
    loads = list(dict.fromkeys(r["load"] for r in rows))
    keys = list(dict.fromkeys((r["mode"], r["engine"], r["cache"]) for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    styles = ("o-", "s--", "^-", "v--", "o:", "s-.", "^:", "v-.")
    for (mode, engine, cache), style in zip(keys, styles):
        mine = {r["load"]: r for r in rows if (r["mode"], r["engine"], r["cache"]) ==
                (mode, engine, cache)}
        for ax, key, title in zip(axes, ("throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms"),
                                  ("output tokens / s", "TTFT p50 (ms)", "TPOT p50 (ms)")):
            ax.plot(loads, [mine[x][key] or 0 for x in loads], style,
                    label=f"{mode}, {engine}, prefix cache {cache}")
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
    longest = args.shared_prefix + max(PROMPT_LENGTHS) + max(OUTPUT_LENGTHS)
    room = cfg.pool.max_context - cfg.speculative.num_steps  # (the verify lookahead)
    if longest > room:
        raise InputError(f"bench-serve: --shared-prefix {args.shared_prefix} + the longest "
                         f"prompt ({max(PROMPT_LENGTHS)}) and output ({max(OUTPUT_LENGTHS)}) "
                         f"tokens exceed the {room} positions a request may use "
                         f"(pool.max_context {cfg.pool.max_context})")
    vocab = load_config(resolve_checkpoint(cfg.checkpoint) / "config.json").vocab_size
    jobs = make_jobs(vocab, args.requests, args.seed, args.shared_prefix, args.prefix_group)
    report = run_bench_serve(cfg, loads, jobs, Path(args.out), args.seed,
                             engines_of(args.engine), args.repeats, args.shared_prefix,
                             args.prefix_group, vocab)
    print(markdown(report))
    print(f"wrote serve_bench.json, serve_bench.md and serve_bench.png in {args.out}")
    return 0
