"""Count aten ops in one batch-1 decode forward of the tiny target and of its NextN draft.

Eager launch overhead scales with the op count, which is what graph capture removes;
this script measures it. Every op reaching the dispatcher is counted (after composite
decomposition); "non-view" leaves out aliasing ops (view, expand, slice, t, ...), which
launch no kernel.

    python perf/op_count.py          # table
    python perf/op_count.py --json   # the same numbers as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from nextn_graph.checkpoint import random_models  # noqa: E402
from nextn_graph.profile.counting import OpCounter  # noqa: E402
from nextn_graph.memory.batch import Chunk, ForwardBatch  # noqa: E402
from nextn_graph.memory.pool import PoolLayout  # noqa: E402
from nextn_graph.checkpoint.presets import preset_config  # noqa: E402


def count(fn) -> dict:
    with torch.no_grad(), OpCounter() as counter:
        fn()
    return counter.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--position", type=int, default=40, help="decode position (prompt length)")
    args = parser.parse_args()

    cfg = preset_config("tiny")
    models = random_models(cfg, seed=0)
    target, draft = models.target, models.draft

    p = args.position
    ids = torch.randint(2, cfg.vocab_size, (p + 1,), generator=torch.Generator().manual_seed(0))
    layout = PoolLayout(max_requests=1, max_context=p + 8, verify_width=4)
    t_pool, d_pool = target.new_pool(layout), draft.new_pool(layout)
    row = t_pool.alloc()
    assert d_pool.alloc() == row  # the draft shares the target's request numbering
    prefill = ForwardBatch.from_chunks([Chunk(row, 0, ids[:p].tolist())])
    decode = ForwardBatch.from_chunks([Chunk(row, p, ids[p:].tolist())])  # 1 row
    with torch.no_grad():
        hidden = target(prefill, t_pool).hidden  # [p, hc*H]
        draft(prefill, hidden, d_pool)
        step_hidden = target.reference(ids).hidden[p:]  # [1, hc*H]

    results = {
        "target_decode": count(lambda: target(decode, t_pool)),
        "nextn_decode": count(lambda: draft(decode, step_hidden, d_pool)),
    }
    results["meta"] = {"preset": "tiny", "batch": 1, "rows": 1, "position": p,
                       "layers": cfg.num_hidden_layers, "torch": torch.__version__}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"aten ops, one forward, batch 1, position {p} (tiny preset)")
    print(f"{'forward':<15}{'total':>8}{'non-view':>10}  top ops")
    for name in ("target_decode", "nextn_decode"):
        r = results[name]
        top = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in r["top"].items())
        print(f"{name:<15}{r['total']:>8}{r['non_view']:>10}  {top}")


if __name__ == "__main__":
    main()
