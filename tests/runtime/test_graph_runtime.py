"""The speculative runtime with its decode phases captured as graphs (cpu emulator).

Every graph run is compared with the eager runtime (same engine, no GraphConfig)
and with the no-cache oracle ``reference_generate``: tokens, per-round proposals
(``StepOutput.draft_tokens``) and acceptance statistics must be identical, for
every batch size from 1 to one above the largest bucket, while batches grow and
shrink between rounds. Then the replay manager's own promises: padding rows are
inert, switched-off kinds run eagerly and are counted, a steady round costs a
fixed number of replays and copies, the debug address check names what moved,
and the CLI reports all of it.

Engines are expensive only at capture (~0.5 s each), so each distinct engine is
built once per module and reused across requests; every test that borrows a
shared engine starts and leaves it idle.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nextn_graph.cli import main
from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.oracle import reference_candidates

from helpers import corpus_prompts, random_prompt

REPO = Path(__file__).resolve().parents[2]
BUCKETS = (1, 2, 4)
# Statistics that must not change when graphs are switched on (forward counts do:
# a round split into bucket-sized chunks runs one forward per chunk).
SPEC_STATS = ("rounds", "request_rounds", "proposed_drafts", "accepted_drafts",
              "emitted_tokens", "prefill_forwards", "prompt_tokens")


# -- models, prompts, references ---------------------------------------------------------

_REF: dict[tuple, list[int]] = {}


def reference(target, prompt: list[int], max_new: int, stops=()) -> list[int]:
    """The oracle's greedy output (memoised, prefix-closed), cut at max_new and after
    the first stop token."""
    key = (target, tuple(prompt))
    have = _REF.get(key)
    if have is None or len(have) < max_new:
        have = reference_generate(target, [prompt], max_new, stop_ids=set(),
                                  max_context=len(prompt) + max_new).outputs[0]
        _REF[key] = have
    out = have[:max_new]
    cut = next((i for i, t in enumerate(out) if t in set(stops)), None)
    return out if cut is None else out[:cut + 1]


# -- engines -----------------------------------------------------------------------------

def make_engine(models, num_steps: int, max_requests: int = 6, max_context: int = 320,
                graph: GraphConfig | None = None) -> SpecEngine:
    return SpecEngine(models.target, models.draft,
                      SpeculativeConfig(num_steps=num_steps, num_draft_tokens=num_steps + 1),
                      PoolConfig(max_requests, max_context), graph)


def cpu_graphs(**kw) -> GraphConfig:
    return GraphConfig(backend="cpu", buckets=kw.pop("buckets", BUCKETS), **kw)


@pytest.fixture(scope="module")
def engines(trained, tiny):
    """Shared engines by (model, num_steps, graph?): built (captured) once per module."""
    cache: dict[tuple, SpecEngine] = {}
    models = {"trained": trained, "tiny": tiny}

    modes = {"split": {"round": "split"}, "fused": {"round": "fused", "overlap": "off"},
             "overlap": {"round": "fused", "overlap": "on"}}

    def get(model: str, num_steps: int, graphs: bool | str) -> SpecEngine:
        """graphs: False (eager), True (the defaults: fused with overlap) or a mode."""
        key = (model, num_steps, graphs)
        if key not in cache:
            kw = modes.get(graphs, {}) if isinstance(graphs, str) else {}
            cache[key] = make_engine(models[model], num_steps,
                                     graph=cpu_graphs(**kw) if graphs else None)
        eng = cache[key]
        while eng.has_work:  # only after a failed test: don't let its failure cascade
            eng.step()
        return eng

    return get


@dataclass
class Req:
    at: int  # the step() call before which add_request runs
    prompt: list[int]
    max_new: int
    stops: list[int] = field(default_factory=list)


@dataclass
class Run:
    outputs: dict[int, list[int]]  # by schedule index
    trace: dict[int, list[tuple]]  # by schedule index: (new_tokens, draft_tokens) per round
    batch_sizes: list[int]  # requests in each decode round, in order
    stats: dict  # SpecStats delta over the run
    counters: dict  # ReplayCounters delta over the run


def run_schedule(eng: SpecEngine, schedule: list[Req], max_steps: int = 600) -> Run:
    """add_request each request before step() number ``at``; step() until all are done."""
    assert not eng.has_work
    stats0, counters0 = dict(vars(eng.stats)), eng.chunks.counters.as_dict()
    rid_of: dict[int, int] = {}
    outputs: dict[int, list[int]] = defaultdict(list)
    trace: dict[int, list[tuple]] = defaultdict(list)
    sizes: list[int] = []
    steps = 0
    while len(rid_of) < len(schedule) or eng.has_work:
        assert steps < max_steps, "engine did not finish"
        for i, r in enumerate(schedule):
            if r.at == steps:
                rid_of[i] = eng.add_request(r.prompt, r.max_new, stop_ids=r.stops)
        steps += 1
        if not eng.has_work:
            continue
        index = {rid: i for i, rid in rid_of.items()}
        outs = eng.step()
        rounds = [o for o in outs if o.draft_tokens]
        if rounds:
            sizes.append(len(rounds))
        for o in outs:
            outputs[index[o.rid]].extend(o.new_tokens)
            if o.draft_tokens:
                trace[index[o.rid]].append((tuple(o.new_tokens), tuple(o.draft_tokens)))
    stats = {k: v - stats0[k] for k, v in vars(eng.stats).items()
             if k in SPEC_STATS or k == "verify_forwards"}
    counters = {k: v - counters0[k] for k, v in eng.chunks.counters.as_dict().items()}
    return Run(dict(outputs), dict(trace), sizes, stats, counters)


def assert_same_run(graph: Run, eager: Run) -> None:
    """Graphs on and off: same tokens, same proposals and acceptance in every round."""
    assert graph.outputs == eager.outputs
    assert graph.trace == eager.trace  # every round's committed chunk and draft_tokens
    assert graph.batch_sizes == eager.batch_sizes
    # accepted_drafts / request_rounds is the acceptance length.
    assert {k: graph.stats[k] for k in SPEC_STATS} == {k: eager.stats[k] for k in SPEC_STATS}
    # One verify forward per chunk: rounds, plus one per extra chunk of a split round.
    assert graph.stats["verify_forwards"] == graph.counters["chunks"]
    assert eager.stats["verify_forwards"] == eager.stats["rounds"]
    assert eager.counters["graph_replays"] == 0 and graph.counters["eager_fallbacks"] == 0


def grow_and_shrink(seed: int) -> list[Req]:
    """1 -> 2 -> 4 -> 5 (a split) -> 6 running, then requests leave at different rounds
    (one at its prefill, one on a stop token): the batch shrinks through 4 and 3 (padded)."""
    c = corpus_prompts(seed, [12, 30, 5, 40, 9, 21])
    r = [random_prompt(17, seed + 1), random_prompt(3, seed + 2)]
    return [Req(0, c[0], 44), Req(1, c[1], 14), Req(2, c[2], 30), Req(2, r[0], 8),
            Req(3, c[3], 22), Req(4, r[1], 1), Req(6, c[4], 12), Req(7, c[5], 18, stops=[])]


# -- 1. parity ---------------------------------------------------------------------------

@pytest.mark.parametrize("model,num_steps,mode", [
    ("trained", 3, "split"), ("trained", 1, "split"), ("tiny", 2, "split"),
    ("trained", 3, "fused"), ("trained", 1, "fused"), ("tiny", 2, "fused"),
    ("trained", 3, "overlap"), ("trained", 1, "overlap"), ("tiny", 2, "overlap")])
def test_graph_parity_growing_and_shrinking_batches(engines, model, num_steps, mode, request):
    """Graphs equal eager and reference (tokens, drafts, acceptance), batch 1..6 up and down,
    for split rounds, fused rounds and fused rounds with overlap (whose tokens arrive a
    step later, so only its per-step shape differs)."""
    models = request.getfixturevalue(model)
    # Seeds whose runs pass through every batch size 1..5 both ways (asserted below);
    # the trained checkpoint's acceptance decides when requests leave.
    schedule = grow_and_shrink({1: 41, 2: 42, 3: 51}[num_steps])
    # A stop token inside the longest request's output: it ends on the stop, not the limit.
    full = reference(models.target, schedule[0].prompt, schedule[0].max_new)
    schedule[0].stops = [full[31]]
    graph = run_schedule(engines(model, num_steps, mode), schedule)
    eager = run_schedule(engines(model, num_steps, False), schedule)
    if mode == "overlap":
        assert graph.outputs == eager.outputs
        assert {k: [t for _, t in v] for k, v in graph.trace.items()} == {
            k: [t for _, t in v] for k, v in eager.trace.items()}  # every round's drafts
        assert {k: graph.stats[k] for k in SPEC_STATS} == {k: eager.stats[k] for k in SPEC_STATS}
    else:
        assert_same_run(graph, eager)
    for i, r in enumerate(schedule):
        assert graph.outputs[i] == reference(models.target, r.prompt, r.max_new, r.stops), i
    assert len(graph.outputs[0]) <= 32 and graph.outputs[0][-1] == full[31]
    # Every batch size from 1 to one above the largest bucket, and it went both ways.
    if mode == "overlap":
        return
    assert set(range(1, 6)) <= set(graph.batch_sizes)
    pairs = list(zip(graph.batch_sizes, graph.batch_sizes[1:]))
    assert any(b > a for a, b in pairs) and any(b < a for a, b in pairs)
    c = graph.counters
    assert c["bucket_splits"] == sum(b > 4 for b in graph.batch_sizes) > 0
    assert c["padded_rows"] == sum(b == 3 for b in graph.batch_sizes) > 0  # 3 -> bucket 4
    per_round = 1 if mode == "fused" else (3 if num_steps > 1 else 2)
    assert c["graph_replays"] == c["chunks"] * per_round


@pytest.mark.heavy
def test_graph_parity_long_requests_cross_window_and_c128(engines, trained):
    """2 x ~260 tokens (past SWA, C4, C128 at 128/256): graphs equal eager and reference."""
    p = corpus_prompts(7, [12, 30])
    schedule = [Req(0, p[0], 260), Req(0, p[1], 230)]  # last positions 273 and 261
    graph = run_schedule(engines("trained", 3, "fused"), schedule)
    eager = run_schedule(engines("trained", 3, False), schedule)
    assert_same_run(graph, eager)
    overlap = run_schedule(engines("trained", 3, "overlap"), schedule)
    assert overlap.outputs == eager.outputs
    ref = reference_generate(trained.target, [p[0], p[1]], 260, stop_ids=set(),
                             max_context=300).outputs
    assert graph.outputs == {0: ref[0], 1: ref[1][:230]}
    assert graph.batch_sizes[0] == 2 and graph.batch_sizes[-1] == 1
    assert graph.stats["accepted_drafts"] / graph.stats["request_rounds"] + 1 > 2.0
    assert graph.counters["padded_rows"] == 0 and graph.counters["bucket_splits"] == 0


def test_generate_stats_report_splits_and_padding(engines, trained):
    """generate's stats show a split for 5 requests, padding for 3; tokens equal the reference."""
    eng = engines("trained", 3, True)
    prompts = corpus_prompts(60, [7, 15, 22, 30, 11])
    five = eng.generate(prompts, 10, stop_ids=[])
    three = eng.generate(prompts[:3], 10, stop_ids=[])
    assert five.outputs == [reference(trained.target, p, 10) for p in prompts]
    assert three.outputs == five.outputs[:3]
    assert five.stats["bucket_splits"] > 0 and five.stats["backend"] == "cpu"
    assert three.stats["bucket_splits"] == 0 and three.stats["padded_rows"] > 0
    assert five.stats["eager_fallbacks"] == three.stats["eager_fallbacks"] == 0


