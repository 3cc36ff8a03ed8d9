"""End to end at equal batch: B requests of ``E2E_MAX_NEW`` tokens added at once and
run to completion, speculatively and plainly, each request timed from ``add_request``
to its last token (prefill included). Greedy, and with ``bench.temperature`` > 0 again
with every request sampling (seed = request index, so every run draws the same tokens)."""

from __future__ import annotations

import statistics
import time

from ..config import RunConfig
from ..errors import ConfigError
from ..runtime.engine import SpecEngine
from ..runtime.request_checks import output_room
from ..sampling import SamplingParams

# Output tokens per request of the end-to-end comparison (fewer where the pool's
# context cannot hold them); no stop token, so every request emits exactly these.
E2E_MAX_NEW = 32


def e2e_max_new(engine: SpecEngine, prompts: list[list[int]]) -> int:
    """``E2E_MAX_NEW``, or as many as the pool's context holds after the longest prompt."""
    limits = engine.request_limits
    return min(E2E_MAX_NEW, output_room(max(map(len, prompts)), limits.max_context,
                                        limits.lookahead))


def bench_temperature(cfg: RunConfig, where: str) -> float:
    """``bench.temperature``, checked before any work: sampling needs engines built with
    ``graph.sampling`` (a greedy-only engine refuses a sampling request)."""
    t = cfg.bench.temperature
    if t > 0 and not cfg.graph.sampling:
        raise ConfigError(f"{where}: key 'bench.temperature' {t} samples, but "
                          f"'graph.sampling' is false (greedy-only engines); set "
                          f"bench.temperature to 0 or graph.sampling to true")
    return t


def e2e_modes(temperature: float, n: int) -> dict[str, list[SamplingParams] | None]:
    """The end-to-end runs of ``n`` requests, by report key: greedy (``e2e``), and with
    ``temperature`` > 0 every request sampling at it (``e2e_sampled``; no top-k or top-p,
    request i with seed i)."""
    modes: dict[str, list[SamplingParams] | None] = {"e2e": None}
    if temperature > 0:
        modes["e2e_sampled"] = [SamplingParams(temperature=temperature, seed=i)
                                for i in range(n)]
    return modes


def e2e_run(engine: SpecEngine, prompts: list[list[int]], max_new: int,
            sampling: list[SamplingParams] | None = None) -> dict:
    """``len(prompts)`` requests of ``max_new`` tokens each (no stop token), added at once
    and run to completion on an idle engine: each request's latency from ``add_request``
    to its last token (prefill included), the tokens and wall time of the batch, and the
    engine's acceptance counters over the run. ``sampling``: per request (None: greedy)."""
    before, sampled = engine.stats.as_dict(), engine.chunks.counters.sampled_chunks
    start = time.perf_counter()
    rids = [engine.add_request(p, max_new, stop_ids=[], sampling=s)
            for p, s in zip(prompts, sampling or [None] * len(prompts))]
    done: dict[int, float] = {}
    tokens = 0
    while engine.has_work:
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"benchmark request failed: {out.error}")
            tokens += len(out.new_tokens)
            if out.finished:
                done[out.rid] = time.perf_counter() - start
    wall = time.perf_counter() - start
    after = engine.stats.as_dict()
    return {"latency_s": [done[rid] for rid in rids], "tokens": tokens, "wall_s": wall,
            **{k: after[k] - before[k]
               for k in ("accepted_drafts", "proposed_drafts", "request_rounds")},
            "sampled_chunks": engine.chunks.counters.sampled_chunks - sampled}


def e2e_summary(runs: dict[str, list[dict]], requests: int, max_new: int,
                temperature: float = 0.0) -> dict:
    """Speculative vs plain end to end at equal batch, prompts and output length (``runs``:
    ``e2e_run``'s per repeat, by side ``spec``/``plain``): the median per-request latency
    (add_request to last token), the output throughput, and the speculative runs'
    acceptance length (accepted drafts + bonus per request-round)."""
    spec, plain = runs["spec"], runs["plain"]

    def side(runs: list[dict]) -> dict:
        ms = [t * 1000 for r in runs for t in r["latency_s"]]
        return {"latency_ms_median": statistics.median(ms), "latency_ms_max": max(ms),
                "output_tokens_per_s": statistics.median(r["tokens"] / r["wall_s"]
                                                         for r in runs)}
    s, p = side(spec), side(plain)
    accepted, request_rounds = (sum(r[k] for r in spec)
                                for k in ("accepted_drafts", "request_rounds"))
    return {"requests": requests, "max_new_tokens": max_new, "temperature": temperature,
            "spec": s, "plain": p,
            "latency_ratio": s["latency_ms_median"] / p["latency_ms_median"],  # < 1: spec wins
            "throughput_ratio": s["output_tokens_per_s"] / p["output_tokens_per_s"],
            "acceptance_length": (accepted + request_rounds) / request_rounds,
            "draft_acceptance_rate": accepted / max(sum(r["proposed_drafts"] for r in spec), 1),
            # chunks run in the sampling graph variants: 0 greedy
            "sampled_chunks": {"spec": sum(r["sampled_chunks"] for r in spec),
                               "plain": sum(r["sampled_chunks"] for r in plain)}}


def sampling_summary(buckets: list[dict], temperature: float) -> dict | None:
    """Greedy vs sampled end to end over buckets (``e2e``, ``e2e_sampled``): the mean
    acceptance length and the geometric-mean spec/plain latency and throughput ratios.
    None with ``bench.temperature`` 0 (greedy only)."""
    if not temperature:
        return None

    def over(key: str) -> dict:
        runs = [b[key] for b in buckets]
        return {"acceptance_length": statistics.mean(r["acceptance_length"] for r in runs),
                "latency_ratio": statistics.geometric_mean(r["latency_ratio"] for r in runs),
                "throughput_ratio": statistics.geometric_mean(
                    r["throughput_ratio"] for r in runs)}
    return {"temperature": temperature, "top_p": 1.0, "top_k": 0, "seed": "request index",
            "greedy": over("e2e"), "sampled": over("e2e_sampled")}
