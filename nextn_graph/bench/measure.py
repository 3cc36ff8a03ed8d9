"""The replay benchmark: eager vs graph, speculative vs plain, per bucket, one run.

For every bucket B of the config, B requests run side by side on engines built
once: speculative and plain decoding, each eager and on the config's graph
backend; where the config's round is fused, two more speculative graph engines,
the same round split in three graphs (``round: split``, as SGLang) and fused
with overlap on (round k+1 launched before round k's readback); with
``bench.compile_peer`` one more, speculative decoding on ``torch.compile``d
graphs (the peer a user would pick instead of hand-captured graphs), counted by
a profiler over the whole round (``compiled_counter``). After warm-up, each
steady round (all B requests running, no admission) is timed on the host, with
the host seconds spent outside graph replays (``runner.replay_s``); engines with
phases (eager, split graphs) then time a few rounds phase by phase
(``PhaseTimer``); one more round is counted by one counter (``count_round``),
split by phase: kernel-launching ops in eager mode; in graph mode the runner's
counters (replays, staging and readback copies, updates) plus the ops of any
phase left eager. Requests are then aborted, so every measurement starts from
the same state; last, B requests of ``E2E_MAX_NEW`` tokens run to completion,
speculatively and plainly (``e2e_run``). Repeats give a median and its spread.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..config import RunConfig, compile_peer, resolve_graph
from ..errors import ConfigError
from ..graph.counting import (OUTSIDE_PHASES, RoundCounter, compiled_counter,
                              counts_every_launch, launch_counter)
from ..graph.runner import COUNTED_AS
from ..runtime.engine import SpecEngine
from ..train import Corpus, TrainSettings

# Output tokens per request of the end-to-end comparison (fewer where the pool's
# context cannot hold them); no stop token, so every request emits exactly these.
E2E_MAX_NEW = 32


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

    @property
    def phase_rounds(self) -> int:
        """Rounds timed phase by phase, after the timed rounds (a device sync at every
        phase boundary would bias the round latency of the timed ones)."""
        return max(1, self.timed_rounds // 3)


@dataclass
class Engines:
    """The engines a bench measures, by mode name. With the eager backend there are no
    graphs to compare, so only the two eager engines exist (a "graph" engine would be a
    second eager run whose ratios are noise). ``graph_*`` are the config's graph engines
    (fused with overlap off, where the config's round is fused); ``split_spec`` and
    ``overlap_spec`` exist only then: the same speculative round split in three graphs,
    and fused with overlap on (where overlap can work: not on NPU graphs)."""
    eager_spec: SpecEngine
    eager_plain: SpecEngine
    graph_spec: SpecEngine | None
    graph_plain: SpecEngine | None
    compile_spec: SpecEngine | None = None  # the compile peer (bench.compile_peer)
    split_spec: SpecEngine | None = None
    overlap_spec: SpecEngine | None = None

    @property
    def has_graphs(self) -> bool:
        return self.graph_spec is not None

    @property
    def spec(self) -> SpecEngine:
        """The speculative engine on the config's backend: what the headline figures use."""
        return self.graph_spec if self.graph_spec is not None else self.eager_spec

    @property
    def plain(self) -> SpecEngine:
        return self.graph_plain if self.graph_plain is not None else self.eager_plain

    @property
    def fused(self) -> bool:
        """The config's graph round is one fused graph (else split, or no graphs)."""
        return self.graph_spec is not None and self.graph_spec.runner.phases.fused

    def split_mode(self) -> str | None:
        """The mode name of the split-graph speculative engine, if any."""
        return "split_spec" if self.fused else ("graph_spec" if self.has_graphs else None)

    def by_name(self) -> dict[str, SpecEngine]:
        return {name: e for name, e in vars(self).items() if e is not None}


def build_engines(models, cfg: RunConfig, progress: bool) -> Engines:
    # eager keeps its phases apart (the bench counts and times each); the config's round
    # was resolved for its graph backend
    eager = replace(cfg.graph, backend="eager", round="split", overlap="off")

    def engine(spec, graph, **kwargs) -> SpecEngine:
        return SpecEngine(models.target, models.draft, spec, cfg.pool, graph, **kwargs)

    graphs = cfg.graph.backend != "eager"
    # The config's graph engines run without overlap (a fused round's overlap is its own
    # mode below; a split round has none), so graph and plain compare like for like.
    graph = replace(cfg.graph, overlap="off")
    peer = compile_peer(cfg)
    engines = Engines(
        eager_spec=engine(cfg.speculative, eager), eager_plain=engine(None, eager),
        graph_spec=engine(cfg.speculative, graph, progress=progress) if graphs else None,
        graph_plain=engine(None, graph, progress=progress) if graphs else None,
        compile_spec=(engine(cfg.speculative, replace(peer, overlap="off"), progress=progress)
                      if peer else None))
    if engines.fused:
        engines.split_spec = engine(cfg.speculative, replace(graph, round="split"),
                                    progress=progress)
        # overlap only where it can work (not on NPU graphs, which take host lengths)
        overlap = replace(graph, overlap="auto")
        if resolve_graph(overlap, cfg.pool, "bench").overlap == "on":
            engines.overlap_spec = engine(cfg.speculative, replace(overlap, overlap="on"),
                                          progress=progress)
    return engines


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


class PhaseTimer:
    """A runner tracer (``runner.tracer``): host seconds per phase kind of the rounds it
    watches. On CPU every kernel has run when a phase returns; on a device a phase's
    time would be its launch time only, so there each phase starts and ends with a device
    sync (staging before it and its kernels inside it), which is why the bench times
    phases in rounds of their own, never in the timed ones."""

    def __init__(self, device: torch.device):
        self.seconds: Counter[str] = Counter()  # by phase kind, in round order
        self.synchronized = device.type != "cpu"
        module = torch.get_device_module(device) if self.synchronized else None
        self._sync = (lambda: module.synchronize(device)) if module else (lambda: None)

    @contextmanager
    def __call__(self, kind: str, replayed: bool):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[kind] += time.perf_counter() - start


def _steady(outs: list, n: int) -> list:
    """A steady round's outputs: one per request, none finished (a failure is named)."""
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"benchmark round failed: {errors[0]}")
    if len(outs) != n or any(o.finished for o in outs):
        raise RuntimeError("benchmark round was not steady (a request finished early)")
    return outs


