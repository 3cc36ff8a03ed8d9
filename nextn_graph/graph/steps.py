"""Emulator replay steps, the cheapest call writing the captured output in place (replay
cost is per-op host dispatch), and memory sharing between intermediates."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch


def tensors(tree) -> list[torch.Tensor]:
    """Every tensor in nested lists, tuples, dicts and dataclasses."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = [getattr(tree, f.name) for f in dataclasses.fields(tree)]
    elif isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in tensors(x)]
    return []


@functools.lru_cache(maxsize=None)
def out_variant(func) -> tuple[Any, tuple[str, ...]] | None:
    """The ``.out`` overload taking the same arguments plus out tensors, if any."""
    sig = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = func.overloadpacket
    for overload in packet.overloads():
        op = getattr(packet, overload)
        args = op._schema.arguments
        outs = [a for a in args if a.is_out]
        if outs and [(a.name, str(a.type)) for a in args if not a.is_out] == sig:
            return op, tuple(a.name for a in outs)
    return None


def precast_scalars(func, args, dtype: torch.dtype) -> tuple:
    """Python numbers in Tensor slots become 0-dim tensors once, not on every replay, in
    the op's compute dtype (fp32 for bf16 outputs): eager multiplies a bf16 tensor by
    the scalar in fp32, so a bf16-rounded scalar would change results."""
    if not dtype.is_floating_point:
        return tuple(args)
    compute = torch.promote_types(dtype, torch.float32)  # opmath: fp32, or fp64 for fp64
    slots = [str(a.type) == "Tensor" for a in func._schema.arguments]
    return tuple(torch.tensor(a, dtype=compute) if i < len(slots) and slots[i] and isinstance(
        a, (int, float)) and not isinstance(a, bool) else a for i, a in enumerate(args))


def fast_out_step(func, out_op, args, kwargs, outs) -> Callable[[], Any]:
    """The public ``torch.<op>(..., out=)`` binding (faster to parse) when it reproduces
    the captured result bitwise, else the ``.out`` overload."""
    out_kwargs = {**kwargs, **dict(zip(out_op[1], outs))}
    slow = functools.partial(out_op[0]._op, *args, **out_kwargs)
    public = getattr(torch, func.overloadpacket.__name__, None)
    if public is None or len(outs) != 1 or any(k != "out" for k in out_op[1]):
        return slow
    fast = functools.partial(public, *args, **kwargs, out=outs[0])
    expected = outs[0].clone()
    try:
        fast()
    except (TypeError, RuntimeError):
        outs[0].copy_(expected)
        return slow
    if not torch.equal(outs[0], expected) or outs[0].dtype != expected.dtype:
        outs[0].copy_(expected)
        return slow
    return fast


def share_memory(uses: list, keep: list[torch.Tensor]) -> int:
    """Intermediates share blocks by liveness, as a graph pool does -> bytes held.
    Storages no step allocated, and ``keep``, never move."""
    born: dict[int, int] = {}  # storage -> the step that allocated it
    last: dict[int, int] = {}  # storage -> the last step that touches it
    holders: dict[int, list[torch.Tensor]] = {}
    size: dict[int, int] = {}
    for i, (reads, outs) in enumerate(uses):
        for t in outs:
            ptr = t.untyped_storage().data_ptr()
            born.setdefault(ptr, i)
            size[ptr] = t.untyped_storage().nbytes()
        for t in reads + outs:
            ptr = t.untyped_storage().data_ptr()
            last[ptr] = i
            holders.setdefault(ptr, []).append(t)
    pinned = {t.untyped_storage().data_ptr() for t in keep}
    movable = sorted((p for p in born if p not in pinned and size[p] > 0), key=born.get)
    by_end = sorted(movable, key=last.get)
    free: dict[int, list] = {}  # nbytes -> blocks no live intermediate uses
    block_of: dict[int, Any] = {}
    total, j = 0, 0
    for ptr in movable:
        while j < len(by_end) and last[by_end[j]] < born[ptr]:
            free.setdefault(size[by_end[j]], []).append(block_of[by_end[j]])
            j += 1
        if free.get(size[ptr]):
            block = free[size[ptr]].pop()
        else:
            device = holders[ptr][0].device
            block = torch.empty(size[ptr], dtype=torch.uint8, device=device).untyped_storage()
            total += size[ptr]
        block_of[ptr] = block
        for t in holders[ptr]:
            t.set_(block, t.storage_offset(), t.size(), t.stride())
    return total + sum(size[p] for p in born if p in pinned)


def copy_into(outs: list[torch.Tensor], result) -> None:
    for o, r in zip(outs, tensors(result)):
        o.copy_(r)
