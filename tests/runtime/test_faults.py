"""Nothing lost under faults: a step is all-or-nothing per request.

Faults are injected at every boundary of ``step()``: the prefill forward, the
prefill readback, each phase of each chunk of a split round, and each chunk's
readback (and, for fused rounds with overlap, the round's graph and the read of
the round before it). After a fault (an exception) the requests of the unit that faulted
are failed explicitly, with the error; every other request's output still
equals the reference; the pool gets every row back. After an interrupt
(``KeyboardInterrupt``) nobody fails: everything resumes where it was.
"""

from __future__ import annotations

import random
from collections import defaultdict
from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.errors import RequestFailed
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.runtime.chunks import RoundObserver
from nextn_graph.runtime.engine import SpecEngine

from helpers import corpus_prompts, random_prompt

MAX_REQUESTS = 5
BUCKETS = (1, 2)  # 3..5 running requests split into chunks of 2, 2, 1
KINDS = ("rollout", "target_verify", "draft_extend")
POINTS = ("prefill", "prefill_readback",
          *(f"{k}@{c}" for c in (0, 1) for k in KINDS), "readback@0", "readback@1")
# Fused rounds with overlap (buckets (2, 5): every round is one chunk, so every round
# overlaps): the one graph per round, and the read of the round before it.
FUSED_POINTS = ("prefill", "prefill_readback", "round@0", "readback@0")


class InjectedFault(RuntimeError):
    pass


class Faults(TorchFunctionMode, RoundObserver):
    """Raises ``error`` once at each named point of a step (see ``POINTS``).

    Phases are seen as the runner's observer (``kind@chunk``), the
    prefill through a forward pre-hook on the target (outside any phase), and
    readbacks as the ``tolist`` host syncs (``readback@chunk`` after a round's
    phases, ``prefill_readback`` otherwise).
    """

    def __init__(self, eng: SpecEngine, points: set[str], error: type[BaseException]):
        super().__init__()
        self.eng, self.points, self.error, self.fired = eng, set(points), error, []
        self.chunk, self.in_round = -1, False
        eng.chunks.observer = self
        self._hook = eng.models.target.register_forward_pre_hook(self._prefill)

    def close(self) -> None:
        self.eng.chunks.observer = None
        self._hook.remove()

    def _fire(self, point: str) -> None:
        if point in self.points:
            self.points.discard(point)
            self.fired.append(point)
            raise self.error(f"injected fault at {point}")

    @contextmanager
    def phase(self, kind: str, replayed: bool):
        if kind == self.eng.chunks.round.units[0]:
            self.chunk += 1
        self.in_round = True
        self._fire(f"{kind}@{self.chunk}")
        yield

    def _prefill(self, module, args):
        if not self.in_round:
            self._fire("prefill")

    def step(self):
        self.chunk, self.in_round = -1, False
        with self:
            return self.eng.step()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self._fire(f"readback@{self.chunk}" if self.in_round else "prefill_readback")
            self.in_round = False
        return func(*args, **(kwargs or {}))


_REF: dict[tuple, list[int]] = {}


def reference(target, prompt: list[int], max_new: int) -> list[int]:
    key = (id(target), tuple(prompt), max_new)
    if key not in _REF:
        _REF[key] = reference_generate(target, [prompt], max_new, stop_ids=set(),
                                       max_context=len(prompt) + max_new).outputs[0]
    return _REF[key]


@pytest.fixture(scope="module")
def engines(trained):
    """Engines by backend, captured once; every test leaves them idle."""
    cache = {}

    def get(backend: str) -> SpecEngine:
        if backend not in cache:
            graph = {"cpu": GraphConfig(backend="cpu", buckets=BUCKETS, round="split"),
                     "fused": GraphConfig(backend="cpu", buckets=(2, MAX_REQUESTS),
                                          round="fused", overlap="on")}.get(backend)
            cache[backend] = SpecEngine(trained.target, trained.draft,
                                        SpeculativeConfig(num_steps=3, num_draft_tokens=4),
                                        PoolConfig(MAX_REQUESTS, 160), graph)
        eng = cache[backend]
        assert not eng.has_work
        return eng

    return get