# -- 2. draft alignment ------------------------------------------------------------------

def test_graph_drafts_equal_the_oracle(engines, trained):
    """On graphs each round's draft_tokens equal reference_candidates, padded/split rounds too."""
    s = 3
    eng = engines("trained", s, True)
    prompts = corpus_prompts(0, [13, 21, 8]) + corpus_prompts(4, [18, 26])
    limits = [14, 20, 10, 12, 9]
    arrivals = [0, 0, 0, 2, 2]
    outputs: dict[int, list[int]] = defaultdict(list)
    reqs: dict[int, tuple[list[int], int]] = {}  # rid -> (prompt, max_new_tokens)
    counters0 = eng.chunks.counters.as_dict()
    checked, steps = 0, 0
    while len(reqs) < len(prompts) or eng.has_work:
        for p, n, at in zip(prompts, limits, arrivals):
            if at == steps:
                reqs[eng.add_request(p, n, stop_ids=[])] = (p, n)
        steps += 1
        for out in eng.step():
            if out.draft_tokens:
                before = outputs[out.rid]
                want = reference_candidates(trained.target, trained.draft,
                                            reqs[out.rid][0] + before[:-1], before[-1], s)
                assert out.draft_tokens == want, (out.rid, len(before))
                checked += 1
            outputs[out.rid].extend(out.new_tokens)
    counters = {k: v - counters0[k] for k, v in eng.chunks.counters.as_dict().items()}
    assert checked >= 12
    assert counters["padded_rows"] > 0 and counters["bucket_splits"] > 0
    for rid, (p, n) in reqs.items():
        assert outputs[rid] == reference(trained.target, p, n), rid


