"""A stand-in for the ``torch.npu`` graph API, backed by the strict CPU emulator.

It mirrors what the NPU backend uses of torch_npu: ``NPUGraph`` (``replay``,
``update(cpu_update_input=...)``, ``graph_dispatch_mode.graph_dispatch_records``),
the ``graph(g, pool=..., stream=..., auto_dispatch_capture=...)`` context manager,
``graph_pool_handle``, ``is_current_stream_capturing`` and ``synchronize``. The
CPU suite drives the npu adapter through it; on an Ascend machine the real
``torch.npu`` takes its place.

It is no kinder than torch_npu: it records exactly the ops of torch_npu's graph
op handler table (``updates.TORCH_NPU_HANDLERS``, keyed by overload name, any
namespace) and applies an update dict as torch_npu's ``update_capture_record``
does: a key naming a recorded kwarg replaces it, a key of the op's handler
replaces its positional slot, every other key is ignored. A replay without an
update replays the capture-time values, as on the device. ``update_api=False``
builds the API of torch_npu before ``auto_dispatch_capture`` existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from nextn_graph.graph.emulator import CpuGraph
from nextn_graph.graph.updates import TORCH_NPU_HANDLERS


@dataclass
class _Record:
    """torch_npu's ``_GraphDispatchRecord``: the call an update rewrites and re-issues."""

    op_cache_entry: Any  # the recorded op overload
    args: list  # shared with the emulator's step: an update lands in the next replay
    kwargs: dict


class _HandlerTable:
    """What the emulator records with its arguments: the ops torch_npu's table names
    (never the project's registry). torch_npu applies the updates, not the emulator."""

    spec = ()

    def find(self, func):
        return self if func.__name__ in TORCH_NPU_HANDLERS else None


class _GraphBase:
    def __init__(self):
        self.inner = CpuGraph(updatable=_HandlerTable())
        self.replays = 0

    def replay(self) -> None:
        self.inner.replay()
        self.replays += 1


class FakeNPUGraph(_GraphBase):
    """``torch.npu.NPUGraph`` with ``update`` (torch_npu with auto_dispatch_capture)."""

    def __init__(self):
        super().__init__()
        self.auto_dispatch_capture = False
        self.graph_dispatch_mode = SimpleNamespace(graph_dispatch_records=[])
        self.update_calls = 0

    def record_dispatches(self) -> None:
        """After capture: the calls torch_npu's dispatch mode would have recorded."""
        self.graph_dispatch_mode.graph_dispatch_records = [
            _Record(rec.func, rec.args, rec.kwargs) for rec in self.inner.updates
            if TORCH_NPU_HANDLERS[rec.func.__name__].records(rec.args, rec.kwargs)]

    def update(self, cpu_update_input: list[dict]) -> None:
        if not self.auto_dispatch_capture:
            raise RuntimeError("The current graph configuration does not support update,Try "
                               "to capture by setting auto_dispatch_capture=True during capture")
        records = self.graph_dispatch_mode.graph_dispatch_records
        if len(cpu_update_input) == 1:
            cpu_update_input = [dict(cpu_update_input[0]) for _ in records]
        if len(cpu_update_input) != len(records):
            raise RuntimeError(f"Currently, there are {len(records)} operators that need to be "
                               f"updated by capture, and there are only {len(cpu_update_input)} "
                               f"elements in the incoming cpu_update_input list")
        for rec, new in zip(records, cpu_update_input):
            for key in new:  # framework step: kwargs by name
                if key in rec.kwargs:
                    rec.kwargs[key] = new[key]
            for index, key in TORCH_NPU_HANDLERS[rec.op_cache_entry.__name__].args:
                if key in new and len(rec.args) > index:  # handler step: its slots only
                    rec.args[index] = new[key]
        self.update_calls += 1


class OldFakeNPUGraph(_GraphBase):
    """``torch.npu.NPUGraph`` of a torch_npu without the update API."""


def make_fake_npu(update_api: bool = True) -> SimpleNamespace:
    """A torch.npu-like namespace whose graphs are emulator graphs."""
    state = SimpleNamespace(capturing=False)

    class _Capture:
        def __init__(self, npu_graph, pool=None, stream=None):
            self.g = npu_graph

        def __enter__(self) -> None:  # torch.npu.graph binds nothing to ``as``
            state.capturing = True
            self.g.inner.capture_begin()

        def __exit__(self, exc_type, exc, tb) -> bool:
            state.capturing = False
            self.g.inner.capture_end(failed=exc_type is not None)
            return False

    class graph(_Capture):  # noqa: N801 - mirrors torch.npu.graph (graphs.py @ 0dc3742d)
        def __init__(self, npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
                     capture_error_mode: str = "global"):
            super().__init__(npu_graph, pool, stream)
            npu_graph.auto_dispatch_capture = auto_dispatch_capture

        def __exit__(self, exc_type, exc, tb) -> bool:
            super().__exit__(exc_type, exc, tb)
            if exc_type is None and self.g.auto_dispatch_capture:
                self.g.record_dispatches()
            return False

    class old_graph(_Capture):  # noqa: N801 - torch.npu.graph without auto_dispatch_capture
        def __init__(self, npu_graph, pool=None, stream=None,
                     capture_error_mode: str = "global"):
            super().__init__(npu_graph, pool, stream)

    return SimpleNamespace(
        NPUGraph=FakeNPUGraph if update_api else OldFakeNPUGraph,
        graph=graph if update_api else old_graph,
        graph_pool_handle=lambda: object(), synchronize=lambda: None,
        is_current_stream_capturing=lambda: state.capturing)
