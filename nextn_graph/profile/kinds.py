"""Which part of the model an op belongs to (its module kind): the label its code declares.

The code declares its labels itself (``nextn_graph/labels.py``): a class attribute
``profile_label`` on a module class, ``@labelled(LABEL)`` on a function or method whose
label differs from its class's, a module constant ``profile_label`` where a whole file
is one part (``memory/``, ``sampling.py``); ``DEFER`` (None) or no declaration leaves
the op to the caller. Nothing here names a file, a function or a module path: renaming
or moving code moves its label with it.

A frame's code object is found in its module by its qualified name (``co_qualname``,
read from the frame's globals): the function, the classes around it (innermost first),
then the module decide, the first that declares anything; a nested function (a lambda,
a closure) is its enclosing definition's. A function counts only where its code is or
encloses the frame's (a name rebound to another object decides nothing), the module
only for code its own file defines (not code a ``dataclass`` generates). An op takes the
label of the innermost frame of its stack that decides; frames of code that declares
nothing (torch, ``parallel``, the kernel sets' dispatch) are passed over; a stack with
no deciding frame is ``other``. A declared label outside ``LABELS`` is a ValueError
naming the code.

Cheap: each code object is resolved once and cached; an op costs a walk up its frames
with one dict lookup each.
"""

from __future__ import annotations

from types import CodeType, FrameType, FunctionType
from typing import Any, Mapping

from ..labels import ATTRIBUTE, DEFER, OTHER, check_label

_MISSING = object()
_UNWRAP = ("__func__", "fget", "func", "__wrapped__")  # staticmethod, property, caches


def _encloses(outer: CodeType, code: CodeType) -> bool:
    """``code`` is ``outer`` or defined inside it (its constants, recursively)."""
    return outer is code or any(type(c) is CodeType and _encloses(c, code)
                                for c in outer.co_consts)


def _declaration(obj: Any, code: CodeType) -> Any:
    """What a namespace entry ``obj`` declares for ``code``: its label (or DEFER), or
    _MISSING where it declares nothing or is not the function that defines ``code``."""
    label = _MISSING
    for _ in range(8):  # through staticmethod, classmethod, property, functools wrappers
        if label is _MISSING:
            label = getattr(obj, ATTRIBUTE, _MISSING)
        if type(obj) is FunctionType:
            return label if _encloses(obj.__code__, code) else _MISSING
        obj = next((getattr(obj, a) for a in _UNWRAP if hasattr(obj, a)), None)
        if obj is None:
            break
    return _MISSING


def declared_label(code: CodeType, namespace: Mapping[str, Any]) -> str | None:
    """The label ``code`` (run with globals ``namespace``) declares; None: it defers."""
    where = f"{code.co_qualname} ({code.co_filename})"
    names = code.co_qualname.split(".")
    if "<locals>" in names:  # a nested function: its enclosing definition's
        names = names[:names.index("<locals>")]
    found, scope = [], namespace
    for name in names:
        obj = scope.get(name, _MISSING)
        if isinstance(obj, type):
            found.append(getattr(obj, ATTRIBUTE, _MISSING))
            scope = vars(obj)
            continue
        if obj is not _MISSING:
            found.append(_declaration(obj, code))
        break
    for label in reversed(found):  # the function, then its classes, innermost first
        if label is not _MISSING:
            return check_label(label, where)
    if code.co_filename == namespace.get("__file__"):
        return check_label(namespace.get(ATTRIBUTE, DEFER), where)
    return DEFER


class KindResolver:
    """Frame -> module kind, cached per code object."""

    def __init__(self) -> None:
        self._labels: dict[CodeType, str | None] = {}

    def of_frame(self, frame: FrameType | None) -> str:
        """The kind of an op called from ``frame`` (the innermost Python frame)."""
        labels = self._labels
        while frame is not None:
            code = frame.f_code
            label = labels.get(code, labels)  # the dict itself: not seen yet
            if label is labels:
                label = labels[code] = declared_label(code, frame.f_globals)
            if label is not None:
                return label
            frame = frame.f_back
        return OTHER
