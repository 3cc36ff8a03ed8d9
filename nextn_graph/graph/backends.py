"""Graph backends behind one small interface: capture a callable over static tensors,
replay it (``compile``/``torchair`` in ``compile.py``, ``npu`` in ``npu.py``)."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch

from ..config import GRAPH_BACKENDS
from ..errors import CaptureError, ConfigError
from . import compile as compile_mod
from .emulator import CpuGraph
from .updates import UpdateRegistry

BACKENDS = GRAPH_BACKENDS  # the names, spelled once in config/graph.py


class Graph(Protocol):
    nbytes: int  # memory the graph holds (its pool share)
    ops: int  # recorded kernel launches, -1 where the backend cannot tell
    update_ops: list[str]  # recorded ops that need an update() before every replay

    def replay(self, update: list[dict] | None = None) -> None: ...


class GraphBackend(Protocol):
    name: str
    captures: bool  # False for eager: phases run directly

    def new_pool(self) -> Any: ...
    def warmup_context(self) -> ContextManager: ...  # where the warm-up before a capture runs
    def capture(self, fn: Callable[[], Any], pool: Any) -> Graph: ...
    def is_capturing(self) -> bool: ...
    def synchronize(self) -> None: ...


@dataclass
class CaptureRecord:
    name: str  # the graph key's name: target_verify, round+sampling
    bucket: int
    seconds: float
    nbytes: int
    ops: int  # recorded kernel launches (emulator) or -1 where unknown


class EagerBackend:
    name, captures = "eager", False

    def new_pool(self) -> None:
        return None

    def warmup_context(self) -> ContextManager:
        return nullcontext()

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

    def warmup_context(self) -> ContextManager:
        return nullcontext()

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
    """Warm-up and capture run on one side stream: lazy per-stream state (cuBLAS
    workspaces, allocator blocks) made by the warm-up is then the capture's own."""

    name, captures = "cuda", True

    def __init__(self):
        if not torch.cuda.is_available():
            raise ConfigError("graph backend 'cuda' needs a CUDA device; none is available")
        self.stream = torch.cuda.Stream()

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    @contextmanager
    def warmup_context(self) -> Iterator[None]:
        self.stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:  # later work on the caller's stream sees what the warm-up wrote
            torch.cuda.current_stream().wait_stream(self.stream)

    def capture(self, fn, pool) -> _CudaGraph:
        # emptied first (as torch.cuda.graph does): reserved growth is this graph's pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream):
            fn()
        torch.cuda.synchronize()
        return _CudaGraph(graph, max(0, torch.cuda.memory_reserved() - before))

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def make_backend(name: str, updates: UpdateRegistry | None = None,
                 compile_backend: str = "auto", **options) -> GraphBackend:
    """``options``: ``namespace`` (npu / torchair: a torch.npu-like module, e.g. the CPU
    fake), ``torchair`` and ``lookup`` (torchair: stand-ins for CPU tests)."""
    if name == "eager":
        return EagerBackend()
    if name == "cpu":
        return CpuBackend(updates)
    if name == "cuda":
        return CudaBackend()
    if name == "compile":
        return compile_mod.dynamo_backend(compile_backend)
    if name == "torchair":
        return compile_mod.torchair_backend(compile_backend, **options)
    if name == "npu":
        from . import npu  # lazy: torch_npu breaks `import torch` without CANN

        return npu.NpuBackend(updates, **options)
    raise ConfigError(f"unknown graph backend {name!r}; choose from {BACKENDS}")


def timed_capture(backend: GraphBackend, fn: Callable[[], Any], pool: Any, name: str,
                  bucket: int) -> tuple[Graph, CaptureRecord]:
    start = time.perf_counter()
    graph = backend.capture(fn, pool)
    backend.synchronize()
    seconds = time.perf_counter() - start
    return graph, CaptureRecord(name, bucket, seconds, graph.nbytes, graph.ops)
