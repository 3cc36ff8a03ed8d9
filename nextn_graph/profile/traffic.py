"""Bytes an op touches: a small table of rules, one documented function each.

Every rule maps one kernel-launching op to ``(bytes read, bytes written)`` from the
metadata of its arguments and outputs (no values: on the ``meta`` device there are
none). The model, rule by rule:

- ``extent``: a tensor argument counts its own elements, ``numel x itemsize``, except
  that a dim of stride 0 (an ``expand``ed or broadcast tensor) counts once.
- ``default_traffic``: every tensor argument is read whole; the outputs are written
  whole. An in-place or ``out=`` op counts the argument it writes once, as written
  (not also as read).
- ``gather_traffic`` (``index.Tensor``, ``index_select``, ``embedding``, ``gather``,
  ``take``): the source (argument 0) is read only as many bytes as the output holds;
  the index tensors are read whole.
- ``scatter_traffic`` (in place: ``index_put_``, ``index_copy_``, ``index_add_``,
  ``scatter_``, ``scatter_add_``, ``scatter_reduce_``): the elements the op writes,
  not the whole destination; the values and indices are read. The accumulating ones
  (``index_add_``, ``scatter_add_``, ``scatter_reduce_``, ``index_put_`` with
  ``accumulate``) also read the destination elements they update. The out-of-place
  forms (``scatter``, ``index_put``) copy their whole destination: default rule.
- ``grouped_traffic``: any op with an argument named ``offs`` (``aten._grouped_mm``,
  ``nextn_graph::quant_grouped_mm``): rows of the first argument ``[M, ...]`` are
  sorted by group and ``offs`` holds G group ends, so a group-stacked argument
  (another argument of 2+ dims whose dim 0 is G: weights, scales) is read only for
  ``min(G, M)`` groups (a group with no rows is not read).
- ``no_traffic``: allocations (``empty``, ``empty_like``, ``new_empty``, ...) and
  ``_unsafe_view`` (an alias the schema does not mark): no bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor


@dataclass(frozen=True)
class OpSchema:
    """What the rules need of an op's schema, read once per op."""

    name: str  # the overload packet, e.g. "aten.index_put_"
    names: tuple[str, ...]  # argument names in schema order
    pos: dict[str, int]  # argument name -> position
    written: tuple[int, ...]  # positions of the arguments the op writes (in place, out=)
    fresh: bool  # no return aliases an argument: every output is a new tensor

    @staticmethod
    def of(func) -> "OpSchema":
        args = func._schema.arguments
        written = tuple(i for i, a in enumerate(args)
                        if a.alias_info is not None and a.alias_info.is_write)
        fresh = all(r.alias_info is None for r in func._schema.returns)
        names = tuple(a.name for a in args)
        return OpSchema(str(func.overloadpacket), names, {n: i for i, n in enumerate(names)},
                        written, fresh)

    def at(self, args: tuple, kwargs: dict, i: int):
        """The value of argument ``i`` (given by position or by keyword), None if absent."""
        return args[i] if i < len(args) else kwargs.get(self.names[i])

    def get(self, args: tuple, kwargs: dict, name: str):
        i = self.pos.get(name)
        return None if i is None else self.at(args, kwargs, i)


Traffic = Callable[[OpSchema, tuple, dict, object], "tuple[int, int]"]


def extent(t: Tensor) -> int:
    """Bytes of a tensor's own elements; a dim of stride 0 (broadcast) counts once."""
    if t.is_contiguous():
        return t.numel() * t.element_size()
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return 0
        if stride:
            n *= size
    return n * t.element_size()


def tensors(values: Iterable) -> Iterator[Tensor]:
    """The tensors among op arguments, one level of lists (``cat``, ``index``) included."""
    for v in values:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, Tensor):
                    yield x


def out_bytes(out) -> int:
    if isinstance(out, Tensor):
        return extent(out)
    if isinstance(out, (list, tuple)):
        return sum(extent(t) for t in tensors(out))
    return 0


