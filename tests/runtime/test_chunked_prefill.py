"""Chunked prefill under a per-step token budget (``scheduler.prefill_token_budget``).

- Any budget gives exactly the unchunked engine's tokens (greedy and seeded sampling,
  speculative and plain) and the oracle's, eager and on the cpu graphs (split and
  fused rounds), with prompts past the SWA window and across C4 and C128 blocks, the
  chunk ends falling inside blocks.
- A running request gets a round every step while a long prompt is prefilled in
  chunks; the long one has no output before its final chunk.
- Abort mid-prefill frees the row; a fault in a chunk fails exactly its requests; an
  interrupt in a chunk (even after its forward wrote the rings) loses nothing.
- Bad ``scheduler:`` values are errors naming the key; tp = 2 follows rank 0's chunks.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from nextn_graph.config import (GraphConfig, PoolConfig, SchedulerConfig, SpeculativeConfig,
                                load_run_config)
from nextn_graph.errors import ConfigError
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.scheduler import budget_chunks
from nextn_graph.runtime.request import Request
from nextn_graph.sampling import SamplingParams

from helpers import corpus_prompts, random_prompt
from test_faults import Faults, InjectedFault, check, drive, schedule

SPEC = SpeculativeConfig(num_steps=3)
POOL = PoolConfig(max_requests=3, max_context=224)
GRAPHS = {"eager": None,
          "split": GraphConfig(backend="cpu", buckets=(1, 2), round="split"),
          "fused": GraphConfig(backend="cpu", buckets=(1, 3), round="fused", overlap="on")}
# (arrival step, prompt, max_new, sampling): 140 tokens cross the window (16), 35 C4
# blocks and the first C128 block; 41 ends inside a C4 block; the short one runs while
# the others are prefilled. The 140-token one samples (speculatively: its tokens must
# equal the unchunked engine's; its bonus and candidate 1 come from its final chunk).
SCHEDULE = [(0, corpus_prompts(3, [6])[0], 40, None),
            (1, random_prompt(140, 7), 10, SamplingParams(0.9, top_k=8, seed=5)),
            (2, corpus_prompts(4, [41])[0], 12, None)]

_REF: dict[tuple, list[int]] = {}


def oracle(target, prompt: list[int], max_new: int, sampling=None) -> list[int]:
    key = (tuple(prompt), max_new, sampling)
    if key not in _REF:
        _REF[key] = reference_generate(target, [prompt], max_new, stop_ids=set(),
                                       max_context=len(prompt) + max_new,
                                       sampling=sampling).outputs[0]
    return _REF[key]


@pytest.fixture(scope="module")
def engines(trained):
    """Engines by (graph mode, budget, speculative?), built (captured) once; idle after use."""
    cache: dict[tuple, SpecEngine] = {}

    def get(mode: str, budget: int, spec: bool = True) -> SpecEngine:
        key = (mode, budget, spec)
        if key not in cache:
            cache[key] = SpecEngine(trained.target, trained.draft, SPEC if spec else None,
                                    POOL, GRAPHS[mode], scheduler=SchedulerConfig(budget))
        eng = cache[key]
        while eng.has_work:  # only after a failed test: don't let it cascade
            eng.step()
        return eng

    return get


def run(eng: SpecEngine, sched, on_step=None, step_fn=None):
    """Run ``sched`` to completion -> (outputs by index, errors by index, the step at
    which each index got its first token). ``on_step(step)`` runs before each step,
    ``step_fn`` instead of ``eng.step``."""
    rid_of, outputs, errors, first = {}, defaultdict(list), {}, {}
    step = 0
    while len(rid_of) < len(sched) or eng.has_work:
        assert step < 400, "engine did not finish"
        for i, (at, prompt, max_new, smp) in enumerate(sched):
            if at == step:
                rid_of[eng.add_request(prompt, max_new, stop_ids=[], sampling=smp)] = i
        if on_step is not None:
            on_step(step)
        try:
            outs = (step_fn or eng.step)()
        except KeyboardInterrupt:
            outs = []
        for o in outs:
            i = rid_of[o.rid]
            if o.new_tokens and i not in first:
                first[i] = step
            outputs[i].extend(o.new_tokens)
            if o.error is not None:
                errors[i] = o.error
        step += 1
    pool = eng.models.target_pool
    assert pool.free_rows == pool.layout.max_requests and not eng.has_work
    return dict(outputs), errors, first


_UNCHUNKED: dict[str, tuple] = {}


def unchunked(engines, mode: str) -> tuple:
    """SCHEDULE on the unlimited budget -> (outputs, first-token steps, (proposed,
    accepted) drafts), run once per graph mode."""
    if mode not in _UNCHUNKED:
        eng = engines(mode, 0)
        before = eng.stats.snapshot()
        want, _, first = run(eng, SCHEDULE)
        st = eng.stats.since(before)
        _UNCHUNKED[mode] = want, first, (st.proposed_drafts, st.accepted_drafts)
    return _UNCHUNKED[mode]


# 40 and 50: chunks longer than the SWA ring (16 + N - 1) that start inside the prompt
@pytest.mark.parametrize("mode,budget", [("eager", 1), ("eager", 7), ("eager", 40),
                                         ("split", 3), ("split", 16), ("fused", 7),
                                         ("fused", 16), ("fused", 50)])
def test_chunked_equals_unchunked_and_oracle(engines, trained, mode, budget):
    want, first0, drafts0 = unchunked(engines, mode)
    eng = engines(mode, budget)
    before = eng.stats.snapshot()
    got, errors, first = run(eng, SCHEDULE)
    assert not errors and got == want
    # the draft saw the same prompts: the same candidates were proposed and accepted
    # (a wrong draft extend of a chunk costs acceptance, never a greedy token)
    st = eng.stats.since(before)
    assert (st.proposed_drafts, st.accepted_drafts) == drafts0
    for i, (_, prompt, max_new, smp) in enumerate(SCHEDULE):
        if smp is None:
            assert got[i] == oracle(trained.target, prompt, max_new), i
    # the long prompt really went in chunks: its first token came budget-many steps late
    assert first[1] - first0[1] >= 140 // budget - 1
    assert st.prompt_tokens == sum(len(p) for _, p, _, _ in SCHEDULE)


def test_plain_sampling_chunked_equals_oracle(engines, trained):
    """Plain decoding (no draft) samples exactly the oracle's draws after chunks."""
    sched = [(at, p, n, SamplingParams(1.0, seed=11 + at)) for at, p, n, _ in SCHEDULE]
    got, errors, _ = run(engines("eager", 7, spec=False), sched)
    assert not errors
    for i, (_, prompt, max_new, smp) in enumerate(sched):
        assert got[i] == oracle(trained.target, prompt, max_new, smp), i


