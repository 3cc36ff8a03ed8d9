"""The prefix cache: a radix tree over page-aligned token blocks.

A node is one block of ``page_size`` prompt tokens and the page that holds that block's
compressed entries. A path from the root spells a cached prefix in whole pages. The tree
holds one page reference per node (``PagePool``), so a prefix outlives the request that
computed it. A request that reuses a prefix locks its path, which keeps it from
eviction until the request unlocks it; admission locks its match before it evicts for
the rest of its pages, or the eviction could drop the match itself. Eviction frees unlocked leaves, least recently
used first, until enough pages are back in the pool.

What a hit may reuse beyond the pages (the SWA window before the match's end, the
compressor state at the boundary, the draft's KV, whose entry at position i was computed
from token i + 1) is the engine's to recompute; the tree only matches whole blocks.
Host only.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import CapacityError
from ..labels import KV_CACHE
from .pages import PagePool

profile_label = KV_CACHE  # the work profile's label of this file's code (labels.py)


@dataclass(eq=False)
class _Node:
    block: tuple[int, ...]  # page_size tokens; () at the root
    page: int  # the block's page; 0 at the root
    parent: "_Node | None"
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    locks: int = 0  # requests reading this node's page now
    last_use: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """A cached prefix: ``pages`` in order, covering the first ``tokens`` positions."""

    pages: tuple[int, ...]
    tokens: int
    node: _Node  # the deepest matched node (the root for a miss)


@dataclass
class PrefixStats:
    asked_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found cached

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.asked_tokens if self.asked_tokens else 0.0


class PrefixCache:
    def __init__(self, pages: PagePool):
        self.pool, self.page_size = pages, pages.page_size
        self._root = _Node((), 0, None)
        self._clock = 0
        self._nodes = 0
        self.stats = PrefixStats()

    @property
    def cached_pages(self) -> int:
        return self._nodes

    def _blocks(self, tokens: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i:i + ps]) for i in range(0, limit - ps + 1, ps)]

    def match(self, tokens: Sequence[int], limit: int | None = None) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` in whole blocks, of at most ``limit``
        positions (a prefill must still compute its last prompt token: callers pass
        ``len(prompt) - 1``). Counted in ``stats``; the path's use time is refreshed."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        self._clock += 1
        node, pages = self._root, []
        for block in self._blocks(tokens, limit):
            child = node.children.get(block)
            if child is None:
                break
            node = child
            node.last_use = self._clock
            pages.append(node.page)
        self.stats.asked_tokens += len(tokens)
        self.stats.hit_tokens += len(pages) * self.page_size
        return PrefixMatch(tuple(pages), len(pages) * self.page_size, node)

    def lock(self, m: PrefixMatch) -> None:
        """Keep ``m``'s path from eviction (a request reads its pages)."""
        node = m.node
        while node is not self._root:
            node.locks += 1
            node = node.parent

    def unlock(self, m: PrefixMatch) -> None:
        node = m.node
        if node is not self._root and node.locks < 1:
            raise CapacityError("prefix cache: unlock of a prefix that is not locked")
        while node is not self._root:
            node.locks -= 1
            node = node.parent

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the whole blocks of ``tokens``, block i in ``pages[i]`` (a request's
        pages, computed) -> blocks added. A block already cached keeps its page: the
        request's copy stays the request's to release. A new block's page gets one more
        holder, the tree."""
        blocks = self._blocks(tokens, len(tokens))
        if len(pages) < len(blocks):
            raise CapacityError(f"prefix cache: {len(blocks)} blocks of tokens but "
                                f"{len(pages)} pages")
        self._clock += 1
        node, added = self._root, 0
        for block, page in zip(blocks, pages):
            child = node.children.get(block)
            if child is None:
                self.pool.share([page])
                child = node.children[block] = _Node(block, page, node)
                self._nodes += 1
                added += 1
            node = child
            node.last_use = self._clock
        return added

    def evict(self, pages: int) -> int:
        """Drop unlocked leaves, least recently used first, until ``pages`` pages went
        back to the pool (or nothing is left to drop) -> pages freed. A dropped node whose
        page a running request still holds frees nothing yet: that page goes back when
        the request releases it."""
        heap = [(n.last_use, id(n), n) for n in self._leaves() if n.locks == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.block]
            self._nodes -= 1
            freed += self.pool.release([node.page])
            if parent is not self._root and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def _leaves(self) -> list[_Node]:
        out, todo = [], list(self._root.children.values())
        while todo:
            node = todo.pop()
            if node.children:
                todo.extend(node.children.values())
            else:
                out.append(node)
        return out

    def holdings(self) -> dict[str, list[int]]:
        """The tree's page references, for ``PagePool.audit``."""
        pages, todo = [], list(self._root.children.values())
        while todo:
            node = todo.pop()
            pages.append(node.page)
            todo.extend(node.children.values())
        return {"prefix cache": pages}