# -- 3. random schedules -----------------------------------------------------------------

@pytest.fixture(scope="module")
def schedule_engine(trained):
    """One graph engine for every hypothesis example: trained, buckets (1, 2, 4), pool (6, 256)."""
    return make_engine(trained, 3, max_requests=6, max_context=256, graph=cpu_graphs())


REQUEST = st.tuples(
    st.integers(0, 6),  # arrival: the step() before which the request is added
    st.integers(1, 40),  # prompt length
    st.integers(0, 10_000),  # prompt seed
    st.booleans(),  # corpus (high acceptance) or uniform random tokens
    st.integers(1, 24),  # max_new_tokens
    st.one_of(st.none(), st.integers(0, 23)),  # stop: the reference's token at this index
)


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(st.lists(REQUEST, min_size=1, max_size=6))
@pytest.mark.heavy
def test_random_schedules_equal_the_reference(trained, schedule_engine, drawn):
    """Random arrivals, lengths, limits, stops on one graph engine: outputs equal the reference."""
    with torch.no_grad():
        schedule = []
        for at, n, seed, from_corpus, max_new, stop_at in drawn:
            prompt = corpus_prompts(seed, [n])[0] if from_corpus else random_prompt(n, seed)
            full = reference(trained.target, prompt, 24)
            schedule.append(Req(at, prompt, max_new, [] if stop_at is None else [full[stop_at]]))
        run = run_schedule(schedule_engine, schedule)
    assert not schedule_engine.has_work
    for i, r in enumerate(schedule):
        assert run.outputs[i] == reference(trained.target, r.prompt, r.max_new, r.stops), i


