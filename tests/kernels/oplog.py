"""``OpLog``: the ops the dispatcher runs inside it, in order (a kernel test's check that a
fused op is one op: no casts, no copies around it)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpLog(TorchDispatchMode):
    """The ops the dispatcher runs, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))