def test_running_stream_gets_a_round_every_step(engines, trained):
    """While a 140-token prompt is prefilled 7 tokens a step (20 steps), the running
    request gets tokens from every step and the long one none before its last chunk."""
    eng = engines("eager", 7)
    short, long_ = corpus_prompts(5, [6])[0], random_prompt(140, 3)
    a = eng.add_request(short, 100, stop_ids=[])
    outs = [eng.step()]  # a: prefill (6 tokens fit the budget) and its first round
    b = eng.add_request(long_, 6, stop_ids=[])
    chunks_before = eng.stats.prefill_chunks
    while not any(o.rid == b for o in outs[-1]):
        outs.append(eng.step())
        assert len(outs) < 40
    steps = outs[1:]
    assert len(steps) == 20  # ceil(140 / 7) steps of chunks, the bonus at the last
    assert eng.stats.prefill_chunks - chunks_before == 20
    for k, step in enumerate(steps):
        got = {o.rid: o.new_tokens for o in step}
        assert got.get(a), f"step {k}: the running request got no round"
        assert (b in got) == (k == len(steps) - 1)
    tokens = defaultdict(list)
    for step in outs:
        for o in step:
            tokens[o.rid].extend(o.new_tokens)
    while eng.has_work:
        for o in eng.step():
            tokens[o.rid].extend(o.new_tokens)
    assert tokens[a] == oracle(trained.target, short, 100)
    assert tokens[b] == oracle(trained.target, long_, 6)


