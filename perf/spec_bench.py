"""Speculative vs plain decoding, eager, measured in one run.

For each batch size and num_steps: acceptance length (tokens per request-round,
bonus included), strict draft acceptance rate, eager round time next to the plain
decode step time, and the decode speed-up they imply (decode tokens per second,
prefill excluded). Outputs are checked equal before any figure is printed.

    python perf/spec_bench.py                       # tiny trained checkpoint, CPU
    python perf/spec_bench.py --steps 3 --batch 1 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from nextn_graph.checkpoint import load_checkpoint  # noqa: E402
from nextn_graph.config import SpeculativeConfig, load_run_config  # noqa: E402
from nextn_graph.runtime.generate import plain_generate  # noqa: E402
from nextn_graph.runtime.engine import SpecEngine  # noqa: E402
from nextn_graph.checkpoint.corpus import corpus  # noqa: E402


def _decode_rate(tokens: int, requests: int, seconds: float) -> float:
    """Tokens per second after prefill (each request's first token comes from prefill)."""
    return (tokens - requests) / seconds if seconds > 0 else float("nan")


def bench_one(models, run_cfg, prompts, num_steps: int, max_new: int, repeats: int) -> dict:
    spec = SpeculativeConfig(num_steps=num_steps, num_draft_tokens=num_steps + 1)
    pool = replace(run_cfg.pool, max_requests=max(run_cfg.pool.max_requests, len(prompts)))
    plain_runs, spec_runs = [], []
    for _ in range(repeats):  # interleaved, so drift hits both alike
        plain = plain_generate(models.target, prompts, max_new, stop_ids=set(),
                               max_context=pool.max_context)
        engine = SpecEngine(models.target, models.draft, spec, pool)
        res = engine.generate(prompts, max_new, stop_ids=[])
        if res.outputs != plain.outputs:
            raise SystemExit(f"num_steps {num_steps}: speculative output differs from plain")
        plain_runs.append(plain.stats)
        spec_runs.append(res.stats)
    b = len(prompts)
    plain_rate = [_decode_rate(s["generated_tokens"], b, s["decode_s"]) for s in plain_runs]
    spec_rate = [_decode_rate(s["emitted_tokens"], b, s["round_s"]) for s in spec_runs]
    st = spec_runs[0]
    return {
        "batch": b, "num_steps": num_steps, "verify_width": num_steps + 1,
        "acceptance_length": st["acceptance_length"],
        "draft_acceptance_rate": st["draft_acceptance_rate"],
        "nextn_forwards_per_round": (st["nextn_extend_forwards"] - 1 + st["nextn_decode_forwards"])
        / st["rounds"],
        "round_ms_median": statistics.median(s["round_ms"] for s in spec_runs),
        "plain_step_ms_median": statistics.median(s["step_ms"] for s in plain_runs),
        "spec_tokens_per_s": statistics.median(spec_rate),
        "plain_tokens_per_s": statistics.median(plain_rate),
        "speedup": statistics.median(spec_rate) / statistics.median(plain_rate),
        "noise": {"round_ms": [round(s["round_ms"], 3) for s in spec_runs],
                  "plain_step_ms": [round(s["step_ms"], 3) for s in plain_runs]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="YAML run config (default: embedded)")
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3, 5])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write every figure here")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)  # tiny widths: threads only add barrier waits
    run_cfg = load_run_config(args.config)
    models = load_checkpoint(run_cfg.checkpoint)
    drawn = corpus(models.cfg.vocab_size, 11)
    rows = []
    print(f"{'batch':>5} {'S':>2} {'acc len':>7} {'strict':>6} {'round ms':>9} "
          f"{'plain ms':>9} {'spec tok/s':>10} {'plain tok/s':>11} {'speedup':>7}")
    for b in args.batch:
        prompts = [drawn.sample(16 + 8 * i) for i in range(b)]
        for s in args.steps:
            r = bench_one(models, run_cfg, prompts, s, args.max_new_tokens, args.repeats)
            rows.append(r)
            print(f"{b:>5} {s:>2} {r['acceptance_length']:>7.2f} "
                  f"{r['draft_acceptance_rate']:>6.2f} {r['round_ms_median']:>9.2f} "
                  f"{r['plain_step_ms_median']:>9.2f} {r['spec_tokens_per_s']:>10.1f} "
                  f"{r['plain_tokens_per_s']:>11.1f} {r['speedup']:>7.2f}")
    if args.json:
        meta = {"config": args.config or "embedded default", "checkpoint": run_cfg.checkpoint,
                "torch": torch.__version__, "machine": platform.platform(),
                "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats}
        Path(args.json).write_text(json.dumps({"settings": meta, "runs": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