# -- 4. padding is inert -----------------------------------------------------------------

def poison(eng: SpecEngine, batch: int) -> None:
    """Garbage wherever a padding row may look: both state slots of row 0, round
    buffers past the batch, and request row 0 of every KV ring and entry table
    (target and draft)."""
    vocab = eng.cfg.vocab_size
    state = eng.state
    for slot in (0, state.rows):
        state.lengths[slot] = 10**6
        state.bonus[slot] = vocab - 1
        state.cand1[slot] = vocab - 1
        state.seed[slot] = math.nan
    bufs = vars(eng.chunks.round.bufs)
    max_batch = bufs["slots"].shape[0]
    if eng.chunks.round.fused:
        bufs = {k: v for k, v in bufs.items() if k != "slots"}
    for t in bufs.values():
        rows_per_request = t.shape[0] // max_batch  # hidden holds N rows per request
        tail = t[batch * rows_per_request:]
        tail.fill_(math.nan if t.is_floating_point() else 10**6)
    for pool in (eng.models.target_pool, eng.models.draft_pool):
        for layer in pool.layers:
            layer.swa.data[:layer.swa.size] = math.nan
            for comp in (layer.compressed, layer.index):
                if comp is not None:
                    comp.raw.data[:comp.raw.size] = math.nan
                    comp.entries[:comp.per_request] = math.nan


