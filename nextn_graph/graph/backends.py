"""Graph backends behind one small interface.

A backend captures a callable that reads and writes static tensors into a graph
object, replays it, and reports whether it is capturing. ``eager`` captures
nothing (the baseline); ``cpu`` is the strict emulator; ``cuda`` uses
``torch.cuda.CUDAGraph`` with one shared memory pool. The NPU backends live in
``npu.py`` and import ``torch_npu`` only when chosen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from ..errors import ConfigError
from .emulator import CaptureError, CpuGraph
from .updates import UpdateRegistry

BACKENDS = ("eager", "cpu", "cuda", "npu", "torchair")


class Graph(Protocol):
    nbytes: int  # memory the graph holds (its pool share)
    ops: int  # recorded kernel launches, -1 where the backend cannot tell
    update_ops: list[str]  # recorded ops that need an update() before every replay

    def replay(self, update: list[dict] | None = None) -> None: ...


class GraphBackend(Protocol):
    name: str
    captures: bool  # False for eager: phases run directly

    def new_pool(self) -> Any: ...
    def capture(self, fn: Callable[[], Any], pool: Any) -> Graph: ...
    def is_capturing(self) -> bool: ...
    def synchronize(self) -> None: ...


@dataclass
class CaptureRecord:
    """What one capture cost: for the capture report and the benchmark."""

    kind: str
    bucket: int
    seconds: float
    nbytes: int
    ops: int  # recorded kernel launches (emulator) or -1 where unknown


class EagerBackend:
    name, captures = "eager", False

    def new_pool(self) -> None:
        return None

    def capture(self, fn, pool):  # pragma: no cover - the runner never asks
        raise CaptureError("the eager backend does not capture graphs")

    def is_capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


class _EmulatedGraph:
    def __init__(self, graph: CpuGraph):
        self.graph = graph
        self.nbytes, self.ops, self.update_ops = graph.nbytes, graph.num_ops, graph.update_ops

    def replay(self, update: list[dict] | None = None) -> None:
        if update:
            self.graph.update(update)
        self.graph.replay()


class CpuBackend:
    """Record-and-replay emulator; ``strict_updates`` refuses replays without update()."""

    name, captures = "cpu", True

    def __init__(self, updates: UpdateRegistry | None = None, strict_updates: bool = True):
        self.updates, self.strict_updates = updates, strict_updates
        self._capturing = False

    def new_pool(self) -> None:
        return None  # the emulator keeps each graph's tensors alive itself

    def capture(self, fn, pool) -> _EmulatedGraph:
        graph = CpuGraph(require_update=self.strict_updates, updatable=self.updates)
        self._capturing = True
        try:
            graph.capture(fn)
        finally:
            self._capturing = False
        return _EmulatedGraph(graph)

    def is_capturing(self) -> bool:
        return self._capturing

    def synchronize(self) -> None:
        pass


class _CudaGraph:
    def __init__(self, graph, nbytes: int):
        self.graph, self.nbytes, self.ops, self.update_ops = graph, nbytes, -1, []

    def replay(self, update: list[dict] | None = None) -> None:
        self.graph.replay()


class CudaBackend:
    """``torch.cuda.CUDAGraph`` capture into one shared pool, on a side stream."""

    name, captures = "cuda", True

    def __init__(self):
        if not torch.cuda.is_available():
            raise ConfigError("graph backend 'cuda' needs a CUDA device; none is available")

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture(self, fn, pool) -> _CudaGraph:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        torch.cuda.synchronize()
        return _CudaGraph(graph, torch.cuda.memory_allocated() - before)

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def make_backend(name: str, updates: UpdateRegistry | None = None, **options) -> GraphBackend:
    """The backend of a config; NPU backends import torch_npu only here.

    ``options``: ``namespace`` (npu: a torch.npu-like module, e.g. the CPU fake),
    ``compile_fn`` / ``capture_limit`` (torchair).
    """
    if name == "eager":
        return EagerBackend()
    if name == "cpu":
        return CpuBackend(updates)
    if name == "cuda":
        return CudaBackend()
    if name in ("npu", "torchair"):
        from . import npu  # lazy: torch_npu breaks `import torch` without CANN

        if name == "npu":
            return npu.NpuBackend(updates, **options)
        return npu.TorchairBackend(**options)
    raise ConfigError(f"unknown graph backend {name!r}; choose from {BACKENDS}")


def timed_capture(backend: GraphBackend, fn: Callable[[], Any], pool: Any, kind: str,
                  bucket: int) -> tuple[Graph, CaptureRecord]:
    start = time.perf_counter()
    graph = backend.capture(fn, pool)
    backend.synchronize()
    seconds = time.perf_counter() - start
    return graph, CaptureRecord(kind, bucket, seconds, graph.nbytes, graph.ops)
