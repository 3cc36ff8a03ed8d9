"""The serving benchmark's load: streamed greedy completions over loopback HTTP, at a
fixed concurrency or with Poisson arrivals, bounded in count and time; per request the
time to first token, the gaps between chunks and the tokens; per load the latency
percentiles, throughput, and draft acceptance per position from the server's /metrics.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

MAX_REQUESTS = 1000  # per load level: the benchmark is bounded whatever is asked


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Load:
    kind: str  # concurrency | rate
    value: float  # requests at once, or requests per second (Poisson arrivals)
    requests: int
    time_limit_s: float

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"{self.value:g} req/s"


@dataclass
class Sample:
    """One request as its client saw it (seconds from its send)."""

    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # between successive chunks
    e2e: float = 0.0
    tokens: list[int] = field(default_factory=list)
    error: str | None = None


async def _one(client: httpx.AsyncClient, url: str, job: Job) -> Sample:
    body = {"model": "bench", "prompt": job.prompt, "max_tokens": job.max_tokens,
            "temperature": 0, "stream": True, "return_token_ids": True}
    s, start = Sample(), time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    s.error = event["error"]["message"]
                    break
                ids = event["choices"][0].get("token_ids") if event["choices"] else None
                if ids:
                    now = time.perf_counter()
                    if s.ttft is None:
                        s.ttft = now - start
                    else:
                        s.gaps.append(now - last)
                    last = now
                    s.tokens.extend(ids)
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.e2e = time.perf_counter() - start
    return s


async def _drive(url: str, load: Load, jobs: list[Job], seed: int) -> tuple[list, float]:
    """Run ``load`` -> (samples in job order, None where not started; wall seconds)."""
    n = min(load.requests, len(jobs), MAX_REQUESTS)
    samples: list[Sample | None] = [None] * n
    deadline = time.monotonic() + load.time_limit_s
    limits = httpx.Limits(max_connections=max(int(load.value), 1) + 8)
    async with httpx.AsyncClient(timeout=load.time_limit_s + 60, limits=limits) as client:
        start = time.perf_counter()

        async def run(i: int) -> None:
            samples[i] = await _one(client, url, jobs[i])

        if load.kind == "concurrency":
            order = iter(range(n))

            async def worker() -> None:
                for i in order:
                    if time.monotonic() > deadline:
                        return
                    await run(i)
            await asyncio.gather(*(worker() for _ in range(int(load.value))))
        else:  # Poisson arrivals: exponential gaps at the rate
            rng, tasks = random.Random(seed), []
            for i in range(n):
                if time.monotonic() > deadline:
                    break
                tasks.append(asyncio.create_task(run(i)))
                await asyncio.sleep(rng.expovariate(load.value))
            await asyncio.gather(*tasks)
        return samples, time.perf_counter() - start


def run_load(url: str, load: Load, jobs: list[Job], seed: int = 0) -> tuple[dict, list]:
    """Drive one load level -> (its summary, the samples)."""
    before = scrape(url)
    samples, wall = asyncio.run(_drive(url, load, jobs, seed))
    after = scrape(url)
    return summarize(load, [s for s in samples if s is not None], wall, before, after), samples


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(1000 * values[min(int(q * len(values)), len(values) - 1)], 2)  # ms


def summarize(load: Load, samples: list[Sample], wall: float, before: dict,
              after: dict) -> dict:
    ok = [s for s in samples if s.error is None and s.tokens]
    tokens = sum(len(s.tokens) for s in ok)
    ttft = [s.ttft for s in ok]
    tpot = [(s.e2e - s.ttft) / (len(s.tokens) - 1) for s in ok if len(s.tokens) > 1]
    itl = [g for s in ok for g in s.gaps]

    def delta(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    positions = sorted({int(dict(k[1])["position"]) for k in after
                        if k[0] == "nextn_serve_draft_proposed_total"})
    per_position = [round(delta("nextn_serve_draft_accepted_total", position=str(p)) /
                          max(delta("nextn_serve_draft_proposed_total", position=str(p)), 1), 3)
                    for p in positions]
    rounds = delta("nextn_serve_acceptance_length_count")
    return {
        "load": load.label, "kind": load.kind, "value": load.value, "sent": len(samples),
        "ok": len(ok), "failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if s.error})[:3], "wall_s": round(wall, 3),
        "output_tokens": tokens, "throughput_tok_s": round(tokens / wall, 1) if wall else None,
        "requests_per_s": round(len(ok) / wall, 2) if wall else None,
        "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99),
        "tpot_p50_ms": _pct(tpot, 0.5), "tpot_p99_ms": _pct(tpot, 0.99),
        "itl_p50_ms": _pct(itl, 0.5), "itl_p99_ms": _pct(itl, 0.99),
        "e2e_mean_ms": round(1000 * statistics.fmean(s.e2e for s in ok), 1) if ok else None,
        "acceptance_length": round(delta("nextn_serve_acceptance_length_sum") / rounds, 3)
        if rounds else None,
        "acceptance_per_position": per_position,
        "hit_rate": _hit_rate(delta, after),
    }


def _hit_rate(delta, after: dict) -> float | None:
    """The prefix cache's hit tokens over queried tokens in the run (None where the
    server has no prefix cache)."""
    if ("nextn_prefix_cache_queried_tokens_total", ()) not in after:
        return None
    asked = delta("nextn_prefix_cache_queried_tokens_total")
    return round(delta("nextn_prefix_cache_hit_tokens_total") / asked, 4) if asked else 0.0


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """The server's /metrics -> {(sample name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}
