"""The slot map: where each request's device state lives, and all arithmetic on slots.

Pool row r in [0, R) has two state slots, r (copy 0) and r + R (copy 1); row 0 is
padding. A round reads each request's committed copy and writes the next state into
the other; the host flips the request to it once the round's readback succeeded
(overlapped: once it is launched), so a round that fails anywhere leaves every
committed copy as it was. A fused round flips the staged-slots buffer itself, so the
next chunk of the same requests needs no staging copy.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

import torch

from ..labels import BOOKKEEPING

profile_label = BOOKKEEPING  # the work profile's label of this file's code (labels.py)


class Slotted(Protocol):
    row: int  # pool row
    copy: int  # which of the row's two copies holds the committed state


class SlotMap:
    def __init__(self, rows: int):
        self.rows = rows  # R, the pool's request rows (padding row 0 included)
        self._staged: tuple[int, tuple[int, ...]] | None = None  # (bucket, slots), if known

    def slot(self, row: int, copy: int = 0) -> int:
        return row + copy * self.rows

    def slots(self, reqs: Iterable[Slotted]) -> list[int]:
        return [self.slot(r.row, r.copy) for r in reqs]

    def row(self, slot: int) -> int:
        return slot % self.rows

    def flip(self, reqs: Iterable[Slotted]) -> None:
        for r in reqs:
            r.copy ^= 1

    def rows_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Pool rows [B] (padding slots give row 0)."""
        return slots.remainder(self.rows)

    def other(self, slots: torch.Tensor) -> torch.Tensor:
        """The other copies' slots [B]: where a round writes the next state."""
        return (slots + self.rows).remainder(2 * self.rows)

    def needs_staging(self, bucket: int, slots: Sequence[int]) -> bool:
        return self._staged != (bucket, tuple(slots))

    def staged(self, bucket: int, slots: Sequence[int] | None, flipped: bool = False) -> None:
        """What the buffer holds now: ``slots`` at ``bucket`` (``flipped``: their other
        copies, a fused round having moved them), or unknown (None)."""
        if slots is None:
            self._staged = None
        else:
            rows = self.rows
            self._staged = (bucket, tuple((s + rows) % (2 * rows) if flipped else s
                                          for s in slots))
