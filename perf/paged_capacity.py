"""Requests decoding at once at a fixed KV pool size in bytes: paged compressed KV against
today's fixed rows (every row reserving max_context), on DeepSeek-V4-Flash's cache widths.

Both pools are real ``KVPool`` objects on the meta device (their sizes and allocator, no
memory) of V4-Flash's 43 layers (``v4-flash`` preset: window 128, head_dim 512, index
keys 128, its C4 / C128 layer pattern), bf16, verify width 4. The fixed pool is today's
layout: one page of max_context per row, ``--fixed-rows`` rows; its bytes are the budget.
The paged pool (256-position pages) spends the same bytes or fewer on more rows and the
pages they fill (every row count that fits is tried; the best is reported). Requests of
mixed prompt lengths (64 to 4,096 tokens, uniform and log-uniform), each with
``--max-new`` output tokens, are admitted first come first served with the engine's rule
(``Scheduler.positions``: prompt + max_new + lookahead reserved at admission) until the
head of the queue does not fit: that count decodes at once. With pages on demand
(``pool.allocation: grow``, the default) the same layout admits with the prompt's pages
and the first round's: the ``grow`` column, an upper bound (requests grow as they
decode, and the newest is preempted when the pages run out).

    python perf/paged_capacity.py [--fixed-rows 16] [--max-new 256] [--max-context C]
                                  [--snapshots-per-row K]

Host arithmetic only: no forward runs, nothing here is a device figure.
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.memory.pool import KVPool, PoolLayout, pool_nbytes

WIDTH = 4  # verify width N (depth 3)
LOOKAHEAD = 2  # S - 1 at depth 3, overlap off
PAGE = 256


def lengths(kind: str, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    if kind == "uniform":
        return [rng.randint(64, 4096) for _ in range(n)]
    return [int(math.exp(rng.uniform(math.log(64), math.log(4096)))) for _ in range(n)]


def admitted(pool: KVPool, prompts: list[int], max_new: int, grow: bool = False) -> int:
    """Requests admitted in order until the head does not fit (the scheduler's rule:
    ``Scheduler.reach``; ``grow``: the pages of the prompt and the first round only)."""
    n = 0
    for p in prompts:
        reach = p + (WIDTH + LOOKAHEAD if grow else max_new + LOOKAHEAD)
        if not pool.fits(reach):
            break
        pool.alloc(reach)
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fixed-rows", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--max-context", type=int, default=0,
                    help="the servers' max_context (0: the longest request, 4096 + max_new)")
    ap.add_argument("--snapshots-per-row", type=int, default=0,
                    help="prefix-cache snapshots the paged pool also pays for, per row "
                         "(the engine's default is 1; 0: the cache off)")
    args = ap.parse_args()
    cfg = preset_config("v4-flash")
    ratios = list(cfg.compress_ratios[:cfg.num_hidden_layers])
    context = -(-max(args.max_context, 4096 + args.max_new + LOOKAHEAD) // 128) * 128
    dtype = torch.bfloat16
    fixed = PoolLayout(args.fixed_rows, context, WIDTH, page_size=context)
    budget = pool_nbytes(cfg, fixed, ratios, dtype)
    print(f"V4-Flash caches ({len(ratios)} layers, bf16), max_context {context}, "
          f"max_new {args.max_new}, budget {budget / 2**30:.2f} GiB "
          f"(= {args.fixed_rows} fixed rows), prefix-cache snapshots per paged row: "
          f"{args.snapshots_per_row}")
    k = args.snapshots_per_row
    print(f"{'prompts':<12} {'fixed rows':>10} {'paged':>6} {'rows':>5} {'pages':>6} "
          f"{'ratio':>6} {'grow':>6} {'ratio':>6} {'mean prompt':>11}")
    for kind in ("uniform", "log-uniform"):
        prompts = lengths(kind, args.requests, seed=0)
        base = admitted(KVPool(cfg, fixed, ratios, device="meta", dtype=dtype), prompts,
                        args.max_new)
        got, rows, pages = best_layout(cfg, ratios, budget, context, prompts, args, False)
        grow = best_layout(cfg, ratios, budget, context, prompts, args, True)[0]
        print(f"{kind:<12} {base:>10} {got:>6} {rows:>5} {pages:>6} {got / base:>5.2f}x "
              f"{grow:>6} {grow / base:>5.2f}x {sum(prompts) / len(prompts):>11.0f}")


def best_layout(cfg, ratios, budget: int, context: int, prompts: list[int], args,
                grow: bool) -> tuple[int, int, int]:
    """The paged layout of at most ``budget`` bytes that admits the most -> (admitted,
    rows, pages): every row count from the fixed pool's up, the rest of the bytes in
    pages, until pages bind it."""
    dtype, k = torch.bfloat16, args.snapshots_per_row
    best = (0, 0, 0)
    rows = args.fixed_rows
    while True:
        probe = PoolLayout(rows, context, WIDTH, PAGE, num_pages=1, snapshots=k * rows)
        spare = budget - pool_nbytes(cfg, probe, ratios, dtype)
        per_page = pool_nbytes(cfg, PoolLayout(rows, context, WIDTH, PAGE, num_pages=2,
                                               snapshots=k * rows),
                               ratios, dtype) - pool_nbytes(cfg, probe, ratios, dtype)
        if spare < 0:
            break
        pages = 1 + spare // per_page
        layout = PoolLayout(rows, context, WIDTH, PAGE, num_pages=pages, snapshots=k * rows)
        assert pool_nbytes(cfg, layout, ratios, dtype) <= budget
        got = admitted(KVPool(cfg, layout, ratios, device="meta", dtype=dtype), prompts,
                       args.max_new, grow)
        best = max(best, (got, rows, pages))
        if got < rows:  # pages bound it: more rows only take bytes from pages
            break
        rows += max(1, args.fixed_rows // 8)
    return best

if __name__ == "__main__":
    main()
