"""Pages of the compressed KV: a page is one block of ``page_size`` positions of one
request, and its id addresses that block's entries in every layer and every compressed
kind at once (at 256 positions: 64 C4 entries, 2 C128 entries, 64 indexer keys).

Pages are reference-counted: a request holds one reference on each page of its
sequence, and the prefix cache holds one on each page it keeps, so a shared prefix is
stored once and freed when its last holder lets go. Page 0 is never handed out: it is
the sink of writes that must land nowhere, as pool row 0 is.

Host only. The device side (``KVPool.table``, the page table every forward reads) holds
the ids this allocator hands out.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Iterable, Mapping

from ..errors import CapacityError
from ..labels import KV_CACHE

profile_label = KV_CACHE  # the work profile's label of this file's code (labels.py)

PAGE_SIZE = 256  # positions of a page unless configured (SGLang's for DeepSeek-V4)


def check_counts(what: str, **counts: object) -> None:
    """Each of ``counts`` an int of at least 1 (a bool is not); else a CapacityError
    naming ``what`` and the count."""
    for key, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CapacityError(f"{what} {key} must be an int of at least 1, got {value!r}")


def pages_for(positions: int, page_size: int) -> int:
    """Pages that ``positions`` positions need (a partial last page is a whole page)."""
    return -(-positions // page_size)


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        check_counts("page pool", num_pages=num_pages, page_size=page_size)
        self.num_pages, self.page_size = num_pages, page_size  # usable pages: 1..num_pages
        self._free = list(range(num_pages, 0, -1))  # popped from the end: low ids first
        self._refs: dict[int, int] = {}  # page -> holders, for pages handed out

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh pages, one reference each; all or nothing."""
        if n > len(self._free):
            raise CapacityError(f"KV pages exhausted: {n} needed, {len(self._free)} of "
                                f"{self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more holder of each of ``pages`` (all handed out already)."""
        pages = list(pages)
        self._check_held(pages, "share")
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: Iterable[int]) -> int:
        """One holder fewer of each of ``pages`` -> how many went back to the free list.
        Checked before anything changes: a bad id releases nothing."""
        pages = list(pages)
        self._check_held(pages, "release")
        want = Counter(pages)
        over = [p for p, n in want.items() if n > self._refs[p]]
        if over:
            raise CapacityError(f"KV page {over[0]} released {want[over[0]]} times, held "
                                f"{self._refs[over[0]]} times")
        freed = 0
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                del self._refs[p]
                self._free.append(p)
                freed += 1
        return freed

    def _check_held(self, pages: list[int], what: str) -> None:
        bad = [p for p in pages if p not in self._refs]
        if bad:
            raise CapacityError(f"cannot {what} KV page {bad[0]!r}: it is not allocated")

    def audit(self, holders: Mapping[Hashable, Iterable[int]]) -> None:
        """Check that every page's count equals the holders that list it, and that free and
        held pages split 1..num_pages exactly: no page leaked, none double-freed. Raises
        ``AssertionError`` naming the first difference (tests and debugging)."""
        held: Counter[int] = Counter()
        for pages in holders.values():
            held.update(pages)
        if dict(held) != self._refs:
            diff = sorted(set(held) ^ set(self._refs)) or sorted(
                p for p in held if held[p] != self._refs.get(p))
            p = diff[0]
            raise AssertionError(f"KV page {p}: counted {self._refs.get(p, 0)} holders, "
                                 f"the holders list it {held.get(p, 0)} times")
        free = set(self._free)
        if len(free) != len(self._free) or free & set(self._refs) or \
                len(free) + len(self._refs) != self.num_pages or 0 in free:
            raise AssertionError(f"KV page lists disagree: {len(self._free)} free, "
                                 f"{len(self._refs)} held, of {self.num_pages}")