def schedule(seed: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, max_new_tokens): 7 requests on a pool of 5, so some
    wait, some join mid-run, and rounds run 3..5 requests in split chunks."""
    rng = random.Random(seed)
    out = []
    for i in range(7):
        n = rng.randint(3, 40)
        prompt = corpus_prompts(seed * 10 + i, [n])[0] if i % 2 else random_prompt(n, seed + i)
        out.append((0 if i < 4 else rng.randint(1, 6), prompt, rng.randint(4, 24)))
    return out


def drive(eng: SpecEngine, sched, faults: Faults, fire_from: int, sampling=None):
    """Run ``sched`` to completion; faults may fire from step ``fire_from`` on.
    ``sampling``: request i's parameters (None: greedy). -> (outputs, errors) by
    schedule index."""
    points = set(faults.points)
    faults.points = set()
    rid_of, outputs, errors = {}, defaultdict(list), {}
    steps = 0
    while len(rid_of) < len(sched) or eng.has_work:
        assert steps < 300, "engine did not finish"
        for i, (at, prompt, max_new) in enumerate(sched):
            if at == steps:
                rid_of[eng.add_request(prompt, max_new, stop_ids=[],
                                       sampling=sampling and sampling[i])] = i
        if steps == fire_from:
            faults.points = points
        steps += 1
        try:
            outs = faults.step()
        except KeyboardInterrupt:
            continue  # an interrupt loses nothing: the next step goes on
        for o in outs:
            outputs[rid_of[o.rid]].extend(o.new_tokens)
            if o.error is not None:
                assert o.finished and not o.new_tokens
                errors[rid_of[o.rid]] = o.error
    return outputs, errors


def check(eng: SpecEngine, trained, sched, outputs, errors) -> None:
    for i, (_, prompt, max_new) in enumerate(sched):
        want = reference(trained.target, prompt, max_new)
        if i in errors:  # failed: what it got before the fault is right, nothing after
            assert outputs[i] == want[:len(outputs[i])], i
        else:
            assert outputs[i] == want, i
    pool = eng.models.target_pool
    assert pool.free_rows == pool.layout.max_requests
    assert not eng.has_work


# Eager rounds are one chunk of every running request: no chunk 1 to fault in.
CASES = ([("cpu", p) for p in POINTS] + [("eager", p) for p in POINTS if "@1" not in p]
         + [("fused", p) for p in FUSED_POINTS])


@pytest.mark.parametrize("backend,point", CASES)
def test_fault_fails_only_its_unit_and_survivors_equal_reference(engines, trained, backend,
                                                                 point):
    """A fault at each step boundary fails that unit's requests, with the error named;
    the rest equal the reference; every pool row comes back."""
    eng = engines(backend)
    sched = schedule((POINTS + FUSED_POINTS).index(point) + (backend == "fused"))
    faults = Faults(eng, {point}, InjectedFault)
    try:
        outputs, errors = drive(eng, sched, faults, fire_from=1 if "@" in point else 0)
    finally:
        faults.close()
    assert faults.fired == [point]
    assert errors and all(f"InjectedFault: injected fault at {point}" in e
                          for e in errors.values())
    # A unit is a prefill batch or one chunk: at most a bucket's worth in a graph round.
    split = backend == "cpu" and not point.startswith("prefill")
    assert len(errors) <= (max(BUCKETS) if split else MAX_REQUESTS)
    check(eng, trained, sched, outputs, errors)


@pytest.mark.parametrize("backend", ["eager", "cpu", "fused"])
def test_interrupt_at_any_boundary_loses_nothing(engines, trained, backend):
    """KeyboardInterrupt at every boundary: no request fails, all equal the reference."""
    eng = engines(backend)
    sched = schedule(7)
    points = {p for b, p in CASES if b == backend}
    faults = Faults(eng, points, KeyboardInterrupt)
    try:
        outputs, errors = drive(eng, sched, faults, fire_from=0)
    finally:
        faults.close()
    assert set(faults.fired) == points and not errors
    check(eng, trained, sched, outputs, errors)


@pytest.mark.parametrize("seed", range(4))
def test_random_faults_over_random_schedules(engines, trained, seed):
    """Several faults and interrupts at random boundaries of a random schedule."""
    rng = random.Random(seed)
    eng = engines(rng.choice(["eager", "cpu", "fused"]))
    sched = schedule(100 + seed)
    points = set(rng.sample([p for p in POINTS if "@1" not in p]
                            if not eng.chunks.round.fused else FUSED_POINTS, 3))
    error = rng.choice([InjectedFault, KeyboardInterrupt, MemoryError])
    faults = Faults(eng, points, error)
    try:
        outputs, errors = drive(eng, sched, faults, fire_from=rng.randint(0, 3))
    finally:
        faults.close()
    assert faults.fired  # at least one point was reached
    assert bool(errors) == (error is not KeyboardInterrupt)
    check(eng, trained, sched, outputs, errors)


def test_generate_reports_failed_requests_with_partial_result(engines, trained):
    """generate(): a fault raises RequestFailed naming the failed prompts; the result
    it carries holds every other prompt's full, correct output."""
    eng = engines("cpu")
    prompts = corpus_prompts(3, [9, 14, 21, 5])
    faults = Faults(eng, {"target_verify@1"}, InjectedFault)
    try:
        with faults, pytest.raises(RequestFailed, match="injected fault") as info:
            eng.generate(prompts, 12, stop_ids=[])
    finally:
        faults.close()
    err = info.value
    assert set(err.errors) == {2, 3}  # chunk 1 of the first round: prompts 2 and 3
    for i, p in enumerate(prompts):
        want = reference(trained.target, p, 12)
        got = err.result.outputs[i]
        assert got == (want[:len(got)] if i in err.errors else want), i
    assert err.result.stats["failed_requests"] == 2 and err.result.stats["faults"] == 1
    assert eng.models.target_pool.free_rows == MAX_REQUESTS


def test_generate_refuses_a_busy_engine(engines):
    """generate() on an engine with requests in flight would swallow their tokens."""
    eng = engines("eager")
    rid = eng.add_request([5, 6, 7], 3, stop_ids=[])
    with pytest.raises(Exception, match="idle engine"):
        eng.generate([[8, 9]], 2)
    assert eng.abort(rid) and not eng.has_work
