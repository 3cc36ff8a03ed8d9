"""Token-to-KV pools: per-layer SWA rings, compressed-entry pools, compressor rings.

Layout. Every request owns one *request row* ``r`` (``1..max_requests``); row 0
is reserved for padding and for writes that must land nowhere. Each per-request
structure is a fixed-stride range indexed by absolute position, so request ``r``
at position ``p`` lives at

- SWA ring:             ``r * swa_ring + p % swa_ring``   (swa_ring >= window + N - 1)
- compressor raw ring:  ``r * raw_ring + p % raw_ring``   (raw_ring >= coff*ratio + N - 1)
- compressed entry j:   ``r * entries + j``               (entries = max_context // ratio)

N is the largest verify window. The ring slack ``N - 1`` is what makes commit by
length work: positions written by a rejected speculation are overwritten by the
next round before anything valid reads them, and they never clobber a position
the next round still needs. The NextN draft gets its own SWA-only pool with the
same request numbering as the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import CapacityError
from .batch import ForwardBatch

if TYPE_CHECKING:  # model imports memory: a runtime import here would be circular
    from ..model.config import ModelConfig


@dataclass(frozen=True)
class PoolLayout:
    max_requests: int  # real requests; the pool holds one more row (row 0, padding)
    max_context: int  # positions per request, prompt and output together
    verify_width: int  # N, the largest window one forward writes per request

    @property
    def rows(self) -> int:
        return self.max_requests + 1


@dataclass
class Ring:
    """Per-request position-indexed ring: ``data`` [rows * size, F]."""

    data: torch.Tensor
    size: int

    def gather_recent(self, chunk: torch.Tensor, batch: ForwardBatch, span: int,
                      row_ids: torch.Tensor | None = None):
        """The ``span`` positions ending at each row's own: from the ring for positions
        before the row's ``cache_start``, else from this forward's ``chunk`` rows.

        chunk: [T, F]; batch: the K rows asked about, which are ``row_ids`` [K] of the
        forward (default: all T rows) -> (values [K, span, F], key_pos [K, span]);
        key_pos < 0 is invalid.
        """
        t = chunk.shape[0]
        if row_ids is None:
            row_ids = torch.arange(t, device=chunk.device)
        offsets = torch.arange(span, device=chunk.device) - (span - 1)  # [span]
        key_pos = batch.positions.unsqueeze(1) + offsets  # [K, span]
        safe_pos = key_pos.clamp(min=0)
        slot = batch.req_index.unsqueeze(1) * self.size + safe_pos % self.size  # [K, span]
        rows = row_ids.unsqueeze(1) + offsets  # the forward's row holding each key
        from_ring = (key_pos < batch.cache_start.unsqueeze(1)).unsqueeze(-1)  # [K, span, 1]
        values = torch.where(from_ring, self.data[slot], chunk[rows.clamp(0, t - 1)])
        return values, key_pos

    def write(self, chunk: torch.Tensor, batch: ForwardBatch) -> None:
        """Store each row at its position; rows older than the ring keeps go to slot 0."""
        keep = batch.positions >= batch.seq_end - self.size
        slot = batch.req_index * self.size + batch.positions % self.size
        self.data.index_copy_(0, torch.where(keep, slot, torch.zeros_like(slot)), chunk)


@dataclass
class CompressedCache:
    """A compressor's state for one layer: raw per-position ring and finished entries."""

    raw: Ring  # [rows * raw_ring, 2 * coff * d]: pooled values, then gate scores (+ape)
    entries: torch.Tensor  # [rows * per_request, d]
    per_request: int  # entries per request = max_context // ratio

    def write_entries(self, entry: torch.Tensor, batch: ForwardBatch, ratio: int) -> None:
        """Rows closing a block (``(p+1) % ratio == 0``) store entry ``(p+1)//ratio - 1``."""
        closes = (batch.positions + 1) % ratio == 0
        slot = batch.req_index * self.per_request + (batch.positions + 1) // ratio - 1
        self.entries.index_copy_(0, torch.where(closes, slot, torch.zeros_like(slot)), entry)

    def select_entries(self, batch: ForwardBatch, idx: torch.Tensor) -> torch.Tensor:
        """Entries ``idx`` [T, k] of each row's request: [T, k, d]."""
        return self.entries[batch.req_index.unsqueeze(1) * self.per_request + idx]

    def request_entries(self, batch: ForwardBatch) -> torch.Tensor:
        """All entry slots of each row's request: [T, per_request, d]."""
        view = self.entries.view(-1, self.per_request, self.entries.shape[-1])
        return view[batch.req_index]


@dataclass
class LayerCache:
    swa: Ring  # [rows * swa_ring, head_dim]; every layer has one, ratio 0 included
    compressed: CompressedCache | None  # ratio 4 / 128 only
    index: CompressedCache | None  # the lightning indexer's keys, ratio 4 only


class KVPool:
    """All KV storage of one model, plus the host-side request-row allocator."""

    def __init__(self, cfg: ModelConfig, layout: PoolLayout, ratios: list[int],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        if layout.max_context > cfg.max_position_embeddings:
            raise CapacityError(
                f"max_context {layout.max_context} exceeds the model's "
                f"max_position_embeddings {cfg.max_position_embeddings}")
        self.layout = layout
        rows = layout.rows
        swa_ring = cfg.sliding_window + layout.verify_width - 1

        def ring(size: int, width: int) -> Ring:
            return Ring(torch.zeros(rows * size, width, device=device, dtype=dtype), size)

        def compressed(ratio: int, d: int) -> CompressedCache:
            coff = 2 if ratio == 4 else 1  # C4 entries overlap the previous block
            per_request = max(1, layout.max_context // ratio)  # >= 1: slot 0 is the sink
            return CompressedCache(
                raw=ring(coff * ratio + layout.verify_width - 1, 2 * coff * d),
                entries=torch.zeros(rows * per_request, d, device=device, dtype=dtype),
                per_request=per_request)

        self.layers = [
            LayerCache(
                swa=ring(swa_ring, cfg.head_dim),
                compressed=compressed(r, cfg.head_dim) if r else None,
                index=compressed(r, cfg.index_head_dim) if r == 4 else None)
            for r in ratios]
        self._free = list(range(layout.max_requests, 0, -1))  # row 0 is never handed out

    @property
    def free_rows(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise CapacityError(f"KV pool is full: all {self.layout.max_requests} request rows in use")
        return self._free.pop()

    def release(self, row: int) -> None:
        if not 1 <= row <= self.layout.max_requests or row in self._free:
            raise CapacityError(f"request row {row} is not allocated")
        self._free.append(row)

    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            total += layer.swa.data.nbytes
            for c in (layer.compressed, layer.index):
                if c is not None:
                    total += c.raw.data.nbytes + c.entries.nbytes
        return total
