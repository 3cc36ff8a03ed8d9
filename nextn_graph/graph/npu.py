"""Ascend backend ``npu``: ``torch.npu.NPUGraph``, imported only when chosen (torch_npu
breaks ``import torch`` without CANN). Tested against ``tests/fake_npu``, not yet on
Ascend hardware."""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import Any, Callable, ContextManager

import torch

from ..errors import ConfigError
from ..errors import CaptureError
from .updates import UpdateRegistry

def _import_torch_npu():
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError as exc:
        raise ConfigError("graph backend 'npu'/'torchair' needs torch_npu (with the CANN "
                          f"toolkit) installed: {exc}") from None
    return torch.npu


def _torch_npu_version() -> str:
    import torch_npu

    return str(torch_npu.__version__)


def _check_update_api(npu: Any, version: str) -> None:
    """``auto_dispatch_capture`` and ``NPUGraph.update`` arrived with Ascend Extension
    for PyTorch 7.1.0; ``torch_npu.__version__`` follows PyTorch ("2.5.1.post1"), not
    that release line, so the API itself is inspected."""
    try:
        params = inspect.signature(npu.graph).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume the worst
        params = {}
    if "auto_dispatch_capture" not in params or not hasattr(npu.NPUGraph, "update"):
        raise ConfigError(
            f"graph backend 'npu' needs torch_npu's graph update API (torch.npu.graph(..., "
            f"auto_dispatch_capture=True) and NPUGraph.update, from Ascend Extension for "
            f"PyTorch 7.1.0); the installed torch_npu {version} lacks it: install a "
            f"torch_npu of release 7.1.0 or later for your CANN toolkit")


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
    """``namespace``/``version``: a torch.npu-like module (the CPU fake); by default
    torch_npu is imported here."""

    name, captures = "npu", True

    def __init__(self, updates: UpdateRegistry | None = None, namespace: Any = None,
                 version: str = "unknown"):
        if namespace is None:
            namespace, version = _import_torch_npu(), _torch_npu_version()
        _check_update_api(namespace, version)  # fail at start-up, not at the first capture
        self.npu = namespace
        self.updates = updates or UpdateRegistry()

    def new_pool(self):
        return self.npu.graph_pool_handle()

    def warmup_context(self) -> ContextManager:
        # Not yet run on Ascend: whether NPUGraph wants the warm-up on its capture
        # stream (as CUDA graphs do) is to be measured there.
        return nullcontext()

    def capture(self, fn: Callable[[], Any], pool) -> _NpuGraph:
        self.updates.check_torch_npu_rules()  # before anything is captured
        graph = self.npu.NPUGraph()
        with self.npu.graph(graph, pool=pool, auto_dispatch_capture=True):
            fn()
        records = graph.graph_dispatch_mode.graph_dispatch_records
        self.updates.check_torch_npu_records(records)  # fail at capture, not at a replay
        return _NpuGraph(graph, [rec.op_cache_entry.__name__ for rec in records])

    def is_capturing(self) -> bool:
        return bool(self.npu.is_current_stream_capturing())

    def synchronize(self) -> None:
        self.npu.synchronize()