def test_abort_mid_prefill_frees_the_row(engines, trained):
    """abort() of a request being prefilled returns its row at once; a later request
    prefilled into that row (over the aborted one's KV) equals the oracle."""
    eng = engines("split", 16)
    pool = eng.models.target_pool
    run_, long_ = eng.add_request(corpus_prompts(6, [8])[0], 30, stop_ids=[]), None
    eng.step()
    long_ = eng.add_request(random_prompt(150, 9), 5, stop_ids=[])
    for _ in range(4):  # 64 of its 150 positions
        assert all(o.rid != long_ for o in eng.step())
    assert pool.free_rows == 1
    assert eng.abort(long_) and pool.free_rows == 2 and not eng.abort(long_)
    late = random_prompt(97, 10)
    rid = eng.add_request(late, 9, stop_ids=[])
    out = defaultdict(list)
    while eng.has_work:
        for o in eng.step():
            assert o.rid != long_
            out[o.rid].extend(o.new_tokens)
    assert out[rid] == oracle(trained.target, late, 9)
    assert len(out[run_]) > 0 and pool.free_rows == 3


# a step's prefill fails: the first at step 3 (the 140-token prompt alone, mid-prefill,
# budget 16); at step 9 its final chunk shares the forward with the 41-token one's first
@pytest.mark.parametrize("fire_at,failed", [(3, {1}), (9, {1, 2})])
def test_fault_in_a_chunk_fails_only_its_requests(engines, trained, fire_at, failed):
    eng = engines("split", 16)
    sched = [(0, SCHEDULE[0][1], 40, None), (1, SCHEDULE[1][1], 10, None),
             (2 if fire_at == 3 else 8, SCHEDULE[2][1], 12, None)]
    faults = Faults(eng, {"prefill"}, InjectedFault)
    faults.points = set()

    def arm(step):
        if step == fire_at:
            faults.points = {"prefill"}

    try:
        got, errors, _ = run(eng, sched, arm, faults.step)
    finally:
        faults.close()
    assert faults.fired == ["prefill"]
    assert set(errors) == failed
    assert all("InjectedFault: injected fault at prefill" in e for e in errors.values())
    for i, (_, prompt, max_new, _) in enumerate(sched):
        if i in failed:
            assert got.get(i, []) == []
        else:
            assert got[i] == oracle(trained.target, prompt, max_new), i