@pytest.mark.parametrize("round_mode", ["split", "fused"])
def test_padding_rows_are_inert(trained, round_mode):
    """Garbage in state row 0, buffers past the batch and KV row 0 never reaches real tokens.
    (Fused rounds keep the staged slots on the device between rounds: those are the
    runner's own record of what it staged, so the poison leaves them alone there.)"""
    eng = make_engine(trained, 3, max_requests=4, max_context=96,
                      graph=cpu_graphs(round=round_mode))
    prompts = corpus_prompts(21, [10, 19, 6]) + [random_prompt(15, 5)]
    limits = [7, 40, 13, 30]  # two leave early, at different rounds
    rids = [eng.add_request(p, n, stop_ids=[]) for p, n in zip(prompts, limits)]
    outputs: dict[int, list[int]] = defaultdict(list)
    pool, c = eng.models.target_pool, eng.chunks.counters
    padded_steps = 0
    while eng.has_work:
        # This step's batch: the running requests plus those it will admit.
        running = pool.layout.max_requests - pool.free_rows
        poison(eng, min(running + eng.num_waiting, pool.layout.max_requests))
        padded = c.padded_rows
        for o in eng.step():
            outputs[o.rid].extend(o.new_tokens)
        if c.padded_rows > padded:
            # A padding row ran over the poison: it read row 0 masked (length 0) and
            # wrote a length of at most N into row 0's other copy (fused rounds flip
            # padding between row 0's copies too).
            padded_steps += 1
            assert min(int(eng.state.lengths[0]), int(eng.state.lengths[eng.state.rows])) <= 4
    for rid, p, n in zip(rids, prompts, limits):
        assert outputs[rid] == reference(trained.target, p, n), rid
    assert padded_steps > 0 and c.padded_rows > 0
    assert c.graph_replays > 0 and c.eager_fallbacks == 0


# -- 5. kinds switched off ---------------------------------------------------------------

@pytest.mark.parametrize("kinds,replays,fallbacks", [(("target_verify",), 1, 2), ((), 0, 3)])
def test_kinds_switched_off_run_eagerly_and_are_counted(trained, kinds, replays, fallbacks):
    """Phases left out of graph.captured_phases run eagerly, counted per round; outputs equal reference."""
    prompts = corpus_prompts(31, [9, 24, 15])
    eng = make_engine(trained, 3, max_requests=4, max_context=96,
                      graph=cpu_graphs(captured_phases=kinds))
    assert {r.name for r in eng.runner.records} == {k + v for k in kinds
                                                     for v in ("", "+sampling")}
    res = eng.generate(prompts, 16, stop_ids=[])
    eager = make_engine(trained, 3, max_requests=4, max_context=96).generate(
        prompts, 16, stop_ids=[])
    assert res.outputs == [reference(trained.target, p, 16) for p in prompts]
    assert res.outputs == eager.outputs
    assert res.stats["acceptance_length"] == eager.stats["acceptance_length"]
    rounds = res.stats["rounds"]
    assert rounds > 0 and res.stats["bucket_splits"] == 0
    assert res.stats["graph_replays"] == replays * rounds
    assert res.stats["eager_fallbacks"] == fallbacks * rounds
    assert res.stats["backend"] == "cpu"


# -- 6. replay counts --------------------------------------------------------------------

@pytest.mark.parametrize("num_steps,round_mode,overlap,replays,staging", [
    (3, "split", "off", 3, 1), (1, "split", "off", 2, 1), (3, "fused", "off", 1, 0),
    (1, "fused", "off", 1, 0), (3, "fused", "on", 1, 0)])
def test_steady_round_costs(trained, num_steps, round_mode, overlap, replays, staging):
    """A steady 3-request round. Split: one replay per phase, 1 staging copy (the slots
    upload), 1 readback copy (the readout rows: accept_lens, preds, drafts), 0 updates,
    1 pad. Fused: 1 replay, 0 staging (the round flipped the slots itself), 1 readback.
    Overlapped: the same, and each round launched while the one before was unread."""
    eng = make_engine(trained, num_steps, graph=cpu_graphs(round=round_mode, overlap=overlap))
    for p in corpus_prompts(50, [10, 20, 30]):
        eng.add_request(p, 40, stop_ids=[])
    eng.step()  # admission and the first round
    for _ in range(5):
        before = eng.chunks.counters.as_dict()
        outs = eng.step()
        assert len(outs) == 3 and not any(o.finished for o in outs)
        delta = {k: v - before[k] for k, v in eng.chunks.counters.as_dict().items()}
        assert delta == {"chunks": 1, "graph_replays": replays, "staging_copies": staging,
                         "readback_copies": 1, "graph_updates": 0, "eager_fallbacks": 0,
                         "bucket_splits": 0, "padded_rows": 1, "real_rows": 3,
                         "graph_collectives": 0, "overlapped_rounds": int(overlap == "on"),
                         "sampled_chunks": 0}
    while eng.has_work:
        eng.step()


