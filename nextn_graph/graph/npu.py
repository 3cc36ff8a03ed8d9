"""Ascend backends: ``torch.npu.NPUGraph`` and torchair's ``torch.compile`` backend.

Imported only when one is chosen: ``torch_npu`` breaks ``import torch`` on a
machine without the CANN toolkit. Both take their module as an argument, so the
CPU test suite drives them against ``fake_npu.make_fake_npu()``, a namespace
backed by the strict emulator. Neither has run on Ascend hardware yet.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import ConfigError
from .emulator import CaptureError
from .updates import UpdateRegistry

# torchair captures at most this many graphs through npugraph_ex / reduce-overhead;
# past it, it silently falls back to eager. We refuse instead.
TORCHAIR_CAPTURE_LIMIT = 64


def _import_torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError as exc:
        raise ConfigError("graph backend 'npu'/'torchair' needs torch_npu (with the CANN "
                          f"toolkit) installed: {exc}") from None
    return torch.npu


class _NpuGraph:
    def __init__(self, graph, update_ops: list[str]):
        self.graph, self.update_ops = graph, update_ops
        self.nbytes, self.ops = 0, -1  # NPUGraph reports neither

    def replay(self, update: list[dict] | None = None) -> None:
        if self.update_ops:
            if update is None or len(update) != len(self.update_ops):
                raise CaptureError(
                    f"NPU graph replay needs {len(self.update_ops)} update dict(s) for "
                    f"{self.update_ops}, got {0 if update is None else len(update)}")
            self.graph.update(cpu_update_input=update)
        self.graph.replay()


class NpuBackend:
    """NPUGraph with ``auto_dispatch_capture=True``; updates derived from the records."""

    name, captures = "npu", True

    def __init__(self, updates: UpdateRegistry | None = None, namespace: Any = None):
        self.npu = namespace if namespace is not None else _import_torch_npu()
        self.updates = updates or UpdateRegistry()

    def new_pool(self):
        return self.npu.graph_pool_handle()

    def capture(self, fn: Callable[[], Any], pool) -> _NpuGraph:
        graph = self.npu.NPUGraph()
        with self.npu.graph(graph, pool=pool, auto_dispatch_capture=True):
            fn()
        records = graph.graph_dispatch_mode.graph_dispatch_records
        names = [rec.op_cache_entry.__name__ for rec in records]
        self.updates.check(names)  # fail at capture, not at the first replay
        return _NpuGraph(graph, names)

    def is_capturing(self) -> bool:
        return bool(self.npu.is_current_stream_capturing())

    def synchronize(self) -> None:
        self.npu.synchronize()


class _CompiledGraph:
    def __init__(self, compiled: Callable[[], Any]):
        self.compiled, self.nbytes, self.ops, self.update_ops = compiled, 0, -1, []

    def replay(self, update: list[dict] | None = None) -> None:
        self.compiled()


class TorchairBackend:
    """``torch.compile`` with torchair's NPU backend in reduce-overhead mode, one
    static-shape compile per (kind, bucket); the capture limit is enforced."""

    name, captures = "torchair", True

    def __init__(self, compile_fn: Callable | None = None,
                 capture_limit: int = TORCHAIR_CAPTURE_LIMIT, namespace: Any = None):
        if compile_fn is None:
            _import_torch_npu()  # fail at start-up, not at the first capture
        self.compile_fn = compile_fn or self._torchair_compile
        self.capture_limit = capture_limit
        self.npu = namespace
        self.captured = 0

    @staticmethod
    def _torchair_compile(fn: Callable) -> Callable:
        _import_torch_npu()
        import torchair  # ships inside torch_npu

        config = torchair.CompilerConfig()
        config.mode = "reduce-overhead"  # npugraph capture of the compiled graph
        backend = torchair.get_npu_backend(compiler_config=config)
        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)

    def new_pool(self) -> None:
        return None  # torchair manages its own graph memory

    def capture(self, fn: Callable[[], Any], pool) -> _CompiledGraph:
        if self.captured >= self.capture_limit:
            raise CaptureError(
                f"torchair capture limit reached: {self.captured} graphs captured, limit "
                f"{self.capture_limit}; beyond it torchair would run eagerly. Capture fewer "
                f"buckets or graph kinds")
        compiled = self.compile_fn(fn)
        compiled()  # the first call compiles and captures
        self.captured += 1
        return _CompiledGraph(compiled)

    def is_capturing(self) -> bool:
        return bool(self.npu is not None and self.npu.is_current_stream_capturing())

    def synchronize(self) -> None:
        if self.npu is not None:
            self.npu.synchronize()
