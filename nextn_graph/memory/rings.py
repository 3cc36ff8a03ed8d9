"""Per-request position-indexed rings: the SWA window and the compressors' raw state of
each request row (``r * size + p % size``), and the prefix cache's snapshots of their
positions before a page boundary (``memory/pool.py`` has the layout, ``docs/prefix_cache.md``
the snapshots)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..labels import KV_CACHE
from .batch import ForwardPlan

profile_label = KV_CACHE  # the work profile's label of this file's code (labels.py)


@dataclass(frozen=True)
class RingIndex:
    """Where the ``span`` keys ending at each row of a plan are: in a ring of ``size``
    positions, or among this forward's chunk rows. It depends on the batch and the ring's
    size only, so a forward computes it once per (size, span) and every layer reuses it
    (``Ring.index``)."""

    slot: torch.Tensor  # [K, span] ring row of each key's position (clamped at 0)
    chunk_row: torch.Tensor  # [K, span] the forward's row holding each key (clamped)
    from_ring: torch.Tensor  # [K, span, 1] bool: the key precedes the row's cache_start
    valid: torch.Tensor  # [K, span] bool: the key's position is >= 0

    @staticmethod
    def of(plan: ForwardPlan, size: int, span: int) -> "RingIndex":
        b = plan.batch
        offsets = torch.arange(1 - span, 1, device=b.positions.device)  # [span]
        key_pos = b.positions.unsqueeze(1) + offsets  # [K, span]
        slot = b.req_index.unsqueeze(1) * size + key_pos.clamp(min=0) % size
        chunk_row = (plan.row_index().unsqueeze(1) + offsets).clamp(0, plan.forward_rows - 1)
        from_ring = (key_pos < b.cache_start.unsqueeze(1)).unsqueeze(-1)
        return RingIndex(slot, chunk_row, from_ring, key_pos >= 0)


@dataclass
class Ring:
    """Per-request position-indexed ring: ``data`` [rows * size, F].

    ``carry``: the positions before a page boundary that positions past it read (the
    window for SWA, C4's overlapping block for a raw ring; 0: none). A prefill forward
    whose batch names snapshots also stores those positions in ``snapshots`` [(S + 1) *
    carry, F] (snapshot s at rows ``s * carry ..``, 0 the sink), which is all a
    prefix-cache hit at that boundary needs of this ring (``restore``)."""

    data: torch.Tensor
    size: int
    carry: int = 0
    page_size: int = 0
    snapshots: torch.Tensor | None = None

    def index(self, plan: ForwardPlan, span: int) -> RingIndex:
        return plan.memo(("ring_index", self.size, span),
                         lambda: RingIndex.of(plan, self.size, span))

    def gather_recent(self, chunk: torch.Tensor, plan: ForwardPlan,
                      span: int) -> tuple[torch.Tensor, RingIndex]:
        """The ``span`` positions ending at each row's own: from the ring for positions
        before the row's ``cache_start``, else from this forward's ``chunk`` rows.

        chunk: [T, F], the whole forward's rows; plan: the K rows asked about (all T, or a
        ``ForwardPlan.block_closers`` plan) -> (values [K, span, F], its ``RingIndex``,
        whose ``valid`` marks keys at positions >= 0).
        """
        idx = self.index(plan, span)
        return torch.where(idx.from_ring, self.data[idx.slot], chunk[idx.chunk_row]), idx

    def write(self, chunk: torch.Tensor, plan: ForwardPlan) -> None:
        """Store each row at its position; rows older than the ring keeps go to slot 0."""
        def make() -> torch.Tensor:
            b = plan.batch
            keep = b.positions >= b.seq_end - self.size
            slot = b.req_index * self.size + b.positions % self.size
            return slot * keep  # slot 0 where not kept
        self.data.index_copy_(0, plan.memo(("ring_write", self.size), make), chunk)
        if plan.batch.snapshot is not None and self.snapshots is not None:
            key = ("ring_snapshot", self.carry, self.page_size)
            self.snapshots.index_copy_(0, plan.memo(key, lambda: self._snapshot_slots(plan)),
                                       chunk)

    def _snapshot_slots(self, plan: ForwardPlan) -> torch.Tensor:
        """[T] each row's slot in the snapshot of its next page boundary, among the
        ``carry`` positions before it; 0 (the sink) for the rest (``carry <= page_size``:
        one boundary a position)."""
        b = plan.batch
        snap = b.snapshot  # [T] the snapshot of the row's next boundary, 0: none
        boundary = (b.positions // self.page_size + 1) * self.page_size
        offset = b.positions - (boundary - self.carry)  # [T] < carry
        keep = (offset >= 0) & (snap > 0)
        return (snap * self.carry + offset) * keep

    def restore(self, snaps: torch.Tensor, rows: torch.Tensor, ends: torch.Tensor) -> None:
        """Snapshot ``snaps`` [R] (the ``carry`` positions before boundary ``ends`` [R])
        onto the ring slots of those positions in request rows ``rows`` [R]."""
        if self.snapshots is None:
            return
        k = torch.arange(self.carry, device=rows.device)  # [carry]
        src = snaps.unsqueeze(1) * self.carry + k  # [R, carry]
        dst = rows.unsqueeze(1) * self.size + (ends.unsqueeze(1) - self.carry + k) % self.size
        self.data.index_copy_(0, dst.reshape(-1), self.snapshots[src.reshape(-1)])
