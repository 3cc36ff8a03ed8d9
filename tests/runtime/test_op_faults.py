"""A device fault at any op of a step: every request is committed or failed explicitly,
and after every step the rows, pages, snapshots and prefix locks are exactly those of the
live requests and the prefix cache (``Scheduler.audit``).

``test_faults.py`` faults the boundaries of a step (a phase, a readback). Here the fault
is an aten op that raises, counted by a dispatch mode from where it is armed: the first
op of a step (the page-table write of an admission), ops inside the prefix cache's
restore and snapshot writes, and ops far into a run, on every round mode. The pool is
paged tightly (pages grow, requests are preempted) and prompts share prefixes, so
every one of those paths is reached.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.runtime.engine import SpecEngine

from helpers import corpus_prompts
from test_spec_runtime import reference

PAGE, ROWS, PAGES, MAX_NEW = 128, 3, 9, 12
MODES = {"eager": None,
         "split": GraphConfig(backend="cpu", buckets=(1, 2), round="split"),
         "fused": GraphConfig(backend="cpu", buckets=(1, 3), round="fused", overlap="off"),
         "overlap": GraphConfig(backend="cpu", buckets=(1, 3), round="fused", overlap="on")}


class InjectedFault(RuntimeError):
    pass


class OpFault(TorchDispatchMode):
    """Raises at the ``at``-th aten op (counted from arming, across steps) that is in
    ``region``: any op; ``restore``: under ``KVPool.restore``; ``snapshot``: a write
    into a snapshot tensor (a ring's or the kept boundary hiddens) or the computing of
    its slots."""

    def __init__(self, eng: SpecEngine, region: str, at: int):
        super().__init__()
        self.region, self.at, self.seen, self.fired = region, at, 0, None
        pools = (eng.models.target_pool, eng.models.draft_pool)
        snaps = [r.snapshots for p in pools for r in p.rings() if r.snapshots is not None]
        snaps.append(eng.prefill.boundary_hidden)
        self.snap_storages = {t.untyped_storage().data_ptr() for t in snaps}

    def _in_region(self, args) -> bool:
        if self.region == "any":
            return True
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if self.region == "restore" and code.co_name == "restore" and \
                    code.co_filename.endswith("pool.py"):
                return True
            if self.region == "snapshot" and code.co_name == "_snapshot_slots":
                return True
            frame = frame.f_back
        return self.region == "snapshot" and bool(args) and hasattr(args[0], "untyped_storage") \
            and args[0].untyped_storage().data_ptr() in self.snap_storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.fired is None and self._in_region(args):
            self.seen += 1
            if self.seen == self.at:
                self.fired = str(func)
                raise InjectedFault(f"injected fault at {self.region} op {self.at} ({func})")
        return func(*args, **(kwargs or {}))


def _prompts() -> list[list[int]]:
    a, b = corpus_prompts(11, [300, 300])
    return [a[:200], b[:140] + a[:20], a[:150] + b[:30], a[:131], b[:135],
            a[:128] + b[:60], b[:20]]


WAVES = [[0, 1], [2, 3, 4], [5, 6]]  # later waves find what earlier ones cached


@pytest.fixture(scope="module")
def engines(trained):
    cache = {}

    def get(mode: str) -> SpecEngine:
        if mode not in cache:
            cache[mode] = SpecEngine(
                trained.target, trained.draft, SpeculativeConfig(num_steps=3),
                PoolConfig(ROWS, 384, page_size=PAGE, num_pages=PAGES), MODES[mode])
        eng = cache[mode]
        assert not eng.has_work
        return eng

    return get


def _drive(eng: SpecEngine, fault: OpFault) -> tuple[dict, dict]:
    """Every wave to its end with ``fault`` armed for every step -> (tokens, errors) by
    prompt index. Audited after every step; a step never raises."""
    prompts = _prompts()
    tokens, errors = defaultdict(list), {}
    for wave in WAVES:
        rids = {eng.add_request(prompts[i], MAX_NEW, stop_ids=[]): i for i in wave}
        steps = 0
        while eng.has_work:
            steps += 1
            assert steps < 200, "engine did not finish"
            with fault:
                outs = eng.step()
            for out in outs:
                i = rids[out.rid]
                tokens[i].extend(out.new_tokens)
                if out.error is not None:
                    assert out.finished and not out.new_tokens
                    errors[i] = out.error
            eng.scheduler.audit()
    return tokens, errors


CASES = [("any", 1), ("any", 2), ("any", 700), ("any", 4000), ("any", 15000),
         ("restore", 1), ("restore", 4), ("snapshot", 1), ("snapshot", 3)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("region,at", CASES)
def test_a_fault_at_any_op_commits_or_fails_each_request_and_frees_everything(
        engines, trained, mode, region, at):
    eng = engines(mode)
    fault = OpFault(eng, region, at)
    tokens, errors = _drive(eng, fault)
    assert fault.fired, f"{region} op {at} was never reached"
    assert errors and all("InjectedFault: injected fault" in e for e in errors.values())
    for i, prompt in enumerate(_prompts()):
        want = reference(trained.target, prompt, MAX_NEW)
        assert tokens[i] == (want[:len(tokens[i])] if i in errors else want), i
    pool, cache = eng.models.target_pool, eng.prefix.cache
    assert not pool.held and pool.free_rows == ROWS and cache.locked == 0
    assert pool.free_pages + cache.cached_pages == PAGES


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_a_fault_at_every_997th_op_of_a_run(engines, trained, mode):
    """The sweep (.ci/run runs it, about a minute a mode): a fault at op 1, 998, 1995, ...
    of the whole run, until one lands past its end; each run as above."""
    at = 1
    while True:
        fault = OpFault(engines(mode), "any", at)
        tokens, errors = _drive(engines(mode), fault)
        if not fault.fired:
            break
        # (with overlap a fault can land in the extra round of requests already finished:
        # it fails none, and every request has its whole output)
        assert all("InjectedFault" in e for e in errors.values())
        assert not engines(mode).models.target_pool.held
        for i, prompt in enumerate(_prompts()):
            want = reference(trained.target, prompt, MAX_NEW)
            assert tokens[i] == (want[:len(tokens[i])] if i in errors else want), (at, i)
        at += 997
    assert at > 997 * 10  # the run is long enough for the sweep to mean something
