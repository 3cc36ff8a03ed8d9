"""The work profile's labels: which part of the model an op belongs to, declared by the
code that runs it (``profile/kinds.py`` reads the declarations; ``docs/profile.md``).

A declaration is an attribute named ``profile_label`` (``ATTRIBUTE``), holding a label
of ``LABELS`` or ``DEFER`` (the caller decides), on

- a function or method, with ``@labelled(LABEL)`` (it sets the attribute and returns the
  function itself: no wrapper, no frame, nothing at run time); it covers the functions
  nested in it (lambdas, closures) too;
- a class, as a class attribute (``profile_label = ATTENTION``): the methods the class
  body defines, unless they declare their own; subclasses inherit it as any attribute;
- a module, as a module constant: the code that module's file defines, where neither its
  function nor its class declares.

The innermost declaration of a frame's code decides for that frame; an op takes the label
of the innermost frame of its stack that declares one other than ``DEFER``, or
``OTHER``. Plain data: nothing here is written at run time.
"""

from __future__ import annotations

from typing import Callable, TypeVar

ATTRIBUTE = "profile_label"

ATTENTION = "attention"
INDEXER = "indexer"
COMPRESSOR = "compressor"
MHC = "mhc"
EMBED = "embed"
HEAD = "head"
NEXTN_FUSE = "nextn_fuse"
NORM = "norm"
MOE_GATE = "moe_gate"
MOE_SHARED = "moe_shared"
MOE_ROUTED = "moe_routed"
KV_CACHE = "kv_cache"
PAGE_TABLE = "page_table"  # the page-table gathers: request pages, entry rows, write slots
BOOKKEEPING = "bookkeeping"
ACCEPT_SAMPLING = "accept/sampling"
LABELS = (ATTENTION, INDEXER, COMPRESSOR, MHC, EMBED, HEAD, NEXTN_FUSE, NORM, MOE_GATE,
          MOE_SHARED, MOE_ROUTED, KV_CACHE, PAGE_TABLE, BOOKKEEPING, ACCEPT_SAMPLING)

OTHER = "other"  # an op no frame of its stack labels (never declared)
DEFER = None  # declared: the caller decides

F = TypeVar("F", bound=Callable)


def check_label(label: object, where: str) -> str | None:
    """``label`` if it is one of ``LABELS`` or ``DEFER``; else a ValueError naming
    ``where`` it was declared."""
    if label is DEFER or (type(label) is str and label in LABELS):
        return label
    raise ValueError(f"{where}: profile label {label!r} is not one of {', '.join(LABELS)} "
                     f"or DEFER (None)")


def labelled(label: str | None) -> Callable[[F], F]:
    """Declare the label of a function's ops (and of the functions nested in it)."""
    check_label(label, "labelled()")

    def declare(fn: F) -> F:
        setattr(fn, ATTRIBUTE, label)
        return fn
    return declare
