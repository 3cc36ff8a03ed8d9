"""Reusing the output metadata of repeated ops on the ``meta`` device.

A meta kernel computes only its outputs' shapes, strides and dtypes, and many run as
Python reference implementations (tens to hundreds of microseconds each). A round
repeats the same op on the same shapes hundreds of times (every layer, every expert),
so the outputs are remembered by the op and its inputs' metadata and rebuilt with one
``empty_strided``. Exact: on ``meta`` an output depends on nothing else. Only ops
that allocate fresh outputs, write no argument, draw no random numbers and take
meta tensors only are remembered; the first call of every key runs the real kernel
(so its shape checks still raise where they should).
"""

from __future__ import annotations

import torch
from torch import Tensor

_SKIP = object()  # a value that cannot be keyed: run the op


def _key(values) -> tuple | object:
    out = []
    for v in values:
        if isinstance(v, Tensor):
            if v.device.type != "meta":
                return _SKIP
            out.append((v.shape, v.stride(), v.dtype))
        elif isinstance(v, (list, tuple)):
            sub = _key(v)
            if sub is _SKIP:
                return _SKIP
            out.append(sub)
        else:
            out.append(v)
    return tuple(out)


def _spec(out):
    """(shape, stride, dtype) of a tensor output, a tuple of those, or None."""
    if isinstance(out, Tensor):
        return out.shape, out.stride(), out.dtype
    if isinstance(out, (tuple, list)) and out and all(isinstance(t, Tensor) for t in out):
        return tuple(_spec(t) for t in out)
    return None


def _build(spec) -> Tensor | tuple:
    if isinstance(spec[0], torch.Size):
        return torch.empty_strided(spec[0], spec[1], dtype=spec[2], device="meta")
    return tuple(_build(s) for s in spec)


def can_remember(func) -> bool:
    """Whether an op's outputs may be rebuilt from metadata: fresh outputs, no argument
    written, no view, no random numbers."""
    schema = func._schema
    return (not func.is_view
            and all(a.alias_info is None or not a.alias_info.is_write for a in schema.arguments)
            and all(r.alias_info is None for r in schema.returns)
            and torch.Tag.nondeterministic_seeded not in func.tags)


class MetaMemo:
    def __init__(self):
        self._outs: dict = {}
        self.hits = 0

    def run(self, func, args: tuple, kwargs: dict):
        """``func(*args, **kwargs)``, or its remembered output rebuilt."""
        key = _key(args)
        if key is not _SKIP and kwargs:
            extra = _key(kwargs.values())
            key = _SKIP if extra is _SKIP else (key, tuple(kwargs), extra)
        if key is _SKIP:
            return func(*args, **kwargs)
        key = (func, key)
        try:
            spec = self._outs.get(key)
        except TypeError:  # an unhashable argument
            return func(*args, **kwargs)
        if spec is not None:
            self.hits += 1
            return _build(spec)
        out = func(*args, **kwargs)
        spec = _spec(out)
        if spec is not None:
            self._outs[key] = spec
        return out
