"""Counting eager submissions.

``OpCounter`` counts aten ops that launch a kernel: every op reaching the
dispatcher (after composite decomposition) but pure views (``view``,
``expand``, ``slice``, ...), which re-describe memory and launch nothing. On CPU
that is exactly what a graph replaces. ``launch_counter`` picks, per device, the
profiler's count of kernel launches on CUDA, and the op count elsewhere.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# CUDA runtime / driver calls that put one kernel on a stream.
_CUDA_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


class OpCounter(TorchDispatchMode):
    method = "kernel-launching aten ops"

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        self.views += func.is_view
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        """Kernel-launching ops: all counted ops but pure views."""
        return sum(self.ops.values()) - self.views

    def summary(self) -> dict:
        total = sum(self.ops.values())
        return {"total": total, "non_view": total - self.views,
                "top": dict(self.ops.most_common(5))}


class CudaLaunchCounter:
    """Kernel launches on CUDA, from the profiler's runtime events (not yet run on a GPU)."""

    method = "profiler kernel launches (CUDA)"

    def __enter__(self):
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self._prof.__exit__(*exc)
        self.launches = sum(1 for e in self._prof.events() if e.name in _CUDA_LAUNCHES)
        return False


def launch_counter(device: str) -> contextlib.AbstractContextManager:
    """The eager submission counter for a device: profiler launches on CUDA, kernel-
    launching aten ops on CPU and NPU (whose profiler this library does not read)."""
    return CudaLaunchCounter() if device.startswith("cuda") else OpCounter()
