"""Round time against the number of routed experts, at a fixed top-k, in one run.

A mid-width DeepSeek-V4 (hidden 1024, 4 layers, top-6 of E routed experts of 512)
is built with random weights at E and 2E experts (and, with ``--quantized``, also
stored FP8 + FP4 as the release ships it). Each runs the same speculative requests
eagerly through ``SpecEngine``; the median steady round time is reported, and the
ratio 2E / E. With sparse routing the work follows the experts that have rows, at
most T*k per forward, not E, so the ratio stays near 1 (issue 19: under 1.10) while
T*k is small against E; as T*k nears E, more distinct experts get rows at 2E (the
expected count is printed), and reading them is real work. Repeats are interleaved
so that drift hits every model alike.

    python perf/moe_scaling.py                     # E = 64 vs 128, batch 1 and 4
    python perf/moe_scaling.py --experts 32 --batch 1 --quantized --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from nextn_graph.checkpoint import random_models, save_checkpoint  # noqa: E402
from nextn_graph.config import PoolConfig, SpeculativeConfig  # noqa: E402
from nextn_graph.checkpoint.loader import load_checkpoint  # noqa: E402
from nextn_graph.model import config_from_dict  # noqa: E402
from nextn_graph.checkpoint.presets import TINY  # noqa: E402
from nextn_graph.runtime.engine import SpecEngine  # noqa: E402

MID = {**TINY, "vocab_size": 4096, "hidden_size": 1024, "num_attention_heads": 8,
       "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 256, "o_lora_rank": 128,
       "o_groups": 4, "moe_intermediate_size": 512, "num_experts_per_tok": 6,
       "index_n_heads": 4, "index_head_dim": 64, "index_topk": 16, "sliding_window": 64,
       "max_position_embeddings": 1024}


def build(experts: int, quantized: bool, tmp: Path):
    cfg = config_from_dict({**MID, "n_routed_experts": experts}, f"mid E={experts}")
    models = random_models(cfg, seed=0)
    if not quantized:
        return models
    root = save_checkpoint(models, tmp / f"e{experts}", quantize="fp8")
    return load_checkpoint(root)  # FP8 linears, FP4 experts, kept quantized


def round_ms(models, prompts, max_new: int) -> float:
    spec = SpeculativeConfig(num_steps=3, num_draft_tokens=4)
    engine = SpecEngine(models.target, models.draft, spec,
                        PoolConfig(max_requests=len(prompts), max_context=256))
    res = engine.generate(prompts, max_new, stop_ids=[])
    return res.stats["round_ms"]


def expected_active(experts: int, assignments: int) -> float:
    """Expected distinct experts among uniformly routed assignments."""
    return experts * (1 - (1 - 1 / experts) ** assignments)


def measure(models: dict, mode: str, batch: int, k: int, args) -> dict:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, MID["vocab_size"], (12 + 4 * i,), generator=gen).tolist()
               for i in range(batch)]
    times: dict[int, list[float]] = {e: [] for e in models}
    for _ in range(args.repeats):
        for e, m in models.items():
            times[e].append(round_ms(m, prompts, args.max_new_tokens))
    (e1, t1), (e2, t2) = [(e, statistics.median(t)) for e, t in times.items()]
    a = batch * 4 * k  # assignments of a verify forward (N = 4)
    print(f"{mode:>9} batch {batch}: round {t1:.2f} ms at E={e1}, {t2:.2f} ms at E={e2}: "
          f"ratio {t2 / t1:.3f}; a verify's {a} assignments reach ~{expected_active(e1, a):.1f} "
          f"vs ~{expected_active(e2, a):.1f} experts (top-{k}, eager, medians of "
          f"{args.repeats})")
    return {"mode": mode, "batch": batch, "round_ms": {str(e1): t1, str(e2): t2},
            "ratio": t2 / t1, "samples": {str(e): t for e, t in times.items()},
            "expected_active_verify": [expected_active(e1, a), expected_active(e2, a)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64, help="E; 2E is measured beside it")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantized", action="store_true", help="also FP8/FP4 stored weights")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    k = MID["num_experts_per_tok"]
    result = {"experts": [args.experts, 2 * args.experts], "top_k": k, "threads": args.threads,
              "runs": []}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for mode in ["float"] + (["quantized"] if args.quantized else []):
            models = {e: build(e, mode == "quantized", Path(tmp))
                      for e in (args.experts, 2 * args.experts)}
            for b in args.batch:
                result["runs"].append(measure(models, mode, b, k, args))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