def _time_phases(engine: SpecEngine, n: int, rounds: int) -> dict:
    """``rounds`` steady rounds under a ``PhaseTimer``: their wall times and the seconds
    of each phase summed over them."""
    timer, walls = PhaseTimer(engine.device), []
    engine.runner.tracer = timer
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            _steady(engine.step(), n)
            walls.append(time.perf_counter() - start)
    finally:
        engine.runner.tracer = None
    return {"round_s": walls, "phase_s": dict(timer.seconds),
            "synchronized": timer.synchronized}


def measure(engine: SpecEngine, prompts: list[list[int]], st: BenchSettings,
            counter: Callable[[str], RoundCounter] = launch_counter,
            trace_replays: bool = False, time_phases: bool = False) -> dict:
    """Steady rounds of ``len(prompts)`` requests on one engine; ``counter(device)``
    makes the counter of the counted round (``count_round``'s ``trace_replays``);
    ``time_phases``: also ``st.phase_rounds`` rounds timed phase by phase."""
    phase_rounds = st.phase_rounds if time_phases else 0
    # first, warm-up, timed, phase-timed, counted
    rounds = 1 + st.warmup_rounds + st.timed_rounds + phase_rounds + 1
    # nobody finishes inside the window: up to S + 1 tokens a round, + the prefill's token
    max_new = rounds * (engine.num_steps + 1) + 2
    times, host, tokens = [], [], 0
    rids = [engine.add_request(p, max_new, stop_ids=[]) for p in prompts]
    engine.step()  # admission and prefill, then the first round
    before = engine.stats.as_dict()  # steady rounds only from here
    for i in range(st.warmup_rounds + st.timed_rounds):
        replay_s = engine.runner.replay_s
        start = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - start
        _steady(outs, len(prompts))
        if i >= st.warmup_rounds:
            times.append(elapsed)
            # the host's part of the round: all but the graph replay calls
            host.append(elapsed - (engine.runner.replay_s - replay_s))
            tokens += sum(len(o.new_tokens) for o in outs)
    phases = _time_phases(engine, len(prompts), phase_rounds) if time_phases else None
    counters_before = engine.runner.counters.as_dict()
    issued_before = engine.tp.counts.as_dict()
    counted = count_round(engine.runner, lambda: _steady(engine.step(), len(prompts)),
                          counter(str(engine.device)), trace_replays)
    counters = {k: v - counters_before[k] for k, v in engine.runner.counters.as_dict().items()}
    issued = {k: v - issued_before[k] for k, v in engine.tp.counts.as_dict().items()}
    after = engine.stats.as_dict()
    for rid in rids:
        engine.abort(rid)
    while engine.has_work:  # an overlapped round still in flight: read and dropped
        engine.step()
    rounds_done = after["rounds"] - before["rounds"]
    return {
        "round_s": times, "host_s": host, "tokens": tokens, "requests": len(prompts),
        "phases": phases,  # None unless time_phases
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


def _timing(runs: list[dict]) -> dict:
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


def _host(runs: list[dict]) -> dict:
    """Host time per steady round outside graph replay calls (round wall time minus the
    runner's ``replay_s`` delta): staging, readback, updates, the engine's bookkeeping.
    On the CPU emulator a replay runs its kernels, so this is pure host overhead; on a
    device a replay call is a launch, and the readback's wait for the device lands here."""
    medians = [statistics.median(r["host_s"]) * 1000 for r in runs]
    return {"host_ms_median": statistics.median(medians),
            "host_ms_repeats": [round(m, 3) for m in medians]}


def _phase_times(runs: list[dict]) -> dict | None:
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
        **(_host(runs) if graph else {}), "phase_times": _phase_times(runs),
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
        "calls_per_round": last["replays"], **_timing(runs), **_host(runs),
    }


