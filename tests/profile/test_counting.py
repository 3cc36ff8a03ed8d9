"""Counting submissions: eager ops per phase (graph/counting.py, bench count_round) and
every device submission of a graph round (runtime/chunks.py: host transfers, counters).

The profiler path is tested with ``ProfilerActivity.CPU``, where it counts aten ops by
the dispatch-mode rule, so both counters must agree op for op. The bench once opened a
profiler per phase inside the round's profiler: leaving the inner one ends the only
session, and the round counted 0 of 7 ``mm`` calls. ``count_round`` is the bench's code.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity

from nextn_graph.bench.measure import count_round
from nextn_graph.graph.kinds import GraphKey, Phase
from nextn_graph.graph.backends import CpuBackend
from nextn_graph.profile.counting import OUTSIDE_PHASES, OpCounter, ProfilerCounter
from nextn_graph.graph.runner import GraphRunner
from nextn_graph.runtime.chunks import ChunkRunner, ReplayCounters
from nextn_graph.runtime.transfers import HostTransfers
from nextn_graph.runtime.buffers import RequestState, RoundBuffers

from helpers import seqlen_op, seqlen_registry

KINDS = ("rollout", "target_verify", "draft_extend")


def counters():
    return [OpCounter(), ProfilerCounter(ProfilerActivity.CPU)]


def _mm_round(runner, replayed: str | None = None):
    """A round of 7 ``mm``: 1 before the phases, 2 per phase; the replayed phase's ops
    are not marked (a replay is the runner's to count) and land outside the phases."""
    a = torch.ones(4, 4)

    def step():
        a @ a
        for kind in KINDS:
            with runner.observer.phase(kind, kind == replayed):
                a @ a
                a.t() @ a  # a view, then a kernel
    return step


@pytest.mark.parametrize("counter", counters(), ids=["dispatch", "profiler"])
def test_one_counter_per_round_split_by_phase(counter):
    """The round's total is the sum of its phases and what ran outside them, all 7 mm."""
    runner = SimpleNamespace(observer=None)
    got = count_round(runner, _mm_round(runner), counter)
    assert got["phases"] == {kind: 2 for kind in KINDS}
    assert got["outside_phases"] == 1
    assert got["launches"] == 7 == sum(got["phases"].values()) + got["outside_phases"]
    assert runner.observer is None  # the hook is removed after the round


@pytest.mark.parametrize("counter", counters(), ids=["dispatch", "profiler"])
def test_replayed_phase_is_not_marked(counter):
    runner = SimpleNamespace(observer=None)
    got = count_round(runner, _mm_round(runner, replayed="target_verify"), counter)
    assert got["phases"] == {"rollout": 2, "draft_extend": 2}
    assert got["outside_phases"] == 3 and got["launches"] == 7


def test_profiler_refuses_to_nest():
    """A profiler inside a running one raises, and the outer count survives the refusal."""
    outer = ProfilerCounter(ProfilerActivity.CPU)
    a = torch.ones(3, 3)
    with outer:
        with outer.phase("rollout"):
            a @ a
        with pytest.raises(RuntimeError, match="already running"):
            with ProfilerCounter(ProfilerActivity.CPU):
                pass
        a @ a
    assert outer.per_phase == {"rollout": 1, OUTSIDE_PHASES: 1}
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="already running"):
            ProfilerCounter(ProfilerActivity.CPU).__enter__()


def test_profiler_counts_aten_ops_like_dispatch_mode():
    """Composites count as what they decompose into, views and a kernel's internal calls
    not at all: the profiler's CPU count equals the dispatch-mode count, op for op."""
    x, w = torch.randn(5, 8), torch.randn(6, 8)

    def work():
        y = F.linear(x, w)  # composite: t (view) + mm
        y = F.layer_norm(y, (6,))  # composite -> native_layer_norm
        y = y.view(30).to(torch.float64).reshape(5, 6)  # views and one _to_copy
        z = torch.cat((y, y.softmax(-1))).sum(0)
        return F.silu(z).argmax() + y[y.shape[0] - 1].mean()

    got = []
    for counter in counters():
        with counter:
            with counter.phase("target_verify"):
                work()
        got.append((counter.launches, dict(counter.per_phase)))
    assert got[0] == got[1] and got[0][0] > 5


# -- the graph round's submissions ----------------------------------------------------