@pytest.mark.parametrize("model", ["target", "draft"])
def test_interrupt_in_a_chunk_loses_nothing(engines, trained, model):
    """KeyboardInterrupt once in every 16-row chunk of a 140-token prompt (budget 16),
    before its target forward or after it (at the draft's, when the target's rings hold
    the chunk already): nobody fails, outputs equal the oracle, and the final chunk's
    logits equal the oracle's (a token rarely shows a corrupted window: this model's
    margins are wide). A chunk of 16 rows wraps the SWA ring (16 + 3 rows) onto
    positions before its start, so resuming at the chunk would read clobbered keys
    (logits off by ~0.7): the request restarts its prefill instead."""
    eng = engines("eager", 16)
    sched = [(at, p, n, None) for at, p, n, _ in SCHEDULE[:2]]
    fired, final = [], []

    def interrupt(module, args):
        batch = args[0]  # only prefill forwards have 16 rows here (rounds: 4 a request)
        key = int(batch.cache_start.min())
        if batch.num_rows == 16 and key not in fired:
            fired.append(key)
            raise KeyboardInterrupt

    def keep_final(module, args, out):
        if args[0].num_rows == 12 and int(args[0].cache_start.min()) == 128:
            final.append(out.logits)  # [12, V]: positions 128..139, the final chunk

    mod = trained.target if model == "target" else trained.draft
    handles = [mod.register_forward_pre_hook(interrupt),
               trained.target.register_forward_hook(keep_final)]
    try:
        got, errors, _ = run(eng, sched)
    finally:
        for h in handles:
            h.remove()
    assert fired == list(range(0, 128, 16)) and not errors
    for i, (_, prompt, max_new, _) in enumerate(sched):
        assert got[i] == oracle(trained.target, prompt, max_new), i
    want = trained.target.reference(torch.tensor(sched[1][1])).logits[128:]
    torch.testing.assert_close(final[-1], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("error", [InjectedFault, KeyboardInterrupt])
def test_faults_schedule_with_a_budget(trained, error):
    """tests/runtime/test_faults.py's schedule (7 requests on a pool of 5, eager) with budget 7, a fault or interrupt at a prefill forward, a prefill readback and
    a verify: the faulted units fail (none on interrupts), the rest equal the oracle."""
    eng = SpecEngine(trained.target, trained.draft, SPEC, PoolConfig(5, 160), None,
                     scheduler=SchedulerConfig(7))
    points = {"prefill", "prefill_readback", "target_verify@0"}
    faults = Faults(eng, points, error)
    try:
        outputs, errors = drive(eng, schedule(3), faults, fire_from=2)
    finally:
        faults.close()
    assert set(faults.fired) == points
    assert bool(errors) == (error is InjectedFault)
    check(eng, trained, schedule(3), outputs, errors)


def test_budget_chunks_first_come_first_served():
    """The plan: earlier requests first, the budget cut across the last one; 0 is unlimited."""
    reqs = [Request(i, list(range(n)), 4, frozenset()) for i, n in enumerate((10, 5, 30))]
    reqs[0].prefilled = 4
    assert [(r.rid, e) for r, e in budget_chunks(reqs, 9)] == [(0, 10), (1, 3)]
    assert [(r.rid, e) for r, e in budget_chunks(reqs, 6)] == [(0, 10)]
    assert [(r.rid, e) for r, e in budget_chunks(reqs, 0)] == [(0, 10), (1, 5), (2, 30)]
    assert [(r.rid, e) for r, e in budget_chunks(reqs, 1)] == [(0, 5)]


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text("graph:\n  backend: eager\npool:\n  max_requests: 2\n  max_context: 64\n"
                    + text)
    return path


def test_scheduler_section_loads_and_reaches_the_engine(tmp_path):
    cfg = load_run_config(write(tmp_path, "scheduler:\n  prefill_token_budget: 256\n"))
    assert cfg.scheduler == SchedulerConfig(256)
    assert load_run_config(write(tmp_path, "")).scheduler == SchedulerConfig(0)
    assert SpecEngine.from_config(cfg).scheduler.prefill_budget == 256


@pytest.mark.parametrize("text,match", [
    ("scheduler:\n  prefill_token_budget: -1\n", r"prefill_token_budget' must lie in \[0, "),
    ("scheduler:\n  prefill_token_budget: 4294967296\n", "must lie in"),
    ("scheduler:\n  prefill_token_budget: 2.5\n", "prefill_token_budget' must be an integer"),
    ("scheduler:\n  prefill_token_budget: true\n", "prefill_token_budget' must be an integer"),
    ("scheduler:\n  prefill_token_budget: null\n", "prefill_token_budget' must be an integer"),
    ("scheduler:\n  prefill_token_budget: '256'\n", "must be an integer"),
    ("scheduler:\n  budget: 3\n", "unknown key 'scheduler.budget'"),
    ("scheduler: 256\n", "key 'scheduler' must be a mapping"),
])
def test_bad_scheduler_values_name_the_key(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as exc:
        load_run_config(path)
    assert str(path) in str(exc.value) and "scheduler" in str(exc.value)


@pytest.mark.parametrize("budget,match", [(-5, "must lie in"), ("8", "must be an integer")])
def test_scheduler_built_in_code_is_checked(tiny, budget, match):
    with pytest.raises(ConfigError, match=f"SpecEngine: key 'scheduler.prefill_token_budget' "
                                          f"{match}"):
        SpecEngine(tiny.target, tiny.draft, SPEC, POOL, None,
                   scheduler=SchedulerConfig(budget))


# -- tensor parallelism ------------------------------------------------------------------

def _tp_run(group, budget: int):
    from nextn_graph.checkpoint import load_checkpoint
    from nextn_graph.launch.follower import serve, shutdown

    torch.set_num_threads(1)
    models = load_checkpoint("builtin:tiny-trained", tp=group)
    if not group.is_driver:
        return serve(models, group)
    with torch.no_grad():
        eng = SpecEngine(models.target, models.draft, SPEC, POOL, None,
                         scheduler=SchedulerConfig(budget))
        got = run(eng, SCHEDULE)[0]
        control = eng.tp.counts.as_dict()["control"]
    shutdown(group)
    return got, control


@pytest.mark.process
def test_tp2_follows_rank0_chunks():
    """tp = 2 with budget 16 (eager: the graphs' followers are tests/runtime/test_tp_engine.py's):
    rank 1 replays rank 0's chunks; tokens equal tp = 1."""
    from nextn_graph.parallel.group import TPGroup
    from nextn_graph.launch.ranks import spawn

    got, control = spawn(_tp_run, 2, (16,), timeout_s=120)[0]
    want, _ = _tp_run(TPGroup.single(), 16)
    assert got == want and control > 0
