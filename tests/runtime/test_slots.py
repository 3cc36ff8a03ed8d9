"""The slot map: two state copies per pool row, the flip, and the staged-slots record that
lets a fused round skip its staging copy (runtime/slots.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nextn_graph.runtime.slots import SlotMap


@dataclass
class Req:
    row: int
    copy: int = 0


def test_slots_rows_and_the_flip():
    m = SlotMap(rows=5)
    reqs = [Req(1), Req(3, copy=1), Req(4)]
    assert m.slots(reqs) == [1, 8, 4] and m.slot(3, 1) == 8 and m.slot(2) == 2
    assert [m.row(s) for s in m.slots(reqs)] == [1, 3, 4]
    m.flip(reqs[:2])
    assert [r.copy for r in reqs] == [1, 0, 0] and m.slots(reqs) == [6, 3, 4]


def test_device_side_matches_the_host_side():
    m = SlotMap(rows=5)
    slots = torch.tensor([0, 1, 5, 8, 9])  # padding copy 0 and 1, then real slots
    assert m.rows_of(slots).tolist() == [0, 1, 0, 3, 4]
    other = m.other(slots).tolist()
    assert other == [5, 6, 0, 3, 4]
    assert other == m.slots([Req(m.row(s), 1 - s // 5) for s in slots.tolist()])


def test_staged_record_skips_only_the_exact_slots_a_fused_round_left():
    m = SlotMap(rows=4)
    assert m.needs_staging(2, [1, 2])  # nothing known yet
    m.staged(2, [1, 2], flipped=True)  # a fused round wrote copies 1: slots 5, 6
    assert not m.needs_staging(2, [5, 6])
    assert m.needs_staging(2, [1, 2])  # the old copies
    assert m.needs_staging(4, [5, 6])  # another bucket: the padding differs
    assert m.needs_staging(2, [6, 5])  # another order
    m.staged(2, [5, 6], flipped=True)  # and back to copy 0
    assert not m.needs_staging(2, [1, 2])
    m.staged(2, None)  # a split round or a capture: unknown
    assert m.needs_staging(2, [1, 2])