def test_host_transfers_upload_and_readback():
    """Upload: slots padded with slot 0, one copy_ and no new tensor; readback: one copy of
    the readout rows, values in row order. On CPU the host buffers are plain, not pinned."""
    bufs = RoundBuffers.allocate(4, 2, 8, "cpu", torch.float32)
    host = HostTransfers(bufs)
    assert not host.slots.is_pinned() and not any(o.is_pinned() for o in host.out)
    bufs.slots.fill_(-1)
    with OpCounter() as ops:
        host.upload([7, 5], 3, bufs.slots)
    assert bufs.slots.tolist() == [7, 5, 0, -1]
    assert ops.launches == 1 and set(ops.ops) == {"aten.copy_", "aten.slice"}
    bufs.accept_lens[:2] = torch.tensor([2, 3])
    bufs.preds[:2] = torch.arange(6).view(2, 3)
    bufs.draft_tokens[:2] = torch.tensor([[8, 9], [10, 11]])
    with OpCounter() as ops:
        values = host.readback(bufs.readout[:2])  # [2, 1 + N + S]
    assert values == [2, 0, 1, 2, 8, 9, 3, 3, 4, 5, 10, 11]
    assert ops.launches == ops.ops["aten.copy_"] == 1
    plain_bufs = RoundBuffers.allocate(4, 0, 8, "cpu", torch.float32)  # no drafts: [B, 2]
    plain_bufs.preds[:2] = torch.tensor([[6], [7]])
    assert HostTransfers(plain_bufs).readback(plain_bufs.readout[:2]) == [1, 6, 1, 7]


@dataclass
class _SeqlenPhases:
    """One phase whose graph records two updatable ops (host lengths, as fused attention
    takes them): preds = slot * sum(lengths)^2."""

    bufs: RoundBuffers
    state: RequestState
    num_steps: int = 1
    units = (Phase.TARGET_VERIFY,)
    sampling = None  # no sampling variant
    fused = False
    verify_width = 2

    def run(self, key: GraphKey) -> None:
        b = key.bucket
        op = seqlen_op()
        x = self.bufs.slots[:b].unsqueeze(1).float()  # [B, 1]
        y = op(op(x, [1] * b), [1] * b)  # lengths baked at capture; updates replace them
        self.bufs.preds[:b].copy_(y.long().expand(b, self.num_steps + 1))

    def static_tensors(self) -> dict[str, torch.Tensor]:
        return {f"bufs.{k}": v for k, v in vars(self.bufs).items()}


def test_graph_round_counts_every_submission():
    """A replayed round: 1 replay, 1 staging copy, 1 readback copy, and one update per
    recorded updatable op (2), not one per update() call; the round's values are right."""
    reg = seqlen_registry()
    phases = _SeqlenPhases(RoundBuffers.allocate(2, 1, 4, "cpu", torch.float32),
                           RequestState.allocate(3, 4, "cpu", torch.float32))
    runner = ChunkRunner(phases, GraphRunner(CpuBackend(reg)), buckets=(2,),
                         captured_phases=("target_verify",), updates=reg)
    runner.capture()
    assert len(runner.graphs.graphs[GraphKey(Phase.TARGET_VERIFY, 2)].update_ops) == 2
    before = runner.counters.as_dict()
    res = runner.run([4], [3], bucket=2)
    delta = {k: v - before[k] for k, v in runner.counters.as_dict().items()}
    assert res.preds == [[4 * 3 * 3] * 2]
    assert delta == {"chunks": 1, "graph_replays": 1, "staging_copies": 1,
                     "readback_copies": 1, "graph_updates": 2, "eager_fallbacks": 0,
                     "bucket_splits": 0, "padded_rows": 1, "real_rows": 1,
                     "graph_collectives": 0, "overlapped_rounds": 0, "sampled_chunks": 0}
    assert ReplayCounters(**delta).submissions() == 1 + 1 + 1 + 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="pinned buffers need a GPU: torch.cuda.is_available() is False")
def test_cuda_host_transfers_are_pinned():
    """On a GPU the host buffers are pinned and a round's values survive the async copies."""
    bufs = RoundBuffers.allocate(4, 2, 8, "cuda", torch.float32)
    host = HostTransfers(bufs)
    assert host.slots.is_pinned() and all(o.is_pinned() for o in host.out)
    host.upload([7, 5], 4, bufs.slots)
    bufs.preds[:2].copy_(bufs.slots[:2].unsqueeze(1).expand(2, 3))
    values = host.readback(bufs.readout[:2])
    assert values == [1, 7, 7, 7, 0, 0, 1, 5, 5, 5, 0, 0]
