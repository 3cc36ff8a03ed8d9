"""Collectives inside a captured graph: the functional ones replay, in capture order, so
every rank re-issues the same collectives in the same order; a host-side one is refused
before anything is sent, at the same op on every rank, so no rank is left waiting.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Callable

import torch

from .steps import copy_into, tensors

FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd")
# Every op of those namespaces that issues communication (torch 2.13); ``wait_tensor``
# completes one; anything else there is refused rather than guessed at.
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_",
    "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
    "all_to_all_single", "broadcast", "broadcast_", "isend", "irecv", "batch_p2p_ops",
})
_HINT = "use the functional collectives (TPGroup.all_reduce / TPGroup.all_gather)"
_C10D_PY = Path(torch.distributed.__file__).resolve().parent / "distributed_c10d.py"


def op_name(func) -> str:
    """``c10d.allreduce_``: an op overload's namespace and name, without the overload."""
    return f"{func.namespace}.{func._opname}"


def is_functional(func) -> bool:
    return func.namespace in FUNCTIONAL


def is_wait(func) -> bool:
    return is_functional(func) and func._opname == "wait_tensor"


def refusal(func) -> str | None:
    if func.namespace == "c10d":
        api = distributed_caller() or "a torch.distributed call"
        return f"capture: {op_name(func)} is a host-side collective ({api}): it cannot " \
               f"live in a graph; {_HINT}"
    if is_functional(func) and not is_wait(func) and func._opname not in COLLECTIVES:
        why = ("it wraps the result in an AsyncCollectiveTensor (the Python API of "
               "torch.distributed._functional_collectives), which the emulator cannot hold"
               if func._opname == "_wrap_tensor_autograd" else "not a known collective")
        return f"capture: {op_name(func)} cannot be replayed: {why}; call the " \
               f"torch.ops._c10d_functional ops and wait_tensor, as TPGroup does"
    return None


def host_collective(what: str) -> str | None:
    """When ``what`` came from inside ``torch.distributed`` (``broadcast_object_list``)."""
    api = distributed_caller()
    if api is None:
        return None
    return f"capture: {api} is a host-side collective: it cannot live in a graph (it " \
           f"reached {what}); {_HINT}"


def distributed_caller() -> str | None:
    """``torch.distributed.<name>``: the outermost ``distributed_c10d`` function on the
    stack (the one user code called), or None. Error paths only: it walks the stack."""
    for frame in traceback.extract_stack():
        if Path(frame.filename).resolve() == _C10D_PY:
            return f"torch.distributed.{frame.name}"
    return None


def collective_step(func, args: tuple, kwargs: dict, outs: list[torch.Tensor],
                    writes: bool) -> Callable[[], None]:
    op, wait = func._op, torch.ops._c10d_functional.wait_tensor.default._op

    def step() -> None:
        fresh = [wait(t) for t in tensors(op(*args, **kwargs))]
        if not writes:
            copy_into(outs, fresh)

    return step


def wait_all(outs: list[torch.Tensor]) -> None:
    """Complete the collectives a failed capture issued: pending work would otherwise
    outlive its tensors (a warning at exit) and hold the group."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    for t in outs:
        try:
            wait(t)
        except RuntimeError:  # a failed collective: the capture's own error is raised
            pass
