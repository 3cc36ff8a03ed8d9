"""Collectives inside captured graphs, on two gloo ranks (``launch.ranks.spawn``).

The emulator replays functional collectives (``TPGroup.all_reduce`` / ``all_gather``
and the raw ``_c10d_functional`` ops) on new inputs exactly as eager computes them,
refuses host-side collectives (``torch.distributed.all_reduce``, ``barrier``,
``broadcast``, ``broadcast_object_list``) on every rank at the same op, leaving the
graph empty and the group usable; the fake ``torch.npu`` and the compile backend
(``aot_eager``) hold the same collectives. Each spawn costs seconds, so one spawn per
backend runs every check and returns what the tests assert (tensors as nested lists:
a tensor result would be shared through a file descriptor of a rank that has exited).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from nextn_graph.graph.compile import dynamo_backend
from nextn_graph.graph.emulator import CaptureError, CpuGraph
from nextn_graph.graph.npu import NpuBackend
from nextn_graph.launch.ranks import spawn

from fake_npu import make_fake_npu

pytestmark = pytest.mark.process  # two spawned gloo ranks

TP = 2
TIMEOUT_S = 60.0  # a rank left waiting for a collective fails the test, not hangs it
_f = torch.ops._c10d_functional
EXPECTED_OPS = ["_c10d_functional.all_reduce", "_c10d_functional.all_gather_into_tensor",
                "_c10d_functional.all_reduce_", "_c10d_functional.reduce_scatter_tensor",
                "_c10d_functional.broadcast"]


class Shard:
    """One rank's static tensors and a forward mixing local ops with collectives."""

    def __init__(self, group, seed: int = 0, inplace: bool = True):
        gen = torch.Generator().manual_seed(seed * 10 + group.rank)
        self.group, self.inplace = group, inplace
        self.x = torch.randn(4, 6, generator=gen)  # [R, D] static input, rank-local
        self.w = torch.randn(6, 8, generator=gen)  # [D, F] this rank's weight shard
        self.buf = torch.empty(4, 6)  # [R, D] reduced in place (all_reduce_)
        self.out = torch.empty(4, TP * 8 + 6 + 8 // TP + 6)  # [R, 32] = forward()

    def forward(self) -> torch.Tensor:
        name = self.group.group.group_name
        h = torch.relu(self.group.all_reduce(self.x @ self.w)) + 1  # [R, F]
        g = self.group.all_gather(h * 0.5)  # [R, TP*F]
        if self.inplace:
            self.buf.copy_(self.x)
            _f.wait_tensor(_f.all_reduce_(self.buf, "sum", name))  # [R, D], summed in place
        else:  # AOT autograd cannot functionalize all_reduce_ (torch 2.13)
            self.buf.copy_(self.group.all_reduce(self.x))
        scattered = _f.wait_tensor(_f.reduce_scatter_tensor(h.t().contiguous(), "sum", TP,
                                                            name))  # [F/TP, R]
        from0 = _f.wait_tensor(_f.broadcast(self.x, 0, name))  # [R, D], rank 0's x
        return torch.cat([g, self.buf, scattered.t(), from0 - self.x], dim=-1)

    def forward_into(self) -> None:
        self.out.copy_(self.forward())

    def new_inputs(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed * 10 + self.group.rank)
        self.x.copy_(torch.randn(self.x.shape, generator=gen))


def _lists(tree):
    """Tensors -> nested lists (exact for fp32), through dicts and lists."""
    if isinstance(tree, torch.Tensor):
        return tree.tolist()
    if isinstance(tree, dict):
        return {k: _lists(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_lists(v) for v in tree]
    return tree


def _refused(group, call) -> dict:
    graph = CpuGraph()
    try:
        graph.capture(call)
    except CaptureError as exc:
        return {"message": str(exc), "steps": graph.num_ops, "collectives": graph.num_collectives}
    return {"message": "captured without a CaptureError"}


def _host_collectives(group) -> dict:
    x = torch.ones(3)  # [3]
    calls = {
        "all_reduce": lambda: dist.all_reduce(x * 2),
        "barrier": lambda: dist.barrier(),
        "broadcast": lambda: dist.broadcast(x + 1, src=0),
        "broadcast_object_list": lambda: dist.broadcast_object_list([group.rank], src=0),
        "all_gather_object": lambda: dist.all_gather_object([None] * TP, group.rank),
        "funcol": lambda: funcol.all_reduce(x, "sum", group.group) + 1,  # issued, then refused
    }
    return {name: _refused(group, call) for name, call in calls.items()}


def emulator_ranks(group) -> dict:
    """Capture, two replays on new inputs against eager, refusals, then the group again."""
    shard = Shard(group)
    graph = CpuGraph()
    captured = graph.capture(shard.forward).clone()
    eager_first = shard.forward()
    replays, eagers = [], []
    for seed in (1, 2):
        shard.new_inputs(seed)
        graph.replay()
        replays.append(graph.outputs.clone())
        eagers.append(shard.forward())
    refusals = _host_collectives(group)
    shard.new_inputs(3)  # the graph and the group still work after the refusals
    graph.replay()
    replays.append(graph.outputs.clone())
    eagers.append(shard.forward())
    return _lists({"captured": captured, "eager_first": eager_first, "replays": replays,
                   "eagers": eagers, "ops": graph.collective_ops, "refusals": refusals,
                   "after": group.all_reduce(torch.full((2,), float(group.rank + 1)))})


def other_backends_ranks(group) -> dict:
    """The fake torch.npu (emulator-backed NPUGraph) and the compile backend (aot_eager)."""
    got = {}
    for name, backend in (("npu", NpuBackend(namespace=make_fake_npu())),
                          ("compile", dynamo_backend("aot_eager"))):
        shard = Shard(group, seed=5, inplace=name == "npu")
        graph = backend.capture(shard.forward_into, backend.new_pool())
        captured = shard.out.clone()
        eager = shard.forward()
        shard.new_inputs(6)
        graph.replay()
        got[name] = {"captured": captured, "eager": eager, "replay": shard.out.clone(),
                     "eager_new": shard.forward()}
    try:  # AOT autograd cannot functionalize the in-place all_reduce_ (torch 2.13)
        dynamo_backend("aot_eager").capture(Shard(group).forward_into, None)
        refused = None
    except CaptureError as exc:
        refused = str(exc)
    return _lists({"replays": got, "inplace_refused": refused})


@pytest.fixture(scope="module")
def emulator_results() -> list[dict]:
    return spawn(emulator_ranks, TP, timeout_s=TIMEOUT_S)


def test_replay_equals_eager_on_new_inputs(emulator_results):
    for rank in emulator_results:
        assert rank["captured"] == rank["eager_first"]
        assert rank["replays"] == rank["eagers"]  # bitwise, on three sets of new inputs
        assert rank["replays"][0] != rank["replays"][1]  # the inputs did change
    first = [torch.tensor(r["replays"][0]) for r in emulator_results]  # [R, 32] per rank
    assert torch.equal(first[0][:, :16], first[1][:, :16])  # all_gather: same on both
    assert torch.equal(first[0][:, 16:22], first[1][:, 16:22])  # all_reduce_: the sum
    assert first[0][:, -6:].abs().sum() == 0 < first[1][:, -6:].abs().sum()  # rank 0's x


def test_collective_steps_in_capture_order(emulator_results):
    for rank in emulator_results:
        assert rank["ops"] == EXPECTED_OPS  # waits are not steps of their own


@pytest.mark.parametrize("call, op", [
    ("all_reduce", "c10d.allreduce_"), ("barrier", "c10d.barrier"),
    ("broadcast", "c10d.broadcast_")])
def test_host_collective_is_refused(emulator_results, call, op):
    for rank in emulator_results:
        got = rank["refusals"][call]
        assert got["message"].startswith(f"capture: {op} is a host-side collective "
                                         f"(torch.distributed.{call}): it cannot live in a "
                                         f"graph; use the functional collectives")
        assert "test_graph_collectives.py" in got["message"]  # the call site
        assert got["steps"] == 0 and got["collectives"] == 0


@pytest.mark.parametrize("call", ["broadcast_object_list", "all_gather_object"])
def test_object_collective_is_refused(emulator_results, call):
    """A rank that pickles an object meets a host copy first, one that only receives the
    c10d op: either way the message names the torch.distributed function, and the
    refusal comes before anything is sent."""
    for rank in emulator_results:
        got = rank["refusals"][call]
        assert f"torch.distributed.{call}" in got["message"]
        assert "is a host-side collective" in got["message"]
        assert "it cannot live in a graph" in got["message"]
        assert got["steps"] == 0


def test_async_collective_tensor_is_refused(emulator_results):
    """The Python API of functional collectives wraps results in AsyncCollectiveTensor
    (a wrapper subclass without storage): refused; the all_reduce it issued is waited."""
    for rank in emulator_results:
        got = rank["refusals"]["funcol"]
        assert got["message"].startswith("capture: _c10d_functional._wrap_tensor_autograd "
                                         "cannot be replayed: it wraps the result in an "
                                         "AsyncCollectiveTensor")
        assert got["steps"] == 0 and got["collectives"] == 0


def test_group_works_after_refusals(emulator_results):
    for rank in emulator_results:
        assert rank["after"] == [3.0, 3.0]


def test_fake_npu_and_compile_backends_replay_collectives():
    for rank in spawn(other_backends_ranks, TP, timeout_s=TIMEOUT_S):
        assert "could not compile" in rank["inplace_refused"]
        assert "_c10d_functional::all_reduce_" in rank["inplace_refused"]
        for name, got in rank["replays"].items():
            assert got["captured"] == got["eager"], name
            assert got["replay"] == got["eager_new"], name
            assert got["replay"] != got["captured"], name
