"""The replay benchmark: eager vs graph, speculative vs plain, per bucket, one run.

For every bucket B of the config, B requests run side by side on four engines
built once: speculative and plain decoding, each eager and on the config's
graph backend; with ``bench.compile_peer`` a fifth, speculative decoding on
``torch.compile``d graphs (the peer a user would pick instead of hand-captured
graphs), counted by a profiler over the whole round (``compiled_counter``). After warm-up, each steady round (all B requests running, no
admission) is timed on the host; one more round is counted by one counter
(``count_round``), split by phase: kernel-launching ops in eager mode; in graph
mode the runner's counters (replays, staging and readback copies, updates) plus
the ops of any phase left eager. Requests are then aborted, so every
measurement starts from the same state. Repeats give a median and its spread.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..config import RunConfig, compile_peer
from ..errors import ConfigError
from ..graph.counting import (OUTSIDE_PHASES, RoundCounter, compiled_counter,
                              counts_every_launch, launch_counter)
from ..graph.runner import COUNTED_AS
from ..runtime.engine import SpecEngine
from ..train import Corpus, TrainSettings


@dataclass(frozen=True)
class BenchSettings:
    warmup_rounds: int = 3
    timed_rounds: int = 24
    repeats: int = 3
    seed: int = 11

    def __post_init__(self) -> None:
        # Zero timed rounds or repeats would fail only after capture, with no median.
        for key, low in (("warmup_rounds", 0), ("timed_rounds", 1), ("repeats", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"bench {key} must be an integer >= {low}, got {value!r}")


@dataclass
class Engines:
    """The engines a bench measures, by mode name. With the eager backend there are no
    graphs to compare, so only the two eager engines exist (a "graph" engine would be a
    second eager run whose ratios are noise)."""
    eager_spec: SpecEngine
    eager_plain: SpecEngine
    graph_spec: SpecEngine | None
    graph_plain: SpecEngine | None
    compile_spec: SpecEngine | None = None  # the compile peer (bench.compile_peer)

    @property
    def has_graphs(self) -> bool:
        return self.graph_spec is not None

    @property
    def spec(self) -> SpecEngine:
        """The speculative engine on the config's backend: what the headline figures use."""
        return self.graph_spec if self.graph_spec is not None else self.eager_spec

    def by_name(self) -> dict[str, SpecEngine]:
        return {name: e for name, e in vars(self).items() if e is not None}


def build_engines(models, cfg: RunConfig, progress: bool) -> Engines:
    eager = replace(cfg.graph, backend="eager")

    def engine(spec, graph, **kwargs) -> SpecEngine:
        return SpecEngine(models.target, models.draft, spec, cfg.pool, graph, **kwargs)

    graphs = cfg.graph.backend != "eager"
    peer = compile_peer(cfg)
    return Engines(
        eager_spec=engine(cfg.speculative, eager), eager_plain=engine(None, eager),
        graph_spec=engine(cfg.speculative, cfg.graph, progress=progress) if graphs else None,
        graph_plain=engine(None, cfg.graph, progress=progress) if graphs else None,
        compile_spec=engine(cfg.speculative, peer, progress=progress) if peer else None)


def count_round(runner, step: Callable[[], object], counter: RoundCounter,
                trace_replays: bool = False) -> dict:
    """Run ``step`` (one round) under ``counter``, the round's only counter: every
    submission, split by the phases that ran eagerly (a replayed phase is one submission,
    the runner's to count) and ``OUTSIDE_PHASES`` for the rest (staging, readback).
    ``trace_replays``: replays are phases too (a compiled graph's call is many launches)."""
    def tracer(kind: str, replayed: bool):
        return nullcontext() if replayed and not trace_replays else counter.phase(kind)

    runner.tracer = tracer
    try:
        with counter:
            step()
    finally:
        runner.tracer = None
    per_phase = dict(counter.per_phase)
    return {"launches": counter.launches, "method": counter.method,
            "outside_phases": per_phase.pop(OUTSIDE_PHASES, 0), "phases": per_phase}


def _steady(outs: list, n: int) -> list:
    """A steady round's outputs: one per request, none finished (a failure is named)."""
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"benchmark round failed: {errors[0]}")
    if len(outs) != n or any(o.finished for o in outs):
        raise RuntimeError("benchmark round was not steady (a request finished early)")
    return outs


