"""Per-mode summaries of a bucket's measured runs (``measure.measure``, one per repeat):
timing and its spread, host time outside replays, phase times, TPOT, submissions per
steady round, the round per graph mode and its per-round trace, and their ratios."""

from __future__ import annotations

import statistics

from ..profile.counting import OUTSIDE_PHASES, counts_every_launch
from ..runtime.chunks import COUNTED_AS
from ..runtime.engine import SpecEngine
from .engines import Engines
from .trace import trace_summary


def timing(runs: list[dict]) -> dict:
    medians = [statistics.median(r["round_s"]) * 1000 for r in runs]
    all_ms = sorted(t * 1000 for r in runs for t in r["round_s"])
    tok_s = [r["tokens"] / sum(r["round_s"]) for r in runs]
    median = statistics.median(medians)
    # tokens a request gets per round: acceptance length (after cuts) speculative, 1 plain
    per_request_round = (sum(r["tokens"] for r in runs)
                         / sum(len(r["round_s"]) * r["requests"] for r in runs))
    return {
        "round_ms_median": median, "round_ms_p90": all_ms[int(0.9 * (len(all_ms) - 1))],
        "round_ms_repeats": [round(m, 3) for m in medians],
        "noise": (max(medians) - min(medians)) / median if median else 0.0,
        "tokens_per_s": statistics.median(tok_s),
        "tpot_ms": median / per_request_round,  # time per output token of one request
    }


def host_times(runs: list[dict]) -> dict:
    """Host time per steady round outside graph replay calls (round wall time minus the
    seconds inside graph replay calls, ``phases.ReplayClock``): staging, readback, updates, the engine's bookkeeping.
    On the CPU emulator a replay runs its kernels, so this is pure host overhead; on a
    device a replay call is a launch, and the readback's wait for the device lands here."""
    medians = [statistics.median(r["host_s"]) * 1000 for r in runs]
    return {"host_ms_median": statistics.median(medians),
            "host_ms_repeats": [round(m, 3) for m in medians]}


def phase_times(runs: list[dict]) -> dict | None:
    """Mean ms per round by phase over the phase-timed rounds of every repeat (means, so
    the phases and what ran outside them add up to the round); draft is rollout + draft
    extend (acceptance included), verify the target forward. None where not timed."""
    timed = [r["phases"] for r in runs if r["phases"] is not None]
    if not timed:
        return None
    rounds = sum(len(t["round_s"]) for t in timed)
    ms = {k: 1000 * sum(t["phase_s"][k] for t in timed) / rounds for k in timed[0]["phase_s"]}
    round_ms = 1000 * sum(sum(t["round_s"]) for t in timed) / rounds
    draft = ms.get("rollout", 0.0) + ms.get("draft_extend", 0.0)
    verify = ms.get("target_verify", 0.0)
    return {"rounds": rounds, "round_ms_mean": round_ms, "phase_ms": ms,
            "outside_phases_ms": round_ms - sum(ms.values()),
            "draft_ms": draft, "verify_ms": verify,
            "draft_vs_verify": draft / verify if verify else None,
            "synchronized": timed[0]["synchronized"]}  # a device sync around each phase


def summary(runs: list[dict], graph: bool) -> dict:
    last = runs[-1]
    if graph:
        by_phase = {"replays": last["replays"], "staging_copies": last["staging_copies"],
                    "readback_copies": last["readback_copies"], "updates": last["updates"],
                    "eager_fallback_ops": sum(last["phase_launches"].values())}
    else:
        by_phase = {**last["phase_launches"], OUTSIDE_PHASES: last["outside_phase_launches"]}
    return {
        "submissions_per_round": sum(by_phase.values()), "submissions": by_phase,
        "collectives_per_round": last["collectives"],
        "control_messages_per_round": last["control_messages"],
        "counted_as": COUNTED_AS if graph else last["count_method"],
        "replays_per_round": last["replays"] if graph else 0, **timing(runs),
        **(host_times(runs) if graph else {}), "phase_times": phase_times(runs),
    }


def compile_summary(runs: list[dict], engine: SpecEngine) -> dict:
    """The compile peer: every launch of its round as the profiler saw it, by phase (a
    compiled call is one submission only where it is one device graph launch)."""
    last = runs[-1]
    label = engine.runner.backend.compiler.label
    return {
        "compile_backend": label,
        "submissions_per_round": last["eager_launches"],
        "submissions": {**last["phase_launches"], OUTSIDE_PHASES: last["outside_phase_launches"]},
        "counted_as": last["count_method"],
        "counts_every_launch": counts_every_launch(str(engine.device), label),
        "calls_per_round": last["replays"], **timing(runs), **host_times(runs),
    }


def ratio(a: dict | None, b: dict | None, key: str = "round_ms_median") -> float | None:
    return a[key] / b[key] if a and b else None


def round_modes(engines: Engines, runs: dict[str, list[dict]], graph: dict | None) -> dict:
    """The speculative round per graph mode: split (three graphs), fused (one; the
    config's graph engine, overlap off), fused with overlap on. Where the config's round
    is split, only split exists; with the eager backend none does."""
    fused = engines.fused
    return {"split": (summary(runs["split_spec"], True) if fused else graph),
            "fused": graph if fused else None,
            "overlap": (summary(runs["overlap_spec"], True) if engines.overlap_spec
                        else None)}


def round_traces(engines: Engines, runs: dict[str, list[dict]]) -> dict:
    """The per-round trace of the fused round, overlap off (``fused``) and on
    (``overlap``); None where the mode does not exist (a split round, no graphs)."""
    traced = engines.traced_modes()
    return {mode: trace_summary(runs[name]) if name in traced and name in runs else None
            for mode, name in (("fused", "graph_spec"), ("overlap", "overlap_spec"))}
