"""The work counter: one ``TorchDispatchMode`` over a round, recording every
kernel-launching op (``counting.launches_kernel``, the rule ``OpCounter`` counts
eager submissions by) with its bytes, FLOPs, phase and module kind.

Records are aggregated as they come: ``work`` maps (phase, kind, op, bytes read,
bytes written, FLOPs) to a kernel count, so a round of half a million ops holds a few
thousand keys, and any device spec can be projected from it afterwards.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..kernels.registry import launches
from .counting import PhasedMode, launches_kernel
from .flops import Flops, flop_rule
from .kinds import KindResolver
from .lengths import length_rule
from .memo import MetaMemo, can_remember
from .traffic import OpSchema, Traffic, traffic_rule


@dataclass(frozen=True)
class OpRule:
    """Everything the counter needs of one op, worked out at its first call."""

    schema: OpSchema
    kernel: bool  # launches a kernel (not a pure view)
    launches: int  # kernels one call launches (a fused op may launch several)
    traffic: Traffic
    flops: Flops | None  # None: not a matmul-class op
    memo: bool  # outputs may be rebuilt from metadata (see memo.py)

    @staticmethod
    def of(func, length: int | None) -> "OpRule":
        schema = OpSchema.of(func)
        traffic = length_rule(schema.name, length) or traffic_rule(schema)
        return OpRule(schema, launches_kernel(func), launches(func.name()), traffic,
                      flop_rule(func), can_remember(func))


class WorkCounter(PhasedMode):
    """``memo``: rebuild repeated meta outputs from metadata (meta tensors only).
    ``decompose``: ops the profiled device has no kernel for, each with the function it
    runs instead; that function's ops are counted (``kernels.registry``). ``length``: the
    requests' cached positions, for the ops whose bytes follow it (``lengths.py``)."""

    def __init__(self, kinds: KindResolver, memo: bool = False,
                 decompose: dict | None = None, length: int | None = None):
        super().__init__()
        self.kinds = kinds
        self.length = length
        self.decompose = decompose or {}
        # op -> kernels one call launches, for the fused ops that launch more than one
        self.launches: dict[str, int] = {}
        # (phase, kind, op, read, written, flops) -> calls (kernels: times ``launches``)
        self.work: dict[tuple[str, str, str, int, int, int], int] = {}
        self.memo = MetaMemo() if memo else None
        self._rules: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        decomposed = self.decompose.get(func)
        if decomposed is not None:  # what the device runs instead, counted op by op
            with self:
                return decomposed(*args, **kwargs)
        rule = self._rules.get(func)
        if rule is None:
            rule = self._rules[func] = OpRule.of(func, self.length)
        if self.memo is not None and rule.memo:
            out = self.memo.run(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if rule.kernel:
            read, written = rule.traffic(rule.schema, args, kwargs, out)
            flops = rule.flops(args, kwargs, out) if rule.flops is not None else 0
            kind = self.kinds.of_frame(sys._getframe(1))
            key = (self._phase, kind, rule.schema.name, read, written, flops)
            self.work[key] = self.work.get(key, 0) + 1
            if rule.launches > 1:
                self.launches[rule.schema.name] = rule.launches
        return out

    @property
    def kernels(self) -> int:
        return sum(self.per_phase().values())

    def per_phase(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (phase, _, op, *_), n in self.work.items():
            out[phase] = out.get(phase, 0) + n * self.launches.get(op, 1)
        return out