def _e2e(spec: list[dict], plain: list[dict], requests: int, max_new: int) -> dict:
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


def _ratio(a: dict | None, b: dict | None, key: str = "round_ms_median") -> float | None:
    return a[key] / b[key] if a and b else None


def _round_modes(engines: Engines, runs: dict[str, list[dict]], graph: dict | None) -> dict:
    """The speculative round per graph mode: split (three graphs), fused (one; the
    config's graph engine, overlap off), fused with overlap on. Where the config's round
    is split, only split exists; with the eager backend none does."""
    fused = engines.fused
    return {"split": (_summary(runs["split_spec"], True) if fused else graph),
            "fused": graph if fused else None,
            "overlap": (_summary(runs["overlap_spec"], True) if engines.overlap_spec
                        else None)}


def e2e_max_new(engine: SpecEngine, prompts: list[list[int]]) -> int:
    """``E2E_MAX_NEW``, or as many as the pool's context holds after the longest prompt."""
    return min(E2E_MAX_NEW, engine.max_context - max(map(len, prompts)) - engine.lookahead)


def bench_bucket(engines: Engines, prompts: list[list[int]], st: BenchSettings,
                 tick=lambda: None) -> dict:
    """One bucket. Without graphs (the eager backend) every graph figure is None."""
    modes = engines.by_name()
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    e2e: dict[str, list[dict]] = {"spec": [], "plain": []}
    timed_phases = {"eager_spec", engines.split_mode()}  # the engines with phases
    max_new = e2e_max_new(engines.spec, prompts)
    for _ in range(st.repeats):  # interleaved, so drift hits every mode alike
        for name, engine in modes.items():
            with torch.no_grad():
                if name == "compile_spec":
                    label = engine.runner.backend.compiler.label
                    runs[name].append(measure(
                        engine, prompts, st, lambda d: compiled_counter(d, label),
                        trace_replays=True))
                else:
                    runs[name].append(measure(engine, prompts, st,
                                              time_phases=name in timed_phases))
            tick()
        with torch.no_grad():
            e2e["spec"].append(e2e_run(engines.spec, prompts, max_new))
            e2e["plain"].append(e2e_run(engines.plain, prompts, max_new))
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
    round_modes = _round_modes(engines, runs, graph)
    head, head_plain = (graph, plain_graph) if graphs else (eager, plain_eager)
    return {
        "bucket": len(prompts), "num_steps": s, "verify_width": s + 1,
        "nextn_forwards_per_round": spec[-1]["nextn_forwards"] / spec[-1]["rounds"],
        "eager": eager, "graph": graph,
        "submission_ratio": (eager["submissions_per_round"] / graph["submissions_per_round"]
                             if graphs else None),
        "latency_ratio": graph["round_ms_median"] / eager["round_ms_median"] if graphs else None,
        "plain": {"eager": plain_eager, "graph": plain_graph},
        # the speculative round per graph mode (split / fused / fused + overlap), and
        # the latency ratios fused over split and overlap over fused (None: mode absent)
        "round_modes": round_modes,
        "fused_vs_split_latency": _ratio(round_modes["fused"], round_modes["split"]),
        "overlap_vs_fused_latency": _ratio(round_modes["overlap"], round_modes["fused"]),
        # the compile peer (bench.compile_peer), speculative only; None without one
        "compile": peer,
        "compile_vs_graph_latency": _ratio(peer, graph),
        "compile_vs_eager_latency": _ratio(peer, eager),
        "spec_vs_plain": {
            "acceptance_length": (accepted + request_rounds) / request_rounds,
            "draft_acceptance_rate": accepted / max(sum(r["proposed"] for r in spec), 1),
            # on the config's backend: graphs, or eager when that is the backend
            "speedup": head["tokens_per_s"] / head_plain["tokens_per_s"],
            "speedup_eager": speedup_eager,
            "tpot_ms": {"spec": head["tpot_ms"], "plain": head_plain["tpot_ms"]},
            # a plain round emits 1 token per request: speculation pays off above this
            # acceptance length (the speculative round over the plain one)
            "break_even_acceptance_length": _ratio(head, head_plain),
        },
        # end to end at equal batch: B requests of max_new_tokens, spec vs plain
        "e2e": _e2e(e2e["spec"], e2e["plain"], len(prompts), max_new),
    }


def bench_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """In-distribution prompts for the trained checkpoint (16..40 tokens)."""
    corpus = Corpus(vocab, TrainSettings().phrases, torch.Generator().manual_seed(seed))
    return [corpus.sample(16 + (8 * i) % 25) for i in range(n)]