def measure(engine: SpecEngine, prompts: list[list[int]], st: BenchSettings,
            counter: Callable[[str], RoundCounter] = launch_counter,
            trace_replays: bool = False) -> dict:
    """Steady rounds of ``len(prompts)`` requests on one engine; ``counter(device)``
    makes the counter of the counted round (``count_round``'s ``trace_replays``)."""
    rounds = 1 + st.warmup_rounds + st.timed_rounds + 1  # first, warm-up, timed, counted
    # nobody finishes inside the window: up to S + 1 tokens a round, + the prefill's token
    max_new = rounds * (engine.num_steps + 1) + 2
    times, tokens = [], 0
    rids = [engine.add_request(p, max_new, stop_ids=[]) for p in prompts]
    engine.step()  # admission and prefill, then the first round
    before = engine.stats.as_dict()  # steady rounds only from here
    for i in range(st.warmup_rounds + st.timed_rounds):
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        _steady(outs, len(prompts))
        if i >= st.warmup_rounds:
            times.append(elapsed)
            tokens += sum(len(o.new_tokens) for o in outs)
    counters_before = engine.runner.counters.as_dict()
    issued_before = engine.tp.counts.as_dict()
    counted = count_round(engine.runner, lambda: _steady(engine.step(), len(prompts)),
                          counter(str(engine.device)), trace_replays)
    counters = {k: v - counters_before[k] for k, v in engine.runner.counters.as_dict().items()}
    issued = {k: v - issued_before[k] for k, v in engine.tp.counts.as_dict().items()}
    after = engine.stats.as_dict()
    for rid in rids:
        engine.abort(rid)
    rounds_done = after["rounds"] - before["rounds"]
    return {
        "round_s": times, "tokens": tokens,
        "eager_launches": counted["launches"],  # every launch of the counted round
        "count_method": counted["method"],
        "phase_launches": counted["phases"],  # ops of phases that ran eagerly
        "outside_phase_launches": counted["outside_phases"],  # staging, readback, ...
        "replays": counters["graph_replays"], "staging_copies": counters["staging_copies"],
        "readback_copies": counters["readback_copies"], "updates": counters["graph_updates"],
        "eager_fallbacks": counters["eager_fallbacks"],
        # tensor parallelism: device collectives of the counted round (issued eagerly,
        # or inside replayed graphs) and rank 0's control messages to the others
        "collectives": issued["all_reduce"] + issued["all_gather"]
        + counters["graph_collectives"],
        "control_messages": issued["control"],
        "accepted": after["accepted_drafts"] - before["accepted_drafts"],
        "request_rounds": after["request_rounds"] - before["request_rounds"],
        "proposed": after["proposed_drafts"] - before["proposed_drafts"],
        "nextn_forwards": (after["nextn_extend_forwards"] - before["nextn_extend_forwards"]
                           + after["nextn_decode_forwards"] - before["nextn_decode_forwards"]),
        "rounds": rounds_done,
    }


def _timing(runs: list[dict]) -> dict:
    medians = [statistics.median(r["round_s"]) * 1000 for r in runs]
    all_ms = sorted(t * 1000 for r in runs for t in r["round_s"])
    tok_s = [r["tokens"] / sum(r["round_s"]) for r in runs]
    median = statistics.median(medians)
    return {
        "round_ms_median": median, "round_ms_p90": all_ms[int(0.9 * (len(all_ms) - 1))],
        "round_ms_repeats": [round(m, 3) for m in medians],
        "noise": (max(medians) - min(medians)) / median if median else 0.0,
        "tokens_per_s": statistics.median(tok_s),
    }


def _summary(runs: list[dict], graph: bool) -> dict:
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
        "replays_per_round": last["replays"] if graph else 0, **_timing(runs),
    }


def _compile_summary(runs: list[dict], engine: SpecEngine) -> dict:
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
        "calls_per_round": last["replays"], **_timing(runs),
    }


def bench_bucket(engines: Engines, prompts: list[list[int]], st: BenchSettings,
                 tick=lambda: None) -> dict:
    """One bucket. Without graphs (the eager backend) every graph figure is None."""
    modes = engines.by_name()
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(st.repeats):  # interleaved, so drift hits every mode alike
        for name, engine in modes.items():
            with torch.no_grad():
                if name == "compile_spec":
                    label = engine.runner.backend.compiler.label
                    runs[name].append(measure(
                        engine, prompts, st, lambda d: compiled_counter(d, label),
                        trace_replays=True))
                else:
                    runs[name].append(measure(engine, prompts, st))
            tick()
    graphs = engines.has_graphs
    spec = runs["graph_spec" if graphs else "eager_spec"]
    request_rounds = sum(r["request_rounds"] for r in spec)
    accepted = sum(r["accepted"] for r in spec)
    eager, plain_eager = _summary(runs["eager_spec"], False), _summary(runs["eager_plain"], False)
    graph = _summary(spec, True) if graphs else None
    plain_graph = _summary(runs["graph_plain"], True) if graphs else None
    speedup_eager = eager["tokens_per_s"] / plain_eager["tokens_per_s"]
    s = engines.spec.num_steps
    peer = (_compile_summary(runs["compile_spec"], engines.compile_spec)
            if engines.compile_spec is not None else None)
    return {
        "bucket": len(prompts), "num_steps": s, "verify_width": s + 1,
        "nextn_forwards_per_round": spec[-1]["nextn_forwards"] / spec[-1]["rounds"],
        "eager": eager, "graph": graph,
        "submission_ratio": (eager["submissions_per_round"] / graph["submissions_per_round"]
                             if graphs else None),
        "latency_ratio": graph["round_ms_median"] / eager["round_ms_median"] if graphs else None,
        "plain": {"eager": plain_eager, "graph": plain_graph},
        # the compile peer (bench.compile_peer), speculative only; None without one
        "compile": peer,
        "compile_vs_graph_latency": (peer["round_ms_median"] / graph["round_ms_median"]
                                     if peer and graphs else None),
        "compile_vs_eager_latency": (peer["round_ms_median"] / eager["round_ms_median"]
                                     if peer else None),
        "spec_vs_plain": {
            "acceptance_length": (accepted + request_rounds) / request_rounds,
            "draft_acceptance_rate": accepted / max(sum(r["proposed"] for r in spec), 1),
            # on the config's backend: graphs, or eager when that is the backend
            "speedup": (graph["tokens_per_s"] / plain_graph["tokens_per_s"] if graphs
                        else speedup_eager),
            "speedup_eager": speedup_eager,
        },
    }


def bench_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """In-distribution prompts for the trained checkpoint (16..40 tokens)."""
    corpus = Corpus(vocab, TrainSettings().phrases, torch.Generator().manual_seed(seed))
    return [corpus.sample(16 + (8 * i) % 25) for i in range(n)]
