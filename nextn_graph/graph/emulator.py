"""A strict CPU emulator of CUDA / NPU graph capture: it records every kernel-launching
aten op with the very tensors it used and replays into them; what a real graph cannot
hold is refused at capture, naming the op and the calling line."""

from __future__ import annotations

import contextlib
import functools
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import CaptureError  # noqa: F401  (raised here; tests import it from here)
from . import collectives
from .steps import copy_into, fast_out_step, out_variant, precast_scalars, share_memory, tensors

aten = torch.ops.aten


# Host-sync tensor methods, caught at the Python level (they never reach aten on CPU).
_HOST_SYNC_METHODS = {
    torch.Tensor.item: ".item()", torch.Tensor.tolist: ".tolist()",
    torch.Tensor.numpy: ".numpy()", torch.Tensor.__bool__: "bool() of a tensor",
    torch.Tensor.__int__: "int() of a tensor", torch.Tensor.__float__: "float() of a tensor",
    torch.Tensor.__index__: "a tensor used as a Python index",
    torch.Tensor.cpu: ".cpu() (a device-to-host copy)",
}
_FORBIDDEN_OPS = {
    aten._local_scalar_dense.default: "host sync (reads a tensor value on the host)",
    aten.is_nonzero.default: "host sync (bool() of a tensor)",
    aten.equal.default: "host sync (torch.equal)",
    aten.nonzero.default: "nonzero (data-dependent output shape)",
    aten.masked_select.default: "masked_select (data-dependent output shape)",
    aten._unique2.default: "unique (data-dependent output shape)",
    aten.unique_dim.default: "unique (data-dependent output shape)",
    aten.unique_consecutive.default: "unique_consecutive (data-dependent output shape)",
}
# torch.tensor(...) inside a graph: a host-to-device copy at capture. A 0-dim one
# is how PyTorch wraps a Python scalar (``y[idx] = 0.``), which graphs bake in.
_HOST_DATA_OPS = (aten.lift_fresh.default, aten.lift_fresh_copy.default)
_RNG_WORDS = ("rand", "normal", "bernoulli", "multinomial", "uniform", "exponential",
              "random", "dropout", "poisson", "cauchy", "geometric", "log_normal")

def _call_site() -> str:
    """The innermost frame outside torch and this file: where the user code called."""
    here = Path(__file__).resolve()
    torch_dir = Path(torch.__file__).resolve().parent
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path != here and torch_dir not in path.parents and "<frozen" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "unknown location"


def _forbidden(func, args, kwargs) -> str | None:
    if func in _FORBIDDEN_OPS:
        return _FORBIDDEN_OPS[func]
    if func in _HOST_DATA_OPS and args and args[0].dim() > 0:
        return "a tensor built from host data (torch.tensor([...]))"
    name = func.__name__
    if name.startswith("repeat_interleave") and kwargs.get("output_size") is None and (
            len(args) < 4 or args[3] is None):
        return "repeat_interleave without output_size (data-dependent output shape)"
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            return "boolean-mask indexing (data-dependent output shape)"
    if any(word in name for word in _RNG_WORDS) and "sort" not in name:
        return f"RNG op {name} (a replay would repeat, not redraw, its numbers)"
    return None


def _refusal(func, args, kwargs) -> str | None:
    why = _forbidden(func, args, kwargs)
    if why is None:
        return None
    what = f"aten.{func.__name__}"  # inside broadcast_object_list & co, name that instead
    return (collectives.host_collective(f"{what}: {why}")
            or f"capture: {what} is not graph-safe: {why}")


@dataclass
class _UpdateRecord:
    func: Any
    args: list
    kwargs: dict
    spec: list[tuple[str, Any, str]]


class _SyncGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _HOST_SYNC_METHODS.get(func)
        if func is torch.Tensor.to and _to_host(args[1:], kwargs):
            what = ".to('cpu') (a device-to-host copy)"
        if what:
            inside = collectives.host_collective(what)
            raise CaptureError(f"{inside or f'capture: {what} is a host sync'}, called at "
                               f"{_call_site()}")
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    targets = list(args) + [kwargs.get("device")]
    return any(str(t) == "cpu" for t in targets if isinstance(t, (str, torch.device)))


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: "CpuGraph"):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        refused = collectives.refusal(func) or _refusal(func, args, kwargs)
        if refused:
            raise CaptureError(f"{refused}; called at {_call_site()}")
        out = func(*args, **kwargs)
        self.graph._record(func, args, kwargs, out)
        return out


