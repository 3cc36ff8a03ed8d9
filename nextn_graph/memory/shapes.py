"""Sizes of the KV pools, known before anything is allocated: a pool's layout (rows,
context, pages), each layer's shapes per request row (rings) and per page (entries), the
bytes they take, and the memory a device has for them (``KVPool`` checks one against the
other)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from ..labels import KV_CACHE
from .pages import PAGE_SIZE, pages_for

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
    page_size: int = PAGE_SIZE  # positions of a page of compressed entries
    num_pages: int = 0  # pages of the pool; 0: every request can reach max_context
    snapshots: int = 0  # page-boundary states the prefix cache keeps (ids 1..snapshots)

    @property
    def rows(self) -> int:
        return self.max_requests + 1

    @property
    def pages_per_request(self) -> int:
        """Page-table columns: the pages of a request at max_context."""
        return pages_for(self.max_context, self.page_size)

    @property
    def pages(self) -> int:
        """Usable pages (page 0, the sink, is one more)."""
        return self.num_pages or self.max_requests * self.pages_per_request

@dataclass(frozen=True)
class CompressedShape:
    raw_ring: int  # positions per request of the raw ring: coff*ratio + N - 1
    raw_width: int  # 2 * coff * dim: pooled values, then gate scores
    per_request: int  # entries a request can finish: max_context // ratio, at least 1
    per_page: int  # entries of one page: page_size // ratio
    dim: int
    carry: int  # raw positions before a block start that its entry reads: (coff - 1) * ratio

    @property
    def row_elements(self) -> int:
        """Elements per request row (the raw ring)."""
        return self.raw_ring * self.raw_width

    @property
    def page_elements(self) -> int:
        """Elements per page (the entries)."""
        return self.per_page * self.dim


@dataclass(frozen=True)
class LayerShape:
    """Sizes of one layer's cache; ``KVPool`` allocates exactly these."""

    swa_ring: int  # window + N - 1
    swa_carry: int  # positions before a page boundary that positions past it read: window
    head_dim: int
    compressed: CompressedShape | None  # ratio 4 / 128 only
    index: CompressedShape | None  # ratio 4 only

    @classmethod
    def of(cls, cfg: CacheDims, layout: PoolLayout, ratio: int) -> "LayerShape":
        n = layout.verify_width

        def compressed(dim: int) -> CompressedShape:
            coff = 2 if ratio == 4 else 1  # C4 entries overlap the previous block
            return CompressedShape(coff * ratio + n - 1, 2 * coff * dim,
                                   max(1, layout.max_context // ratio),
                                   layout.page_size // ratio, dim, (coff - 1) * ratio)

        return cls(cfg.sliding_window + n - 1, cfg.sliding_window, cfg.head_dim,
                   compressed(cfg.head_dim) if ratio else None,
                   compressed(cfg.index_head_dim) if ratio == 4 else None)

    @property
    def parts(self) -> tuple[CompressedShape, ...]:
        return tuple(c for c in (self.compressed, self.index) if c is not None)

    @property
    def row_elements(self) -> int:
        """Elements per request row: the SWA ring and the raw rings."""
        return self.swa_ring * self.head_dim + sum(c.row_elements for c in self.parts)

    @property
    def page_elements(self) -> int:
        """Elements per page: the compressed entries and the indexer's keys."""
        return sum(c.page_elements for c in self.parts)

    @property
    def snapshot_elements(self) -> int:
        """Elements per prefix-cache snapshot: each ring's ``carry`` positions."""
        return self.swa_carry * self.head_dim + sum(c.carry * c.raw_width for c in self.parts)


def pool_nbytes(cfg: CacheDims, layout: PoolLayout, ratios: list[int],
                dtype: torch.dtype) -> int:
    """Bytes a ``KVPool`` of this layout takes, computed before allocating anything;
    equals ``KVPool.nbytes()`` of the built pool: request rows (rings), pages (entries)
    and the page table (int32) where any layer has compressed entries."""
    shapes = [LayerShape.of(cfg, layout, r) for r in ratios]
    rows = layout.rows * sum(s.row_elements for s in shapes)
    if layout.snapshots:  # snapshot 0 is the sink of positions no snapshot keeps
        rows += (layout.snapshots + 1) * sum(s.snapshot_elements for s in shapes)
    pages = (layout.pages + 1) * sum(s.page_elements for s in shapes)
    table = layout.rows * layout.pages_per_request * 4 if any(s.parts for s in shapes) else 0
    return (rows + pages) * dtype.itemsize + table

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
