"""``bench-serve --shared-prefix``: prompts that share a prefix in groups, served with the
prefix cache on and off in one run.

Each load level (and each repeat) draws fresh prefixes: the same prompts again would
find themselves cached by the level before, so every level starts cold. The report
sets, per level, the hit rate the servers measured (``/metrics``: hit tokens over
queried tokens) beside the ideal one (every prompt but the first of its group finds
its group's prefix, rounded down to whole pages and to the prompt's last token, which
is always computed), the TTFT with hits against without, and the acceptance length
with hits against without (equal: a hit's drafts are a cold prefill's).
"""

from __future__ import annotations

import dataclasses

from ...config import RunConfig
from .load import Job

CACHES = ("on", "off")


def prefix_summary(jobs: list[Job], shared_prefix: int, group: int,
                   page_size: int | None = None) -> dict:
    """What a prefix cache could save on ``jobs`` at best: every job but the first of its
    group finds the shared prefix cached, token for token (``ideal_hit_rate``) and, with
    ``page_size``, in whole pages short of the prompt's last token
    (``ideal_paged_hit_rate``: what a paged cache can reach)."""
    prompt = sum(len(j.prompt) for j in jobs)
    later = [j for i, j in enumerate(jobs) if i % group] if shared_prefix else []
    shared = shared_prefix * len(later)
    out = {"shared_prefix": shared_prefix, "prefix_group": group if shared_prefix else None,
           "prompt_tokens": prompt, "shareable_tokens": shared,
           "ideal_hit_rate": round(shared / prompt, 4) if prompt else 0.0}
    if page_size:
        paged = sum(min(shared_prefix, len(j.prompt) - 1) // page_size * page_size
                    for j in later)
        out["ideal_paged_hit_rate"] = round(paged / prompt, 4) if prompt else 0.0
    return out


def with_cache(cfg: RunConfig, cache: str) -> RunConfig:
    return dataclasses.replace(cfg, pool=dataclasses.replace(cfg.pool,
                                                             prefix_cache=cache == "on"))


def comparisons(rows: list[dict]) -> list[dict]:
    """Per (load, mode, engine) with the cache on and off: the hit rate measured and its
    ideal, TTFT p50 on / off, acceptance length on and off."""
    by = {(r["load"], r["mode"], r["engine"], r["cache"]): r for r in rows}
    out = []
    for (load, mode, engine, cache), on in by.items():
        off = by.get((load, mode, engine, "off"))
        if cache != "on" or off is None:
            continue
        ttft = (round(on["ttft_p50_ms"] / off["ttft_p50_ms"], 3)
                if on["ttft_p50_ms"] and off["ttft_p50_ms"] else None)
        out.append({"load": load, "mode": mode, "engine": engine,
                    "hit_rate": on["hit_rate"], "ideal": on["ideal_paged_hit_rate"],
                    "ttft_p50_on_ms": on["ttft_p50_ms"], "ttft_p50_off_ms": off["ttft_p50_ms"],
                    "ttft_on_over_off": ttft, "accept_on": on["acceptance_length"],
                    "accept_off": off["acceptance_length"]})
    return out


def markdown(report: dict) -> list[str]:
    j = report["jobs"]
    if not j["shared_prefix"]:
        return []
    lines = [f"\nShared prefixes: {j['shared_prefix']} tokens per group of "
             f"{j['prefix_group']} prompts, fresh prefixes every level; pages of "
             f"{report['config']['pool']['page_size']} tokens.", "",
             "| load | mode | engine | hit rate (ideal, paged) | TTFT p50 on / off ms "
             "| on / off | accept len on / off |", "|---|---|---|---|---|---|---|"]
    for c in report["prefix_cache"]:
        ttft = "-" if c["ttft_on_over_off"] is None else f"{c['ttft_on_over_off']:.2f}x"
        acc = ("-" if c["accept_on"] is None
               else f"{c['accept_on']:.3f} / {c['accept_off']:.3f}")
        lines.append(f"| {c['load']} | {c['mode']} | {c['engine']} | "
                     f"{100 * (c['hit_rate'] or 0):.1f}% ({100 * c['ideal']:.1f}%) | "
                     f"{c['ttft_p50_on_ms']} / {c['ttft_p50_off_ms']} | {ttft} | {acc} |")
    return lines