@dataclass
class CpuGraph:
    """One captured region: a list of re-runnable steps over fixed tensors."""

    require_update: bool = False
    updatable: Any = None  # an UpdateRegistry (or anything with .find(func)), or None
    steps: list[Callable[[], None]] = field(default_factory=list)
    updates: list[_UpdateRecord] = field(default_factory=list)
    collective_ops: list[str] = field(default_factory=list)  # in capture (= replay) order
    outputs: Any = None
    nbytes: int = 0
    _updated: bool = False
    _modes: contextlib.ExitStack | None = None
    _uses: list = field(default_factory=list)  # per step: (tensors read, fresh outputs)
    _issued: list = field(default_factory=list)  # tensors of the collectives issued so far

    @property
    def update_ops(self) -> list[str]:
        return [rec.func.__name__ for rec in self.updates]

    @property
    def num_ops(self) -> int:
        return len(self.steps)

    @property
    def num_collectives(self) -> int:
        """Collective steps: what one replay issues on every rank (waits not counted)."""
        return len(self.collective_ops)

    def capture_begin(self) -> None:
        self.steps, self.updates, self.outputs, self.nbytes = [], [], None, 0
        self._uses, self.collective_ops, self._issued = [], [], []
        self._modes = contextlib.ExitStack()
        for mode in (torch.no_grad(), _SyncGuard(), _Recorder(self)):
            self._modes.enter_context(mode)

    def capture_end(self, failed: bool = False, keep: Any = None) -> None:
        """Stop recording; ``keep``: outputs whose memory must outlive the replay."""
        self._modes.close()
        if failed:  # leave nothing half-captured behind
            collectives.wait_all(self._issued)
            self.steps, self.updates, self.outputs, self.nbytes = [], [], None, 0
            self.collective_ops = []
        else:
            self.nbytes = share_memory(self._uses, tensors(keep))
        self._uses, self._issued = [], []
        self._updated = False

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.capture_begin()
        try:
            outputs = fn()
        except BaseException:
            self.capture_end(failed=True)
            raise
        self.capture_end(keep=outputs)
        self.outputs = outputs
        return outputs

    def _record(self, func, args, kwargs, out) -> None:
        schema = func._schema
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if collectives.is_functional(func):
            self._record_collective(func, args, kwargs, out, writes)
            return
        entry = self.updatable.find(func) if self.updatable is not None else None
        if entry is not None:
            rec = _UpdateRecord(func, list(args), dict(kwargs), list(entry.spec))
            self.updates.append(rec)
            outs = tensors(out)
            self.steps.append(lambda r=rec, o=outs: copy_into(o, r.func._op(*r.args, **r.kwargs)))
            self._uses.append((tensors(list(args) + list(kwargs.values())), outs))
            return
        # ``._op``: the Python OpOverload wrapper costs a third of a tiny kernel's dispatch
        if writes:  # in-place or out= op: run it again on the same tensors
            self.steps.append(functools.partial(func._op, *args, **kwargs))
            self._uses.append((tensors(list(args) + list(kwargs.values())), []))
            return
        outs = tensors(out)
        if not outs:
            return  # host metadata (sizes, strides): nothing to replay
        inputs = {t.untyped_storage().data_ptr() for t in tensors(list(args) + list(kwargs.values()))}
        if any(o.untyped_storage().data_ptr() in inputs for o in outs):
            return  # a view (or an op like _unsafe_view that aliases): follows its input
        self._uses.append((tensors(list(args) + list(kwargs.values())), outs))
        args = precast_scalars(func, args, outs[0].dtype)
        out_op = out_variant(func)
        if out_op is not None and len(out_op[1]) == len(outs):
            # Write straight into the captured outputs: one kernel, no allocation.
            self.steps.append(fast_out_step(func, out_op, args, kwargs, outs))
        else:
            self.steps.append(lambda: copy_into(outs, func._op(*args, **kwargs)))

    def _record_collective(self, func, args, kwargs, out, writes: bool) -> None:
        if collectives.is_wait(func):
            return  # the collective's own step waits for it
        outs = tensors(out)
        self._issued.extend(outs)
        self.collective_ops.append(collectives.op_name(func))
        self.steps.append(collectives.collective_step(func, args, kwargs, outs, writes))
        self._uses.append((tensors(list(args) + list(kwargs.values())), [] if writes else outs))

    def update(self, cpu_update_input: list[dict]) -> None:
        """Rewrite recorded host arguments: one dict per updatable op (or one for all)."""
        if len(cpu_update_input) == 1:
            cpu_update_input = [dict(cpu_update_input[0]) for _ in self.updates]
        if len(cpu_update_input) != len(self.updates):
            raise CaptureError(f"update: the graph recorded {len(self.updates)} updatable "
                               f"op(s) but {len(cpu_update_input)} update dict(s) were given")
        for rec, new in zip(self.updates, cpu_update_input):
            for kind, where, key in rec.spec:
                if key not in new:
                    continue
                if kind == "kwarg":
                    rec.kwargs[where] = new[key]
                else:
                    rec.args[where] = new[key]
        self._updated = True

    def replay(self) -> None:
        if not self.steps:
            raise CaptureError("replay: nothing was captured")
        if self.require_update and self.updates and not self._updated:
            raise CaptureError(f"replay: the graph holds {len(self.updates)} op(s) with host "
                               f"sequence lengths and no update() was given since the last replay")
        # No autograd during replay, so dispatch may start below it (as a graph would).
        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            for step in self.steps:
                step()
        self._updated = False
