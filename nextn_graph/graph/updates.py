"""Host-argument updates of captured kernels (NPU graph ``update(cpu_update_input)``).

Some kernels take host-side sequence lengths (fused infer attention's
``actual_seq_lengths``, paged attention's ``context_lens``); a graph bakes them
at capture, so every replay must hand in the current values: one dict per
recorded updatable op, in capture order. Which ops were recorded is read back
from the captured graph, and each op's dict is computed by its registered rule
from the replay's host-side facts: derived, never hard-coded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .emulator import CaptureError


@dataclass(frozen=True)
class UpdateContext:
    """What the host knows about one replay of a bucket."""

    bucket: int  # B, the graph's request count
    width: int  # rows per request in the graph (N for verify / extend, 1 per rollout step)
    rows: tuple[int, ...]  # pool rows, padded with 0 to the bucket
    lengths: tuple[int, ...]  # committed length per row, 0 for padding


@dataclass(frozen=True)
class Updatable:
    # How an update dict maps onto the recorded call: ("kwarg", name, key) or
    # ("arg", index, key), the form torch_npu's graph op handlers declare.
    spec: tuple[tuple[str, Any, str], ...]
    rule: Callable[[UpdateContext], dict]  # the dict for this replay


@dataclass
class UpdateRegistry:
    ops: dict[str, Updatable] = field(default_factory=dict)

    def register(self, op_name: str, spec, rule: Callable[[UpdateContext], dict]) -> None:
        self.ops[op_name] = Updatable(tuple(spec), rule)

    def find(self, func) -> Updatable | None:
        """The entry for an aten/custom op overload (by overload or packet name)."""
        return self.ops.get(func.__name__) or self.ops.get(func.overloadpacket.__name__)

    def _entry(self, name: str) -> Updatable:
        entry = self.ops.get(name) or self.ops.get(name.split(".")[0])
        if entry is None:
            raise CaptureError(f"graph recorded updatable op {name!r} but no update rule "
                               f"is registered for it")
        return entry

    def check(self, op_names: list[str]) -> None:
        for name in op_names:
            self._entry(name)

    def derive(self, op_names: list[str], ctx: UpdateContext) -> list[dict]:
        """One update dict per recorded op, from the rules of what was captured."""
        return [self._entry(name).rule(ctx) for name in op_names]
