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

Sizes come from ``LayerShape``: ``pool_nbytes`` gives a pool's bytes before anything
is allocated, and ``KVPool`` refuses a pool larger than its device's memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import CapacityError
from ..labels import KV_CACHE
from .batch import ForwardPlan

profile_label = KV_CACHE  # the work profile's label of this file's code (labels.py)


class CacheDims(Protocol):
    """What a pool reads of a model's config (``ModelConfig`` has these): the model
    imports memory, so memory names the fields it needs instead of the class."""

    sliding_window: int
    head_dim: int
    index_head_dim: int
    max_position_embeddings: int


@dataclass(frozen=True)
class PoolLayout:
    max_requests: int  # real requests; the pool holds one more row (row 0, padding)
    max_context: int  # positions per request, prompt and output together
    verify_width: int  # N, the largest window one forward writes per request

    @property
    def rows(self) -> int:
        return self.max_requests + 1


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
    """Per-request position-indexed ring: ``data`` [rows * size, F]."""

    data: torch.Tensor
    size: int

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


@dataclass
class CompressedCache:
    """A compressor's state for one layer: raw per-position ring and finished entries."""

    raw: Ring  # [rows * raw_ring, 2 * coff * d]: pooled values, then gate scores (+ape)
    entries: torch.Tensor  # [rows * per_request, d]
    per_request: int  # entries per request = max_context // ratio

    def write_entries(self, entry: torch.Tensor, plan: ForwardPlan, ratio: int) -> None:
        """Rows closing a block (``(p+1) % ratio == 0``) store entry ``(p+1)//ratio - 1``;
        ``entry`` [K, d] holds one entry per row of ``plan``, the others go to slot 0."""
        def make() -> torch.Tensor:
            b = plan.batch
            closes = (b.positions + 1) % ratio == 0
            slot = b.req_index * self.per_request + (b.positions + 1) // ratio - 1
            return slot * closes  # slot 0 for rows closing no block
        slot = plan.memo(("entry_write", self.per_request, ratio), make)
        self.entries.index_copy_(0, slot, entry)

    def _by_request(self) -> torch.Tensor:
        return self.entries.view(-1, self.per_request, self.entries.shape[-1])

    def select_entries(self, plan: ForwardPlan, idx: torch.Tensor) -> torch.Tensor:
        """Entries ``idx`` [T, k] of each row's request: [T, k, d] (one gather)."""
        return self._by_request()[plan.batch.req_index.unsqueeze(1), idx]

    def request_entries(self, plan: ForwardPlan) -> torch.Tensor:
        """All entry slots of each row's request: [T, per_request, d]."""
        return self._by_request()[plan.batch.req_index]


@dataclass
class LayerCache:
    swa: Ring  # [rows * swa_ring, head_dim]; every layer has one, ratio 0 included
    compressed: CompressedCache | None  # ratio 4 / 128 only
    index: CompressedCache | None  # the lightning indexer's keys, ratio 4 only


@dataclass(frozen=True)
class CompressedShape:
    raw_ring: int  # positions per request of the raw ring: coff*ratio + N - 1
    raw_width: int  # 2 * coff * dim: pooled values, then gate scores
    per_request: int  # entries per request: max_context // ratio, at least 1
    dim: int

    @property
    def elements(self) -> int:
        """Elements per request row."""
        return self.raw_ring * self.raw_width + self.per_request * self.dim


@dataclass(frozen=True)
class LayerShape:
    """Sizes of one layer's cache; ``KVPool`` allocates exactly these."""

    swa_ring: int  # window + N - 1
    head_dim: int
    compressed: CompressedShape | None  # ratio 4 / 128 only
    index: CompressedShape | None  # ratio 4 only

    @classmethod
    def of(cls, cfg: CacheDims, layout: PoolLayout, ratio: int) -> "LayerShape":
        n = layout.verify_width

        def compressed(dim: int) -> CompressedShape:
            coff = 2 if ratio == 4 else 1  # C4 entries overlap the previous block
            # >= 1 entry per request: slot 0 is the sink of rows closing no block
            return CompressedShape(coff * ratio + n - 1, 2 * coff * dim,
                                   max(1, layout.max_context // ratio), dim)

        return cls(cfg.sliding_window + n - 1, cfg.head_dim,
                   compressed(cfg.head_dim) if ratio else None,
                   compressed(cfg.index_head_dim) if ratio == 4 else None)

    @property
    def elements(self) -> int:
        """Elements per request row."""
        return self.swa_ring * self.head_dim + sum(
            c.elements for c in (self.compressed, self.index) if c is not None)


def pool_nbytes(cfg: CacheDims, layout: PoolLayout, ratios: list[int],
                dtype: torch.dtype) -> int:
    """Bytes a ``KVPool`` of this layout takes, computed before allocating anything;
    equals ``KVPool.nbytes()`` of the built pool."""
    elements = sum(LayerShape.of(cfg, layout, r).elements for r in ratios)
    return layout.rows * elements * dtype.itemsize


def physical_memory_bytes() -> int | None:
    """This machine's physical RAM, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def device_memory_bytes(device: torch.device | str) -> int | None:
    """Memory a pool may take on ``device``: the host's physical RAM on CPU, the free
    memory on a CUDA or NPU device; None where it is unknown (e.g. ``meta``)."""
    device = torch.device(device)
    if device.type == "cpu":
        return physical_memory_bytes()
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "npu":  # torch_npu is imported by whoever put tensors there
        return torch.npu.mem_get_info(device)[0]
    return None


def check_counts(what: str, **counts: object) -> None:
    """Each of ``counts`` an int of at least 1 (a bool is not); else a CapacityError
    naming ``what`` and the count."""
    for key, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CapacityError(f"{what} {key} must be an int of at least 1, got {value!r}")


def _check_layout(cfg: CacheDims, layout: PoolLayout) -> None:
    check_counts("pool", max_requests=layout.max_requests, max_context=layout.max_context,
                 verify_width=layout.verify_width)
    if layout.max_context > cfg.max_position_embeddings:
        raise CapacityError(
            f"max_context {layout.max_context} exceeds the model's "
            f"max_position_embeddings {cfg.max_position_embeddings}")


class KVPool:
    """All KV storage of one model, plus the host-side request-row allocator."""

    def __init__(self, cfg: CacheDims, layout: PoolLayout, ratios: list[int],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        _check_layout(cfg, layout)
        need, have = pool_nbytes(cfg, layout, ratios, dtype), device_memory_bytes(device)
        if have is not None and need > have:
            where = "physical" if torch.device(device).type == "cpu" else "free device"
            raise CapacityError(
                f"the KV pool of max_requests {layout.max_requests} x max_context "
                f"{layout.max_context} (verify width {layout.verify_width}, {len(ratios)} "
                f"layers, {dtype}) needs {need / 2**30:.1f} GiB, more than the "
                f"{have / 2**30:.1f} GiB of {where} memory on {device}")
        self.layout = layout
        rows = layout.rows

        def ring(size: int, width: int) -> Ring:
            return Ring(torch.zeros(rows * size, width, device=device, dtype=dtype), size)

        def compressed(shape: CompressedShape | None) -> CompressedCache | None:
            if shape is None:
                return None
            entries = torch.zeros(rows * shape.per_request, shape.dim, device=device, dtype=dtype)
            return CompressedCache(ring(shape.raw_ring, shape.raw_width), entries,
                                   shape.per_request)

        shapes = [LayerShape.of(cfg, layout, r) for r in ratios]
        self.layers = [LayerCache(ring(s.swa_ring, s.head_dim), compressed(s.compressed),
                                  compressed(s.index)) for s in shapes]
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
