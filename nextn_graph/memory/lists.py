"""Index lists: which pool rows each row of a forward reads, as fixed-size lists with a
valid count (the interface of the sparse kernels, ``kernels/attention.py``,
``kernels/compress.py``, ``kernels/indexer.py``); compressed entries are listed through
the pool's page table (``CompressedCache.rows``).

A list entry is a row of one of two sources: ``v >= 0`` is row ``v`` of the pool tensor,
``v < 0`` row ``-1 - v`` of this forward's own rows (positions at or after the request's
``cache_start`` are not in the pool yet: the forward writes them after it reads). Entries
past a row's count are well-formed (in range) but never read. Everything depends on the
batch and a static size only, so a forward builds each list once (``ForwardPlan.memo``) and
every layer reuses it; the kernels' loops stop at the counts, so their work follows each
request's length, not ``max_context``. Entries are int32: a pool tensor of 2**31 rows or
more (hundreds of GB) cannot be listed.
"""

from __future__ import annotations

import torch

from ..errors import CapacityError
from ..labels import KV_CACHE
from .batch import ForwardBatch, ForwardPlan
from .pool import CompressedCache
from .rings import Ring

profile_label = KV_CACHE  # the work profile's label of this file's code (labels.py)

INT32_ROWS = 2 ** 31  # list entries are int32 rows


def _check_rows(rows: int, what: str) -> None:
    """A pool whose rows an int32 list cannot name is refused (shapes only: no sync)."""
    if rows >= INT32_ROWS:
        raise CapacityError(f"{what} has {rows} rows; the sparse kernels' int32 index lists "
                            f"name at most {INT32_ROWS - 1} (use fewer max_requests or a "
                            f"shorter max_context)")


def window_list(plan: ForwardPlan, ring: Ring, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sliding window of each row, oldest first: -> (idx [T, window] int32, count [T]
    int32). Row t at position p reads the ``count = min(window, p + 1)`` positions
    ``p - count + 1 .. p``: from ``ring`` before the request's ``cache_start``, else from
    the forward's rows."""
    _check_rows(ring.data.shape[0], "the SWA ring")

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        b = plan.batch
        p = b.positions.unsqueeze(1)  # [T, 1]
        count = torch.clamp(p + 1, max=window)  # [T, 1]
        j = torch.arange(window, device=p.device)  # [W]
        pos = torch.minimum(p - count + 1 + j, p)  # [T, W]; past the count: p (unread)
        slot = b.req_index.unsqueeze(1) * ring.size + pos % ring.size
        own = plan.row_index().unsqueeze(1) + (pos - p)  # the forward's row of each position
        idx = torch.where(pos < b.cache_start.unsqueeze(1), slot, -1 - own)
        return idx.to(torch.int32), count.squeeze(1).to(torch.int32)
    return plan.memo(("window_list", ring.size, window), make)


def candidate_list(plan: ForwardPlan, ring: Ring, span: int) -> torch.Tensor:
    """The ``span`` positions ending at each row's own (a compressor's candidates), oldest
    first: -> idx [K, span] int32 (positions < 0 hold a valid row; the kernel masks them
    by position)."""
    def make() -> torch.Tensor:
        ri = ring.index(plan, span)
        return torch.where(ri.from_ring.squeeze(-1), ri.slot, -1 - ri.chunk_row).to(torch.int32)
    return plan.memo(("candidate_list", ring.size, span), make)


def finished_count(plan: ForwardPlan, ratio: int, n: int) -> torch.Tensor:
    """[T] int32: finished entries of each row's request, ``min((p + 1) // ratio, n)``."""
    return plan.memo(("finished_count", ratio, n), lambda: torch.clamp(
        (plan.batch.positions + 1) // ratio, max=n).to(torch.int32))


def flat_pages(plan: ForwardPlan) -> torch.Tensor:
    """[T, 1] int32: one page, 0, for every row: the page table of a flat entry tensor
    (one sequence's, nothing cached), read with ``per_page`` its length."""
    return plan.memo("flat_pages", lambda: torch.zeros(
        plan.batch.num_rows, 1, dtype=torch.int32, device=plan.batch.positions.device))


def entry_list(plan: ForwardPlan, cache: CompressedCache | None, n: int,
               ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finished entry of each row's request, in entry order (C128 attention):
    -> (rows [T, n] int32, count [T] int32), through the pool's page table (``cache``),
    or of a flat tensor of ``n`` entries (None)."""
    def make() -> torch.Tensor:
        if cache is not None:
            return cache.rows(plan).to(torch.int32)
        j = torch.arange(n, device=plan.batch.positions.device)  # [E]
        return j.expand(plan.batch.num_rows, n).to(torch.int32)
    return plan.memo(("entry_list", n), make), finished_count(plan, ratio, n)


def sequence_plan(length: int, device: torch.device | str) -> ForwardPlan:
    """The plan of one whole sequence with nothing cached (the no-cache path): positions
    ``0 .. length - 1`` of request row 0, every list entry one of its own rows."""
    pos = torch.arange(length, device=device)
    zeros = torch.zeros_like(pos)
    return ForwardPlan(ForwardBatch(pos, pos, zeros, zeros, torch.full_like(pos, length),
                                    num_chunks=1))
