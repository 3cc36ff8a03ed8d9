"""Counting eager submissions: aten ops that launch a kernel.

Every op reaching the dispatcher (after composite decomposition) is counted;
pure views (``view``, ``expand``, ``slice``, ...) re-describe memory and launch
nothing, so they are kept apart. On CPU this is exact for what a graph replaces;
on CUDA / NPU it approximates the launches a profiler would show.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
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
