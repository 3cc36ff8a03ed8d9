"""Chunked prefill: running streams' per-step latency while long prompts arrive.

Two requests decode all along (the running streams); prompts of ``--prompt-len``
tokens (2,048 by default) arrive every ``--every`` steps. Each step gives every
running stream one round, so a step's wall time is their inter-token latency. With
an unlimited prefill budget a long prompt is prefilled whole inside one step and
stalls the streams for all of it; with ``scheduler.prefill_token_budget`` B it goes
in chunks of B tokens, one chunk a step. Printed: the streams' step latency p50 / p99
/ max (ms) and the long prompts' time to first token (arrival to bonus), per
budget, measured in one run, with the ratios to the unlimited budget. Every
budget's tokens are checked equal to the unlimited budget's before anything is
printed.

Model: the tiny preset (random weights, so acceptance is low; a round's cost does
not depend on it) with max_position_embeddings 4096, so the pool's max_context fits
the prompts; the rounds are the cpu backend's fused graphs (graph.overlap on).

    python perf/chunked_prefill.py                          # budgets 0 (unlimited), 256
    python perf/chunked_prefill.py --budgets 0 128 256 512 --prompts 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from nextn_graph.checkpoint import random_models  # noqa: E402
from nextn_graph.config import (GraphConfig, PoolConfig, SchedulerConfig,  # noqa: E402
                                SpeculativeConfig)
from nextn_graph.model.config import config_from_dict  # noqa: E402
from nextn_graph.checkpoint.presets import TINY  # noqa: E402
from nextn_graph.runtime.engine import SpecEngine  # noqa: E402

STREAMS = 2  # running requests decoding all along
FIRST_ARRIVAL = 4  # steps of steady decoding before the first long prompt


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def run_budget(models, budget: int, args) -> dict:
    """One engine at ``budget``: the streams' step latencies (ms), the long prompts' time
    to first token (ms), and every request's tokens (checked across budgets)."""
    pool = PoolConfig(STREAMS + 2, args.prompt_len + 256)
    graph = GraphConfig(backend="cpu", buckets=(1, 2, STREAMS + 2), round="fused",
                        overlap="on", sampling=False)
    eng = SpecEngine(models.target, models.draft, SpeculativeConfig(num_steps=3), pool, graph,
                     scheduler=SchedulerConfig(budget))
    gen = torch.Generator().manual_seed(0)
    streams = [eng.add_request(torch.randint(2, 256, (16,), generator=gen).tolist(),
                               pool.max_context - 64, stop_ids=[]) for _ in range(STREAMS)]
    arrivals = {FIRST_ARRIVAL + k * args.every: torch.randint(
        2, 256, (args.prompt_len,), generator=gen).tolist() for k in range(args.prompts)}
    arrived, ttft, step_ms, tokens = {}, [], [], {}
    step = 0
    while step < FIRST_ARRIVAL + args.prompts * args.every or len(ttft) < args.prompts:
        if step in arrivals:
            arrived[eng.add_request(arrivals[step], 4, stop_ids=[])] = time.perf_counter()
        start = time.perf_counter()
        outs = eng.step()
        end = time.perf_counter()
        got = {o.rid for o in outs if o.new_tokens}
        if step >= 2 and all(s in got for s in streams):  # after the streams' own prefill
            step_ms.append(1000 * (end - start))
        for o in outs:
            tokens.setdefault(o.rid, []).extend(o.new_tokens)
            if o.rid in arrived and o.new_tokens and o.rid not in {r for r, _ in ttft}:
                ttft.append((o.rid, 1000 * (end - arrived[o.rid])))
        step += 1
    for rid in streams:
        eng.abort(rid)
    while eng.has_work:
        eng.step()
    return {"budget": budget, "steps": step, "step_ms": step_ms,
            "ttft_ms": [t for _, t in ttft], "tokens": tokens,
            "prefill_chunks": eng.stats.prefill_chunks}


def table(results: list[dict]) -> str:
    base = results[0]
    p99_0, ttft_0 = percentile(base["step_ms"], 99), statistics.mean(base["ttft_ms"])
    rows = ["| prefill_token_budget | steps | stream step p50 (ms) | p99 (ms) | max (ms) "
            "| p99 / unlimited | long prompt TTFT (ms) | TTFT / unlimited |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ms, ttft = r["step_ms"], statistics.mean(r["ttft_ms"])
        p99 = percentile(ms, 99)
        rows.append(f"| {r['budget'] or 'unlimited'} | {len(ms)} | {percentile(ms, 50):.1f} "
                    f"| {p99:.1f} | {max(ms):.1f} | {p99 / p99_0:.2f} | {ttft:.0f} "
                    f"| {ttft / ttft_0:.2f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 256],
                    help="prefill token budgets; the first is the baseline (0 = unlimited)")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=3, help="long prompts per budget")
    ap.add_argument("--every", type=int, default=14, help="steps between long prompts")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = config_from_dict({**TINY, "max_position_embeddings": 4096}, "perf tiny-4k")
    models = random_models(cfg, seed=0)
    start = time.perf_counter()
    with torch.no_grad():
        results = [run_budget(models, b, args) for b in args.budgets]
    for r in results[1:]:  # (the streams ran for more or fewer steps: their prefixes)
        for rid, want in results[0]["tokens"].items():
            got = r["tokens"][rid]
            if got[:len(want)] != want[:len(got)]:
                raise SystemExit(f"budget {r['budget']}: request {rid}'s tokens differ "
                                 f"from budget {results[0]['budget']}'s")
    print(f"{STREAMS} running streams, {args.prompts} prompts of {args.prompt_len} tokens "
          f"every {args.every} steps; tiny preset (max_position_embeddings 4096), cpu fused "
          f"graphs, {args.threads} thread(s); tokens equal across budgets; "
          f"{time.perf_counter() - start:.0f} s\n")
    print(table(results))


if __name__ == "__main__":
    main()
