"""The replay benchmark: eager vs graph, speculative vs plain, per bucket, one run.

For every bucket B of the config, B requests run side by side on engines built
once (``engines.build_engines``: speculative and plain, eager and graphs, and
where the config's round is fused the split round and the fused round with
overlap on; the compile peer with ``bench.compile_peer``). After warm-up, each
steady round (all B requests running, no admission) is timed on the host, with
the host seconds spent outside graph replays (``phases.ReplayClock``); the fused
round, overlap off and on, is then traced for a few rounds (``trace``); engines
with phases (eager, split graphs) time a few rounds phase by phase
(``phases.PhaseTimer``); one more round is counted by one counter
(``phases.count_round``), split by phase: kernel-launching ops in eager mode; in
graph mode the chunks' counters (replays, staging and readback copies, updates)
plus the ops of any phase left eager. Requests are then aborted, so every
measurement starts from the same state; last, B requests of ``E2E_MAX_NEW`` tokens
run to completion, speculatively and plainly (``e2e``), greedy and, with
``bench.temperature`` > 0, sampling. Repeats give a median and its spread
(``summary``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..checkpoint.train import Corpus, TrainSettings
from ..errors import ConfigError
from ..profile.counting import RoundCounter, compiled_counter, launch_counter
from ..runtime.engine import SpecEngine
from .e2e import E2E_MAX_NEW, e2e_max_new, e2e_run, e2e_modes, e2e_summary
from .engines import Engines, build_engines
from .phases import PhaseTimer, ReplayClock, count_round
from .summary import compile_summary, ratio, round_modes, round_traces, summary
from .trace import TRACE_ROUNDS, record_trace, round_trace

# what callers import from here (the bench's measurement, split by concept)
__all__ = ["BenchSettings", "E2E_MAX_NEW", "Engines", "PhaseTimer", "bench_bucket",
           "bench_prompts", "build_engines", "count_round", "e2e_max_new", "e2e_run",
           "measure"]


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
    engine.chunks.observer = timer
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            _steady(engine.step(), n)
            walls.append(time.perf_counter() - start)
    finally:
        engine.chunks.observer = None
    return {"round_s": walls, "phase_s": dict(timer.seconds),
            "synchronized": timer.synchronized}


def measure(engine: SpecEngine, prompts: list[list[int]], st: BenchSettings,
            counter: Callable[[str], RoundCounter] = launch_counter,
            trace_replays: bool = False, time_phases: bool = False,
            trace: bool = False) -> dict:
    """Steady rounds of ``len(prompts)`` requests on one engine; ``counter(device)``
    makes the counter of the counted round (``count_round``'s ``trace_replays``);
    ``time_phases``: also ``st.phase_rounds`` rounds timed phase by phase; ``trace``:
    also ``TRACE_ROUNDS`` rounds under the chunks' trace (``trace.record_trace``)."""
    phase_rounds = st.phase_rounds if time_phases else 0
    trace_rounds = TRACE_ROUNDS if trace else 0
    # first, warm-up, timed, traced, phase-timed, counted
    rounds = 1 + st.warmup_rounds + st.timed_rounds + trace_rounds + phase_rounds + 1
    # nobody finishes inside the window: up to S + 1 tokens a round, + the prefill's token
    max_new = rounds * (engine.num_steps + 1) + 2
    times, host, tokens = [], [], 0
    rids = [engine.add_request(p, max_new, stop_ids=[]) for p in prompts]
    engine.step()  # admission and prefill, then the first round
    before = engine.stats.as_dict()  # steady rounds only from here
    clock = engine.chunks.observer = ReplayClock()
    try:
        for i in range(st.warmup_rounds + st.timed_rounds):
            replay_s = clock.seconds
            start = time.perf_counter()
            outs = engine.step()
            elapsed = time.perf_counter() - start
            _steady(outs, len(prompts))
            if i >= st.warmup_rounds:
                times.append(elapsed)
                # the host's part of the round: all but the graph replay calls
                host.append(elapsed - (clock.seconds - replay_s))
                tokens += sum(len(o.new_tokens) for o in outs)
    finally:
        engine.chunks.observer = None

    def steady() -> list:  # one untimed steady round
        return _steady(engine.step(), len(prompts))

    traced = round_trace(record_trace(engine.chunks, steady, trace_rounds)) if trace else None
    phases = _time_phases(engine, len(prompts), phase_rounds) if time_phases else None
    counters_before = engine.chunks.counters.as_dict()
    issued_before = engine.tp.counts.as_dict()
    counted = count_round(engine.chunks, steady, counter(str(engine.device)), trace_replays)
    counters = {k: v - counters_before[k] for k, v in engine.chunks.counters.as_dict().items()}
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
        "trace": traced,  # None unless trace
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


def _measure_mode(name: str, engine: SpecEngine, prompts: list[list[int]],
                  st: BenchSettings, engines: Engines) -> dict:
    """One measurement of the mode ``name``: the compile peer counted by a profiler over
    the whole round, the engines with phases timed phase by phase, the fused round
    (overlap off and on) traced."""
    if name == "compile_spec":
        label = engine.runner.backend.compiler.label
        return measure(engine, prompts, st, lambda d: compiled_counter(d, label),
                       trace_replays=True)
    return measure(engine, prompts, st,
                   time_phases=name in {"eager_spec", engines.split_mode()},
                   trace=name in engines.traced_modes())


def bench_bucket(engines: Engines, prompts: list[list[int]], st: BenchSettings,
                 tick=lambda: None, temperature: float = 0.0) -> dict:
    """One bucket. Without graphs (the eager backend) every graph figure is None;
    with ``temperature`` 0 the sampled end-to-end figures (``e2e_sampled``) are."""
    modes = engines.by_name()
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    pairs = e2e_modes(temperature, len(prompts))  # each run spec and plain
    e2e = {key: {"spec": [], "plain": []} for key in pairs}
    max_new = e2e_max_new(engines.spec, prompts)
    for _ in range(st.repeats):  # interleaved, so drift hits every mode alike
        for name, engine in modes.items():
            with torch.no_grad():
                runs[name].append(_measure_mode(name, engine, prompts, st, engines))
            tick()
        for key, sampling in pairs.items():
            with torch.no_grad():
                for side, engine in (("spec", engines.spec), ("plain", engines.plain)):
                    e2e[key][side].append(e2e_run(engine, prompts, max_new, sampling))
            tick()
    graphs = engines.has_graphs
    spec = runs["graph_spec" if graphs else "eager_spec"]
    request_rounds = sum(r["request_rounds"] for r in spec)
    accepted = sum(r["accepted"] for r in spec)
    eager, plain_eager = summary(runs["eager_spec"], False), summary(runs["eager_plain"], False)
    graph = summary(spec, True) if graphs else None
    plain_graph = summary(runs["graph_plain"], True) if graphs else None
    speedup_eager = eager["tokens_per_s"] / plain_eager["tokens_per_s"]
    s = engines.spec.num_steps
    peer = (compile_summary(runs["compile_spec"], engines.compile_spec)
            if engines.compile_spec is not None else None)
    by_mode = round_modes(engines, runs, graph)
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
        "round_modes": by_mode,
        "fused_vs_split_latency": ratio(by_mode["fused"], by_mode["split"]),
        "overlap_vs_fused_latency": ratio(by_mode["overlap"], by_mode["fused"]),
        # a few steady rounds of the fused round, overlap off and on, as launch and read
        # events, and whether each read is off the next launch's critical path
        "round_trace": round_traces(engines, runs),
        # the compile peer (bench.compile_peer), speculative only; None without one
        "compile": peer,
        "compile_vs_graph_latency": ratio(peer, graph),
        "compile_vs_eager_latency": ratio(peer, eager),
        "spec_vs_plain": {
            "acceptance_length": (accepted + request_rounds) / request_rounds,
            "draft_acceptance_rate": accepted / max(sum(r["proposed"] for r in spec), 1),
            # on the config's backend: graphs, or eager when that is the backend
            "speedup": head["tokens_per_s"] / head_plain["tokens_per_s"],
            "speedup_eager": speedup_eager,
            "tpot_ms": {"spec": head["tpot_ms"], "plain": head_plain["tpot_ms"]},
            # a plain round emits 1 token per request: speculation pays off above this
            # acceptance length (the speculative round over the plain one)
            "break_even_acceptance_length": ratio(head, head_plain),
        },
        # end to end at equal batch: B requests of max_new_tokens, spec vs plain, greedy
        # and (None with bench.temperature 0) every request sampling at the temperature
        "e2e": e2e_summary(e2e["e2e"], len(prompts), max_new),
        "e2e_sampled": (e2e_summary(e2e["e2e_sampled"], len(prompts), max_new, temperature)
                        if "e2e_sampled" in e2e else None),
    }


def bench_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    """In-distribution prompts for the trained checkpoint (16..40 tokens)."""
    corpus = Corpus(vocab, TrainSettings().phrases, torch.Generator().manual_seed(seed))
    return [corpus.sample(16 + (8 * i) % 25) for i in range(n)]
