"""Counters that a caller diffs around a piece of work: ``before = c.snapshot()``, run,
``c.since(before)`` -> a counter of the same type holding only what that work added."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

C = TypeVar("C", bound="Counters")


class Counters:
    """Mixed into a dataclass of numbers (ints and float seconds)."""

    KEEP: tuple[str, ...] = ()  # fields that describe the run, not amounts: kept, not diffed

    def snapshot(self: C) -> C:
        return dataclasses.replace(self)

    def since(self: C, before: C) -> C:
        return type(self)(**{f.name: getattr(self, f.name) if f.name in self.KEEP
                             else getattr(self, f.name) - getattr(before, f.name)
                             for f in dataclasses.fields(self)})
