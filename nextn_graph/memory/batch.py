"""Per-forward index tensors: what every cached forward reads, and nothing else.

Rows of one request are contiguous and hold consecutive positions
``cache_start .. seq_end - 1``; positions before ``cache_start`` come from the
pool. Padding rows belong to request row 0 at position 0. All fields are device
tensors of shape [T], so one forward never syncs with the host and a graph can
capture it over static copies of these tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..labels import KV_CACHE

profile_label = KV_CACHE  # the work profile's label of this file's code (labels.py)


@dataclass(frozen=True)
class Chunk:
    """One request's rows in a forward: tokens at positions ``start .. start+len-1``."""

    req_index: int
    start: int
    tokens: Sequence[int]


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_index: torch.Tensor  # [T] int64, pool request row; 0 = padding
    cache_start: torch.Tensor  # [T] first position this forward computes for the row's request
    seq_end: torch.Tensor  # [T] one past the last position this forward computes for it
    # Static: how many request chunks the rows form (a padding row is its own), or None
    # if unknown. It bounds the rows that can close a compressed block.
    num_chunks: int | None = None
    # [T] int64 or None: the prefix-cache snapshot that keeps the state at each row's
    # next page boundary (0: none); prefill forwards only
    snapshot: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @staticmethod
    def from_chunks(chunks: Sequence[Chunk], device: torch.device | str = "cpu",
                    pad_to: int | None = None,
                    snapshot: Sequence[int] | None = None) -> "ForwardBatch":
        """Host-side build (eager paths only); padding rows are appended up to ``pad_to``.
        ``snapshot``: one per chunk row (padding rows get 0)."""
        cols: list[list[int]] = [[], [], [], [], []]
        for c in chunks:
            n = len(c.tokens)
            for i, tok in enumerate(c.tokens):
                for col, v in zip(cols, (tok, c.start + i, c.req_index, c.start, c.start + n)):
                    col.append(int(v))
        pad = (pad_to or 0) - len(cols[0])
        for _ in range(max(pad, 0)):
            for col, v in zip(cols, (0, 0, 0, 0, 1)):
                col.append(v)
        t = [torch.tensor(col, dtype=torch.int64, device=device) for col in cols]
        snap = None if snapshot is None else torch.tensor(
            list(snapshot) + [0] * max(pad, 0), dtype=torch.int64, device=device)
        return ForwardBatch(*t, num_chunks=len(chunks) + max(pad, 0), snapshot=snap)

    def select(self, rows: torch.Tensor) -> "ForwardBatch":
        """The rows ``rows`` [K] of this batch (index tensors only: capture-safe)."""
        return ForwardBatch(*(f.index_select(0, rows) for f in (
            self.input_ids, self.positions, self.req_index, self.cache_start, self.seq_end)),
            num_chunks=self.num_chunks, snapshot=None if self.snapshot is None
            else self.snapshot.index_select(0, rows))

    def max_block_closers(self, ratio: int) -> int:
        """A static bound on rows with ``(p+1) % ratio == 0``: each chunk of n rows holds
        at most n // ratio + 1, and the n // ratio sum to at most T // ratio."""
        t = self.num_rows
        return t if self.num_chunks is None else min(t, t // ratio + self.num_chunks)


class ForwardPlan:
    """What the layers of one forward derive from its ``ForwardBatch`` alone, computed once.

    Slot arithmetic, key masks, block closers and RoPE rotations depend on the batch and a
    static size (a ring's length, a ratio, a width), never on the layer: computed per layer,
    a 43-layer forward repeated them 43 times. ``memo(key, make)`` runs ``make`` on the
    first ask for ``key`` and hands every later ask the same tensors.

    Make one per forward, inside it (the models' ``forward`` do): everything it holds is
    computed by ops of that forward from the batch's tensors, so a graph capture records
    them and a replay recomputes them from the new batch. A plan kept across forwards, or
    made before a capture began, would hand the graph stale tensors.

    ``row_ids`` [K]: a plan of some rows of a forward (``block_closers``), whose chunk
    tensors still have ``forward_rows`` rows.
    """

    def __init__(self, batch: ForwardBatch, row_ids: torch.Tensor | None = None,
                 forward_rows: int | None = None):
        self.batch = batch
        self.row_ids = row_ids
        self.forward_rows = batch.num_rows if forward_rows is None else forward_rows
        self._memo: dict = {}

    def memo(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def row_index(self) -> torch.Tensor:
        """[K] the forward's row of each of this plan's rows."""
        if self.row_ids is not None:
            return self.row_ids
        return self.memo("row_index", lambda: torch.arange(
            self.batch.num_rows, device=self.batch.positions.device))

    def block_closers(self, ratio: int) -> "ForwardPlan":
        """The plan of a static number K of rows that includes every row closing a block
        (``(p+1) % ratio == 0``): closers first in row order, then other rows in row order
        as padding (``ForwardBatch.max_block_closers`` bounds K)."""
        def make() -> ForwardPlan:
            b = self.batch
            t, k = b.num_rows, b.max_block_closers(ratio)
            closes = (b.positions + 1) % ratio == 0  # [T]
            # A unique key per row: closers above the rest, lower rows above higher ones,
            # so the top k are exactly what a stable sort on ~closes puts first.
            key = torch.add(torch.arange(t - 1, -1, -1, device=closes.device), closes, alpha=t)
            sel = key.topk(k).indices  # [K], sorted by key: the stable order
            rows = sel if self.row_ids is None else self.row_ids[sel]
            return ForwardPlan(b.select(sel), rows, self.forward_rows)
        return self.memo(("block_closers", ratio), make)

    def finished_entries(self, ratio: int, n: int) -> torch.Tensor:
        """[T, n] bool: entry j of each row's request is a finished block, ``j < (p+1)//ratio``."""
        def make() -> torch.Tensor:
            p = self.batch.positions
            return torch.arange(n, device=p.device) < ((p + 1) // ratio).unsqueeze(1)
        return self.memo(("finished_entries", ratio, n), make)
