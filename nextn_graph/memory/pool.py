"""Token-to-KV pools: per-layer SWA rings, compressor rings, paged compressed entries.

Layout. Every request owns one *request row* ``r`` (``1..max_requests``) and the *pages*
its positions reach (``page_size`` positions each, ids from ``pages.PagePool``); row 0
and page 0 are reserved for padding and for writes that must land nowhere. The rings
are window-bounded, so they stay per row; the compressed entries grow with the context,
so they live in pages, addressed through the page table ``table[r]`` (the request's page
ids in position order, 0 past them). Request ``r`` at position ``p`` lives at

- SWA ring:             ``r * swa_ring + p % swa_ring``   (swa_ring >= window + N - 1)
- compressor raw ring:  ``r * raw_ring + p % raw_ring``   (raw_ring >= coff*ratio + N - 1)
- compressed entry j:   ``table[r, j // E] * E + j % E``  (E = page_size // ratio)

N is the largest verify window. The ring slack ``N - 1`` is what makes commit by
length work: positions written by a rejected speculation are overwritten by the
next round before anything valid reads them, and they never clobber a position
the next round still needs. The NextN draft gets its own SWA-only pool (no pages)
with the same request numbering as the target.

The table is a pool tensor like the KV itself: graphs read it in place, and ``alloc``
writes a request's row before its prefill, so no graph input moves. Sizes come from
``shapes.py``: ``pool_nbytes`` gives a pool's bytes before anything is allocated, and
``KVPool`` refuses a pool larger than its device's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

import torch

from ..errors import CapacityError
from ..kernels.indexer import key_rows
from ..labels import KV_CACHE, PAGE_TABLE, labelled
from .batch import ForwardPlan
from .pages import PagePool, check_counts, pages_for
from .rings import Ring
from .shapes import (CacheDims, CompressedShape, LayerShape, PoolLayout, device_memory_bytes,
                     pool_nbytes)

profile_label = KV_CACHE  # the work profile's label of this file's code (labels.py)


@dataclass
class CompressedCache:
    """A compressor's state for one layer: raw per-position ring and finished entries,
    the entries in pages. Entry j of request row r is row ``table[r, j // per_page] *
    per_page + j % per_page`` of ``entries`` (``table``: the pool's page table, one for
    every layer; page 0 is the sink of writes that land nowhere)."""

    raw: Ring  # [rows * raw_ring, 2 * coff * d]: pooled values, then gate scores (+ape)
    entries: torch.Tensor  # [(num_pages + 1) * per_page, d]
    per_request: int  # entries a request can finish: max_context // ratio, at least 1
    per_page: int  # entries of one page: page_size // ratio
    table: torch.Tensor  # [rows, pages_per_request] int32: the pool's page table

    @labelled(PAGE_TABLE)
    def pages(self, plan: ForwardPlan) -> torch.Tensor:
        """[T, P] int32: the page ids of each row's request (one gather per forward)."""
        return plan.memo("request_pages", lambda: self.table[plan.batch.req_index])

    @labelled(PAGE_TABLE)
    def rows(self, plan: ForwardPlan) -> torch.Tensor:
        """[T, per_request] int64: the ``entries`` row of each entry slot of each row's
        request (once per forward and entry size)."""
        return plan.memo(("entry_rows", self.per_page, self.per_request), lambda: key_rows(
            self.pages(plan), self.per_page, torch.arange(
                self.per_request, device=self.table.device).expand(plan.batch.num_rows, -1)))

    def write_entries(self, entry: torch.Tensor, plan: ForwardPlan, ratio: int) -> None:
        """Rows closing a block (``(p+1) % ratio == 0``) store entry ``(p+1)//ratio - 1``;
        ``entry`` [K, d] holds one entry per row of ``plan``, the others go to slot 0."""
        slot = plan.memo(("entry_write", self.per_page, ratio),
                         lambda: self._write_slots(plan, ratio))
        self.entries.index_copy_(0, slot, entry)

    @labelled(PAGE_TABLE)
    def _write_slots(self, plan: ForwardPlan, ratio: int) -> torch.Tensor:
        """[K] the ``entries`` row each row of ``plan`` writes (0: it closes no block)."""
        b = plan.batch
        closes = (b.positions + 1) % ratio == 0
        j = ((b.positions + 1) // ratio - 1).clamp(min=0)  # [K]
        page = self.table[b.req_index, (j // self.per_page).clamp(
            max=self.table.shape[1] - 1)].long()
        return (page * self.per_page + j % self.per_page) * closes  # slot 0: no block

    def select_entries(self, plan: ForwardPlan, idx: torch.Tensor) -> torch.Tensor:
        """Entries ``idx`` [T, k] of each row's request: [T, k, d] (one gather)."""
        return self.entries[self.rows(plan).gather(1, idx)]

    def request_entries(self, plan: ForwardPlan) -> torch.Tensor:
        """All entry slots of each row's request: [T, per_request, d]."""
        return self.entries[self.rows(plan)]


@dataclass
class LayerCache:
    swa: Ring  # [rows * swa_ring, head_dim]; every layer has one, ratio 0 included
    compressed: CompressedCache | None  # ratio 4 / 128 only
    index: CompressedCache | None  # the lightning indexer's keys, ratio 4 only

def _check_layout(cfg: CacheDims, layout: PoolLayout, ratios: list[int]) -> None:
    check_counts("pool", max_requests=layout.max_requests, max_context=layout.max_context,
                 verify_width=layout.verify_width, page_size=layout.page_size)
    if layout.max_context > cfg.max_position_embeddings:
        raise CapacityError(
            f"max_context {layout.max_context} exceeds the model's "
            f"max_position_embeddings {cfg.max_position_embeddings}")
    if not isinstance(layout.num_pages, int) or isinstance(layout.num_pages, bool) or \
            layout.num_pages < 0:
        raise CapacityError(f"pool num_pages must be an int of at least 0 (0: enough for "
                            f"every request at max_context), got {layout.num_pages!r}")
    if layout.snapshots and cfg.sliding_window > layout.page_size:
        raise CapacityError(f"pool page_size {layout.page_size} is shorter than the sliding "
                            f"window {cfg.sliding_window}: a prefix-cache boundary keeps one "
                            f"window, which must fit in a page")
    for r in sorted({r for r in ratios if r}):
        if layout.page_size % r:
            raise CapacityError(f"pool page_size {layout.page_size} is not a multiple of the "
                                f"compress ratio {r}: a page must hold whole entries")


class KVPool:
    """All KV storage of one model, plus the host-side allocator of request rows and
    pages. A request holds one row (its rings) and the pages its positions reach (its
    compressed entries); ``alloc`` takes both or neither."""

    def __init__(self, cfg: CacheDims, layout: PoolLayout, ratios: list[int],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        _check_layout(cfg, layout, ratios)
        need, have = pool_nbytes(cfg, layout, ratios, dtype), device_memory_bytes(device)
        if have is not None and need > have:
            where = "physical" if torch.device(device).type == "cpu" else "free device"
            raise CapacityError(
                f"the KV pool of max_requests {layout.max_requests} x max_context "
                f"{layout.max_context} ({layout.pages} pages of {layout.page_size}, verify "
                f"width {layout.verify_width}, {len(ratios)} layers, {dtype}) needs "
                f"{need / 2**30:.1f} GiB, more than the {have / 2**30:.1f} GiB of {where} "
                f"memory on {device}")
        self.layout = layout
        rows = layout.rows
        shapes = [LayerShape.of(cfg, layout, r) for r in ratios]
        paged = any(s.parts for s in shapes)
        # [rows, P] int32: each request row's page ids, 0 (the sink) past its pages
        self.table = torch.zeros(rows, layout.pages_per_request if paged else 0,
                                 dtype=torch.int32, device=device)
        self.pages = PagePool(layout.pages, layout.page_size) if paged else None

        def ring(size: int, width: int, carry: int) -> Ring:
            snaps = None if not (layout.snapshots and carry) else torch.zeros(
                (layout.snapshots + 1) * carry, width, device=device, dtype=dtype)
            return Ring(torch.zeros(rows * size, width, device=device, dtype=dtype),
                        size, carry, layout.page_size, snaps)

        def compressed(shape: CompressedShape | None) -> CompressedCache | None:
            if shape is None:
                return None
            entries = torch.zeros((layout.pages + 1) * shape.per_page, shape.dim,
                                  device=device, dtype=dtype)
            return CompressedCache(ring(shape.raw_ring, shape.raw_width, shape.carry), entries,
                                   shape.per_request, shape.per_page, self.table)

        self.layers = [LayerCache(ring(s.swa_ring, s.head_dim, s.swa_carry),
                                  compressed(s.compressed), compressed(s.index)) for s in shapes]
        self._free = list(range(layout.max_requests, 0, -1))  # row 0 is never handed out
        self.held: dict[int, list[int]] = {}  # request row -> its pages, in position order

    @property
    def free_rows(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> int | None:
        """Pages free; None where the pool has no pages (no compressed layer)."""
        return None if self.pages is None else self.pages.free_pages

    @property
    def max_positions(self) -> int:
        """The positions one request can hold: every page of the pool, or max_context."""
        if self.pages is None:
            return self.layout.max_context
        return min(self.layout.max_context, self.pages.num_pages * self.layout.page_size)

    def pages_needed(self, positions: int) -> int:
        """Pages a request whose writes reach ``positions`` positions holds."""
        if self.pages is None:
            return 0
        return pages_for(min(max(positions, 1), self.layout.max_context), self.layout.page_size)

    def fits(self, positions: int, shared: int = 0) -> bool:
        """A free row, and pages for ``positions`` of which ``shared`` are cached already
        (``alloc`` would succeed)."""
        return bool(self._free) and (self.pages is None or
                                     self.pages_needed(positions) - shared <= self.pages.free_pages)

    def alloc(self, positions: int | None = None, shared: Sequence[int] = ()) -> int:
        """A request row with the pages of ``positions`` positions (None: max_context),
        its page-table row written; all or nothing. ``shared``: the first pages are these
        (a prefix-cache hit's, one more holder each), the rest fresh."""
        if not self._free:
            raise CapacityError(f"KV pool is full: all {self.layout.max_requests} request rows in use")
        pages: list[int] = []
        if self.pages is not None:
            need = self.pages_needed(self.layout.max_context if positions is None else positions)
            if len(shared) > need:
                raise CapacityError(f"{len(shared)} shared pages exceed the {need} pages of "
                                    f"{positions} positions")
            self.pages.share(shared)
            try:
                pages = list(shared) + self.pages.alloc(need - len(shared))
            except CapacityError:
                self.pages.release(shared)
                raise
        row = self._free.pop()
        try:  # a device fault hands the row and pages back: all or nothing
            self.write_table(row, pages)
        except BaseException:
            self._free.append(row)
            if pages:
                self.pages.release(pages)
            raise
        self.held[row] = pages
        return row

    def grow(self, row: int, n: int) -> None:
        """``n`` more pages for request row ``row``, after its own (all or nothing)."""
        if row not in self.held:
            raise CapacityError(f"request row {row} is not allocated")
        if len(self.held[row]) + n > self.layout.pages_per_request:
            raise CapacityError(f"{len(self.held[row]) + n} pages exceed a request's "
                                f"{self.layout.pages_per_request}")
        more = self.pages.alloc(n)
        # All or nothing under a device fault too. The table row past the held pages is
        # then stale: the caller fails the request, and its release frees the row.
        try:
            self.write_table(row, self.held[row] + more)
        except BaseException:
            self.pages.release(more)
            raise
        self.held[row] += more

    def write_table(self, row: int, pages: list[int]) -> None:
        """Row ``row`` of the device page table: ``pages``, then the sink (a follower rank
        writes what rank 0 allocated)."""
        if self.pages is None:
            return
        p = self.layout.pages_per_request
        if len(pages) > p:
            raise CapacityError(f"{len(pages)} pages exceed a request's {p}")
        self.table[row] = torch.tensor(pages + [0] * (p - len(pages)), dtype=torch.int32)

    def release(self, row: int) -> None:
        if not 1 <= row <= self.layout.max_requests or row in self._free:
            raise CapacityError(f"request row {row} is not allocated")
        pages = self.held.pop(row, [])
        if self.pages is not None and pages:
            self.pages.release(pages)
        self._free.append(row)

    def audit(self, others: Mapping[Hashable, Iterable[int]] | None = None) -> None:
        """No page leaked or held twice, rows and pages agree (tests and debugging);
        ``others``: page holders besides the request rows (the prefix cache)."""
        rows = set(self._free)
        if len(rows) != len(self._free) or rows & set(self.held) or \
                len(rows) + len(self.held) != self.layout.max_requests:
            raise AssertionError(f"KV pool rows disagree: {len(self._free)} free, "
                                 f"{len(self.held)} held, of {self.layout.max_requests}")
        if self.pages is not None:
            self.pages.audit({**self.held, **(others or {})})

    @property
    def snapshot_ids(self) -> range:
        """The prefix cache's page-boundary states (``Ring.snapshots``; 0 is the sink)."""
        return range(1, self.layout.snapshots + 1)

    def rings(self) -> list[Ring]:
        return [r for layer in self.layers for r in (
            layer.swa, *(c.raw for c in (layer.compressed, layer.index) if c is not None))]

    def restore(self, snaps: list[int], rows: list[int], ends: list[int]) -> None:
        """Every ring's snapshot ``snaps[i]`` (its state before boundary ``ends[i]``)
        onto request row ``rows[i]`` (a prefix hit, before the row's first chunk)."""
        if not snaps:
            return
        dev = self.table.device
        s, r, e = (torch.tensor(x, device=dev) for x in (snaps, rows, ends))
        for ring in self.rings():
            ring.restore(s, r, e)

    def nbytes(self) -> int:
        total = self.table.nbytes
        for layer in self.layers:
            total += layer.swa.data.nbytes
            for c in (layer.compressed, layer.index):
                if c is not None:
                    total += c.raw.data.nbytes + c.entries.nbytes
        return total + sum(r.snapshots.nbytes for r in self.rings() if r.snapshots is not None)
