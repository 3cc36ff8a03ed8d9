"""The split server against the in-thread one: the same streamed greedy load on a server
whose engine runs in its own process (``nextn-graph serve``'s default) and on one whose
engine runs on a thread of the HTTP process (``--engine-thread``), output tokens per
second and the ratio.

Both servers are up at once (loopback ports of this process, ``ServerThread``), built
from one config (speculative decoding, greedy graphs only). The load's client runs in a
process of its own, so this one holds the servers' HTTP sides alone (and the thread
server's engine). Each repeat runs the load on one server and then the other, so a
machine's drifting load hits both alike; one untimed warm-up level each goes first. Greedy: the two servers' tokens must agree, and the
report says whether they did. Prints a table and the ratio of the medians; ``--out
FILE`` writes the figures as JSON too.

    python perf/serve_split.py [--concurrency 32] [--requests 96] [--repeats 3]
        [--config FILE] [--max-requests 32] [--threads 1] [--out split.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from nextn_graph.checkpoint.loader import resolve_checkpoint  # noqa: E402
from nextn_graph.config import load_run_config  # noqa: E402
from nextn_graph.model.config import load_config  # noqa: E402
from nextn_graph.serve.bench import MAX_REQUESTS, Load, run_load  # noqa: E402
from nextn_graph.serve.bench_command import make_jobs  # noqa: E402
from nextn_graph.serve.limits import ENGINE_HOSTS, ServeSettings  # noqa: E402
from nextn_graph.serve.thread import ServerThread  # noqa: E402

FIGURES = ("throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms", "itl_p50_ms")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="YAML run config (default: the embedded CPU one)")
    p.add_argument("--checkpoint", help="override the config's checkpoint")
    p.add_argument("--concurrency", type=int, default=32, help="requests at once")
    p.add_argument("--requests", type=int, default=96, help="requests per repeat")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per server")
    p.add_argument("--max-requests", type=int, default=32, help="pool rows")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    p.add_argument("--time-limit", type=float, default=300.0, help="seconds per repeat")
    p.add_argument("--seed", type=int, default=0, help="the prompts")
    p.add_argument("--out", help="write the figures as JSON here too")
    args = p.parse_args()
    if not 1 <= args.requests <= MAX_REQUESTS or args.repeats < 1 or args.concurrency < 1:
        p.error(f"--requests must be in [1, {MAX_REQUESTS}], --repeats and --concurrency "
                f">= 1")
    return args


def median_row(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in FIGURES}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)  # the engine process takes this setting too
    cfg = load_run_config(args.config, checkpoint=args.checkpoint,
                          pool={"max_requests": args.max_requests},
                          graph={"sampling": False})
    vocab = load_config(resolve_checkpoint(cfg.checkpoint) / "config.json").vocab_size
    jobs = make_jobs(vocab, args.requests, args.seed)
    load = Load("concurrency", args.concurrency, args.requests, args.time_limit)
    warm = Load("concurrency", args.concurrency, min(args.requests, args.concurrency),
                args.time_limit)
    rows: dict[str, list[dict]] = {mode: [] for mode in ENGINE_HOSTS}
    tokens: dict[str, list] = {}
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")))
        servers = {mode: stack.enter_context(ServerThread(cfg, ServeSettings(
            port=0, max_waiting=MAX_REQUESTS, engine=mode))) for mode in ENGINE_HOSTS}
        for srv in servers.values():
            client.submit(run_load, srv.url, warm, jobs).result()
        for _ in range(args.repeats):
            for mode, srv in servers.items():
                summary, samples = client.submit(run_load, srv.url, load, jobs).result()
                rows[mode].append(summary)
                tokens[mode] = [s.tokens if s and not s.error else None for s in samples]
    both = [(a, b) for a, b in zip(*tokens.values()) if a is not None and b is not None]
    medians = {mode: median_row(r) for mode, r in rows.items()}
    ratio = medians["process"]["throughput_tok_s"] / medians["thread"]["throughput_tok_s"]
    print(f"{cfg.checkpoint} on {cfg.device}, {args.max_requests} pool rows, "
          f"concurrency {args.concurrency}, {args.requests} requests x {args.repeats} "
          f"repeats, torch threads {args.threads} ({time.perf_counter() - start:.0f} s)\n")
    print("| engine | tok/s (each repeat) | tok/s median | TTFT p50 ms | TPOT p50 ms "
          "| ITL p50 ms | failed |")
    print("|---|---|---|---|---|---|---|")
    for mode, mine in rows.items():
        m = medians[mode]
        each = ", ".join(f"{r['throughput_tok_s']:.1f}" for r in mine)
        print(f"| {mode} | {each} | {m['throughput_tok_s']:.1f} | {m['ttft_p50_ms']:.1f} | "
              f"{m['tpot_p50_ms']:.1f} | {m['itl_p50_ms']:.1f} | "
              f"{sum(r['failed'] for r in mine)} |")
    same = sum(a == b for a, b in both)
    print(f"\noutput throughput, process / thread: {ratio:.3f}x; same tokens: "
          f"{same}/{len(both)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows,
                                              "medians": medians, "ratio": ratio,
                                              "same_tokens": [same, len(both)]}, indent=2))
    return 0 if same == len(both) and all(r["failed"] == 0 for v in rows.values()
                                          for r in v) else 1


if __name__ == "__main__":  # (spawn: the engine process imports this file again)
    sys.exit(main())
