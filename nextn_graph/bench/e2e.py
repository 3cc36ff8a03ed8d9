"""End to end at equal batch: B requests of ``E2E_MAX_NEW`` tokens added at once and
run to completion, speculatively and plainly, each request timed from ``add_request``
to its last token (prefill included)."""

from __future__ import annotations

import statistics
import time

from ..runtime.engine import SpecEngine

# Output tokens per request of the end-to-end comparison (fewer where the pool's
# context cannot hold them); no stop token, so every request emits exactly these.
E2E_MAX_NEW = 32


def e2e_max_new(engine: SpecEngine, prompts: list[list[int]]) -> int:
    """``E2E_MAX_NEW``, or as many as the pool's context holds after the longest prompt."""
    return min(E2E_MAX_NEW, engine.max_context - max(map(len, prompts)) - engine.lookahead)


def e2e_run(engine: SpecEngine, prompts: list[list[int]], max_new: int) -> dict:
    """``len(prompts)`` requests of ``max_new`` tokens each (no stop token), added at once
    and run to completion on an idle engine: each request's latency from ``add_request``
    to its last token (prefill included), and the tokens and wall time of the batch."""
    start = time.perf_counter()
    rids = [engine.add_request(p, max_new, stop_ids=[]) for p in prompts]
    done: dict[int, float] = {}
    tokens = 0
    while engine.has_work:
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"benchmark request failed: {out.error}")
            tokens += len(out.new_tokens)
            if out.finished:
                done[out.rid] = time.perf_counter() - start
    return {"latency_s": [done[rid] for rid in rids], "tokens": tokens,
            "wall_s": time.perf_counter() - start}


def e2e_summary(spec: list[dict], plain: list[dict], requests: int, max_new: int) -> dict:
    """Speculative vs plain end to end at equal batch, prompts and output length: the
    median per-request latency (add_request to last token) and the output throughput."""
    def side(runs: list[dict]) -> dict:
        ms = [t * 1000 for r in runs for t in r["latency_s"]]
        return {"latency_ms_median": statistics.median(ms), "latency_ms_max": max(ms),
                "output_tokens_per_s": statistics.median(r["tokens"] / r["wall_s"]
                                                         for r in runs)}
    s, p = side(spec), side(plain)
    return {"requests": requests, "max_new_tokens": max_new, "spec": s, "plain": p,
            "latency_ratio": s["latency_ms_median"] / p["latency_ms_median"],  # < 1: spec wins
            "throughput_ratio": s["output_tokens_per_s"] / p["output_tokens_per_s"]}
