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

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @staticmethod
    def from_chunks(chunks: Sequence[Chunk], device: torch.device | str = "cpu",
                    pad_to: int | None = None) -> "ForwardBatch":
        """Host-side build (eager paths only); padding rows are appended up to ``pad_to``."""
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
        return ForwardBatch(*t, num_chunks=len(chunks) + max(pad, 0))

    def select(self, rows: torch.Tensor) -> "ForwardBatch":
        """The rows ``rows`` [K] of this batch (index tensors only: capture-safe)."""
        return ForwardBatch(*(f.index_select(0, rows) for f in (
            self.input_ids, self.positions, self.req_index, self.cache_start, self.seq_end)),
            num_chunks=self.num_chunks)

    def max_block_closers(self, ratio: int) -> int:
        """A static bound on rows with ``(p+1) % ratio == 0``: each chunk of n rows holds
        at most n // ratio + 1, and the n // ratio sum to at most T // ratio."""
        t = self.num_rows
        return t if self.num_chunks is None else min(t, t // ratio + self.num_chunks)
