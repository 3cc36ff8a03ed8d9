"""Counting eager submissions: one counter per round, split by phase.

A round is counted by one counter; each phase that runs eagerly is marked with
``counter.phase(kind)``, and every submission is attributed to the phase around
it, or to ``OUTSIDE_PHASES`` (the staging copy, the readback). Two counters:

- ``OpCounter``, a ``TorchDispatchMode``: aten ops that launch a kernel, i.e.
  every op reaching the dispatcher (after composite decomposition) but pure
  views (``view``, ``expand``, ``slice``, ...), which re-describe memory and
  launch nothing. On CPU that is exactly what a graph replaces.
- ``ProfilerCounter``: one ``torch.profiler`` session per round, phases as
  ``record_function`` ranges. With a device activity (CUDA) it counts the
  runtime's kernel launches and async copies; with ``ProfilerActivity.CPU``
  alone it counts aten ops by ``OpCounter``'s rule, which is how the CPU suite
  tests this path. Profiler sessions must never nest: leaving an inner one ends
  the only session, and the outer count came out 0. Entering one inside another
  raises.

``launch_counter`` picks per device: the profiler on CUDA, the op count elsewhere
(the NPU profiler is not read by this library).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Callable, ContextManager, Iterator, Protocol

import torch
from torch.profiler import ProfilerActivity
from torch.utils._python_dispatch import TorchDispatchMode

OUTSIDE_PHASES = "outside_phases"  # submissions of a round outside every marked phase
PHASE_RANGE = "nextn_graph.phase::"  # record_function name prefix of a phase range
# CUDA runtime / driver calls that put one kernel or copy on a stream.
_CUDA_SUBMISSIONS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                     "cuLaunchKernelEx", "cudaMemcpyAsync", "cudaMemsetAsync",
                     "cudaGraphLaunch")


class RoundCounter(Protocol):
    method: str  # what is counted, for the report
    per_phase: Counter[str]  # submissions by phase kind, OUTSIDE_PHASES for the rest

    def phase(self, kind: str) -> ContextManager: ...
    def __enter__(self) -> "RoundCounter": ...
    def __exit__(self, *exc) -> bool: ...

    @property
    def launches(self) -> int: ...


def launches_kernel(func) -> bool:
    """The counting rule of ``OpCounter`` (and of ``nextn_graph.profile``): an aten op
    reaching the dispatcher launches a kernel unless it is a pure view."""
    return not func.is_view


class PhasedMode(TorchDispatchMode):
    """A dispatch mode that knows the phase marked around each op (``phase(kind)``),
    ``OUTSIDE_PHASES`` where none is."""

    def __init__(self):
        super().__init__()
        self._phase = OUTSIDE_PHASES

    @contextlib.contextmanager
    def phase(self, kind: str) -> Iterator[None]:
        outer, self._phase = self._phase, kind
        try:
            yield
        finally:
            self._phase = outer


class OpCounter(PhasedMode):
    method = "kernel-launching aten ops"

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0
        self.per_phase: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        kernel = launches_kernel(func)
        self.views += not kernel
        if kernel:
            self.per_phase[self._phase] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        """Kernel-launching ops: all counted ops but pure views."""
        return sum(self.ops.values()) - self.views

    def summary(self) -> dict:
        total = sum(self.ops.values())
        return {"total": total, "non_view": total - self.views,
                "top": dict(self.ops.most_common(5))}


@functools.cache
def _op_role(name: str) -> str | None:
    """'composite' (decomposes before dispatch), 'view', 'kernel', or None for a profiler
    event that is no operator (a range, a runtime call). Judged by the op's first overload:
    the profiler names the packet only."""
    namespace, _, op = name.partition("::")
    try:
        overload = getattr(getattr(torch.ops, namespace), op)
        overload = getattr(overload, overload.overloads()[0])
        composite = overload.has_kernel_for_dispatch_key(
            torch._C.DispatchKey.CompositeImplicitAutograd)
    except (AttributeError, RuntimeError, IndexError, TypeError):
        return None
    return "composite" if composite else ("view" if overload.is_view else "kernel")


def _is_dispatched_kernel(evt) -> bool:
    """OpCounter's rule on a profiler event: a non-view op that does not decompose, called
    from no other such op (what a kernel calls internally is not dispatched to a mode)."""
    if _op_role(evt.name) != "kernel":
        return False
    parent = evt.cpu_parent
    while parent is not None:
        if _op_role(parent.name) in ("kernel", "view"):
            return False
        parent = parent.cpu_parent
    return True


def _enclosing_phase(evt) -> str:
    parent = evt.cpu_parent
    while parent is not None:
        if parent.name.startswith(PHASE_RANGE):
            return parent.name[len(PHASE_RANGE):]
        parent = parent.cpu_parent
    return OUTSIDE_PHASES


class ProfilerCounter:
    """One profiler session for a whole round; ``activity`` is the device's
    (``ProfilerActivity.CUDA``), or ``ProfilerActivity.CPU`` to count aten ops."""

    def __init__(self, activity: ProfilerActivity = ProfilerActivity.CUDA,
                 synchronize: Callable[[], None] = lambda: None, note: str = ""):
        self.activity, self.synchronize = activity, synchronize
        cpu = activity == ProfilerActivity.CPU
        self.method = ("profiler aten ops (CPU)" if cpu else f"profiler kernel launches, "
                       f"graph launches and async copies ({activity.name})") + note
        self._is_submission = _is_dispatched_kernel if cpu else (
            lambda evt: evt.name in _CUDA_SUBMISSIONS)
        self.per_phase: Counter[str] = Counter()

    def phase(self, kind: str) -> ContextManager:
        return torch.profiler.record_function(PHASE_RANGE + kind)

    def __enter__(self) -> "ProfilerCounter":
        if torch._C._autograd._profiler_enabled():
            raise RuntimeError("a profiler is already running: one profiler per round, "
                               "split by phase with counter.phase(kind); a nested one "
                               "ends the outer session and its count reads 0")
        activities = [ProfilerActivity.CPU]  # the phase ranges and the runtime calls
        if self.activity != ProfilerActivity.CPU:
            activities.append(self.activity)
        self._prof = torch.profiler.profile(activities=activities)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        try:
            if exc[0] is None:
                self.synchronize()  # device events of the round land before the session ends
        finally:
            self._prof.__exit__(*exc)
        if exc[0] is None:
            self.per_phase = Counter(_enclosing_phase(e) for e in self._prof.events()
                                     if self._is_submission(e))
        return False

    @property
    def launches(self) -> int:
        return sum(self.per_phase.values())


def launch_counter(device: str) -> RoundCounter:
    """The eager submission counter for a device: the profiler on CUDA, kernel-launching
    aten ops on CPU and NPU (whose profiler this library does not read)."""
    if device.startswith("cuda"):
        return ProfilerCounter(ProfilerActivity.CUDA, torch.cuda.synchronize)
    return OpCounter()


def compiled_counter(device: str, compile_backend: str) -> RoundCounter:
    """The counter for a round of ``torch.compile``d graphs: always a profiler, because a
    compiled graph refuses to run under a TorchDispatchMode (``compile.refuse_dispatch_mode``).
    On CUDA it sees every launch; elsewhere it sees the aten ops the compiled code calls,
    which is every op for ``aot_eager`` but not the kernels inductor or torchair generate."""
    if device.startswith("cuda"):
        return ProfilerCounter(ProfilerActivity.CUDA, torch.cuda.synchronize)
    note = "" if compile_backend == "aot_eager" else (
        f"; a lower bound: the kernels {compile_backend} generates are not aten ops")
    return ProfilerCounter(ProfilerActivity.CPU, note=note)


def counts_every_launch(device: str, compile_backend: str) -> bool:
    """Whether ``compiled_counter`` counts every submission of a compiled round."""
    return device.startswith("cuda") or compile_backend == "aot_eager"