def default_traffic(s: OpSchema, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """Arguments read whole, outputs written whole; a written argument counts once."""
    if not s.written:
        read = sum(extent(t) for t in tensors(chain(args, kwargs.values())))
        return read, out_bytes(out)
    dests = [t for i in s.written if isinstance(t := s.at(args, kwargs, i), Tensor)]
    read = sum(extent(t) for t in tensors(chain(args, kwargs.values()))
               if not any(t is d for d in dests))
    return read, sum(extent(d) for d in dests) + (out_bytes(out) if s.fresh else 0)


def gather_traffic(s: OpSchema, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """The source (argument 0) is read for as many elements as the output holds."""
    src = args[0]
    src_read = min(extent(src), out.numel() * src.element_size())
    others = sum(extent(t) for t in tensors(chain(args[1:], kwargs.values())))
    return src_read + others, out_bytes(out)


def _index_put_elements(s: OpSchema, args: tuple, kwargs: dict) -> int:
    """Elements ``index_put_`` writes: the broadcast index positions times the dims
    the indices leave whole (a None index is a whole dim)."""
    dest, indices = args[0], s.get(args, kwargs, "indices")
    given = [i for i in indices if i is not None]
    n = math.prod(torch.broadcast_shapes(*(i.shape for i in given))) if given else 1
    n *= math.prod(dest.shape[d] for d, i in enumerate(indices) if i is None)
    return n * math.prod(dest.shape[len(indices):])


def _numel_of(name: str) -> Callable[[OpSchema, tuple, dict], int]:
    """Elements written = those of argument ``name`` (``source`` or ``index``)."""
    return lambda s, args, kwargs: s.get(args, kwargs, name).numel()


# in-place scatter -> (elements it writes, the argument holding the values, accumulates)
SCATTERS = {
    "aten.index_put_": (_index_put_elements, "values", "accumulate"),
    "aten._index_put_impl_": (_index_put_elements, "values", "accumulate"),
    "aten.index_copy_": (_numel_of("source"), "source", False),
    "aten.index_add_": (_numel_of("source"), "source", True),
    "aten.scatter_": (_numel_of("index"), "src", False),
    "aten.scatter_add_": (_numel_of("index"), "src", True),
    "aten.scatter_reduce_": (_numel_of("index"), "src", True),
}


def scatter_traffic(s: OpSchema, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """Writes the elements scattered, not the destination; reads values and indices
    (and, accumulating, the destination elements updated)."""
    count, values_name, accumulate = SCATTERS[s.name]
    dest = args[0]
    n = count(s, args, kwargs)
    written = n * dest.element_size()
    values = s.get(args, kwargs, values_name)
    read = 0
    if isinstance(values, Tensor):  # scatter_.value scatters a scalar
        read += min(extent(values), n * values.element_size())
    read += sum(extent(t) for t in tensors(chain(args[1:], kwargs.values()))
                if t is not values)
    if accumulate is True or (isinstance(accumulate, str)
                              and s.get(args, kwargs, accumulate)):
        read += written
    return read, written


def grouped_traffic(s: OpSchema, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """Group-stacked arguments (2+ dims, dim 0 = G = offs.numel()) are read for
    min(G, M) groups, M = rows of the first argument."""
    offs = s.get(args, kwargs, "offs")
    x = args[0]
    if not isinstance(offs, Tensor) or x.dim() != 2:
        return default_traffic(s, args, kwargs, out)  # a plain batched GEMM: no groups
    g, m = offs.numel(), x.shape[0]
    read = extent(x)
    for t in tensors(chain(args[1:], kwargs.values())):
        stacked = t is not offs and t.dim() >= 2 and t.shape[0] == g and g > 0
        read += extent(t) * min(g, m) // g if stacked else extent(t)
    return read, out_bytes(out)


def no_traffic(s: OpSchema, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """An allocation or an unmarked alias moves no bytes."""
    return 0, 0


GATHERS = frozenset({"aten.index", "aten.index_select", "aten.embedding", "aten.gather",
                     "aten.take"})
NO_DATA = frozenset({"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
                     "aten.new_empty_strided", "aten._unsafe_view"})


def traffic_rule(s: OpSchema) -> Traffic:
    """The rule of an op, chosen once per op."""
    if s.name in NO_DATA:
        return no_traffic
    if "offs" in s.pos:
        return grouped_traffic
    if s.name in GATHERS:
        return gather_traffic
    if s.name in SCATTERS:
        return scatter_traffic
    return default_traffic