# -- 7. debug address check --------------------------------------------------------------

@pytest.mark.parametrize("name", ["bufs.slots", "state.seed"])
def test_debug_address_check_names_the_moved_buffer(trained, name):
    """debug_check_addresses: a moved static tensor raises CaptureError naming it; off: no check."""
    group, attr = name.split(".")
    for debug in (True, False):
        eng = make_engine(trained, 3, max_requests=2, max_context=64,
                          graph=cpu_graphs(buckets=(1, 2), debug_check_addresses=debug))
        eng.generate([[5, 6, 7, 8]], 4, stop_ids=[])  # nothing moved: rounds replay fine
        holder = eng.chunks.round.bufs if group == "bufs" else eng.state
        tensor = getattr(holder, attr)
        tensor.set_(torch.zeros_like(tensor))
        eng.add_request([5, 6, 7, 8], 6, stop_ids=[])
        if debug:  # the round's requests fail with the error; nothing replays
            replays = eng.chunks.counters.graph_replays
            outs = [o for _ in range(3) for o in eng.step()]
            failed = [o for o in outs if o.error is not None]
            assert len(failed) == 1 and failed[0].finished
            assert re.search(rf"CaptureError: static input {name} moved since capture",
                             failed[0].error)
            assert eng.chunks.counters.graph_replays == replays and not eng.has_work
            assert eng.models.target_pool.free_rows == 2
        else:
            replays = eng.chunks.counters.graph_replays
            while eng.has_work:
                eng.step()  # unchecked: the graphs replay over the stale storage
            assert eng.chunks.counters.graph_replays > replays


# -- 8. CLI ------------------------------------------------------------------------------

def test_cli_graph_backend_equals_eager_and_reference(tmp_path, capsys):
    """CLI on cpu_default.yaml (cpu graphs) equals --backend eager and --mode reference."""
    prompts = corpus_prompts(9, [6, 18, 31]) + [random_prompt(12, 3), random_prompt(2, 4)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    config = str(REPO / "capture_configs" / "cpu_default.yaml")

    def run(*extra: str) -> dict:
        rc = main(["generate", "--config", config, "--prompts", str(path),
                   "--max-new-tokens", "12", "--json", *extra])
        out = capsys.readouterr()
        assert rc == 0, out.err
        return json.loads(out.out)

    graph, eager, ref = run(), run("--backend", "eager"), run("--mode", "reference")
    outs = [r["output_ids"] for r in ref["requests"]]
    assert [r["output_ids"] for r in graph["requests"]] == outs
    assert [r["output_ids"] for r in eager["requests"]] == outs
    g, e = graph["stats"], eager["stats"]
    assert {"graph_replays", "eager_fallbacks", "padded_rows"} <= set(g)
    assert g["backend"] == "cpu" and e["backend"] == "eager"
    assert g["graph_replays"] > 0 and g["eager_fallbacks"] == 0
    assert g["padded_rows"] > 0  # 5 requests in bucket 8
    assert e["graph_replays"] == 0 and e["padded_rows"] == 0
    assert g["acceptance_length"] == e["acceptance_length"]


@pytest.mark.parametrize("extra", [["--backend", "npu"], ["--backend", "npu", "--device", "npu"]])
def test_cli_npu_backend_on_cpu_machine_is_one_line(tmp_path, capsys, extra):
    """--backend npu without torch_npu: exit 2, one line naming device/torch_npu, no traceback."""
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    rc = main(["generate", "--config", str(REPO / "capture_configs" / "cpu_default.yaml"),
               "--prompts", str(path), "--max-new-tokens", "4", *extra])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nextn-graph: error:")
    assert "torch_npu" in err or "device" in err
    assert "Traceback" not in err
