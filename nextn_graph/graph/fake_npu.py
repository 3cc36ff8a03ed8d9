"""A stand-in for the ``torch.npu`` graph API, backed by the strict CPU emulator.

It mirrors what the NPU backend uses of torch_npu: ``NPUGraph`` (``replay``,
``update(cpu_update_input=...)``, ``graph_dispatch_mode.graph_dispatch_records``),
the ``graph(g, pool=..., auto_dispatch_capture=...)`` context manager,
``graph_pool_handle``, ``is_current_stream_capturing`` and ``synchronize``. The
CPU suite drives the npu and torchair adapters through it; on an Ascend machine
the real ``torch.npu`` takes its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from .emulator import CpuGraph
from .updates import UpdateRegistry


@dataclass
class _Record:
    op_cache_entry: Any  # the recorded op, as torch_npu names its records


class FakeNPUGraph:
    def __init__(self, updates: UpdateRegistry):
        self.inner = CpuGraph(require_update=True, updatable=updates)
        self.auto_dispatch_capture = False
        self.graph_dispatch_mode = SimpleNamespace(graph_dispatch_records=[])
        self.replays = 0
        self.update_calls = 0

    def replay(self) -> None:
        self.inner.replay()
        self.replays += 1

    def update(self, cpu_update_input: list[dict]) -> None:
        if not self.auto_dispatch_capture:
            raise RuntimeError("The current graph configuration does not support update, "
                               "capture with auto_dispatch_capture=True")
        self.inner.update(cpu_update_input)
        self.update_calls += 1


def make_fake_npu(updates: UpdateRegistry | None = None) -> SimpleNamespace:
    """A torch.npu-like namespace whose graphs are emulator graphs."""
    updates = updates or UpdateRegistry()
    state = SimpleNamespace(capturing=False)

    class graph:  # noqa: N801 - mirrors torch.npu.graph
        def __init__(self, npu_graph: FakeNPUGraph, pool=None, stream=None,
                     capture_error_mode: str = "global", auto_dispatch_capture: bool = False):
            self.g = npu_graph
            npu_graph.auto_dispatch_capture = auto_dispatch_capture

        def __enter__(self):
            state.capturing = True
            self.g.inner.capture_begin()
            return self.g

        def __exit__(self, exc_type, exc, tb):
            state.capturing = False
            self.g.inner.capture_end(failed=exc_type is not None)
            if self.g.auto_dispatch_capture:
                self.g.graph_dispatch_mode.graph_dispatch_records = [
                    _Record(rec.func) for rec in self.g.inner.updates]
            return False

    return SimpleNamespace(
        NPUGraph=lambda: FakeNPUGraph(updates), graph=graph,
        graph_pool_handle=lambda: object(), synchronize=lambda: None,
        is_current_stream_capturing=lambda: state.capturing)
