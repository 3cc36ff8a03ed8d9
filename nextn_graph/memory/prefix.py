"""The prefix cache: a radix tree over page-aligned token blocks.

A node is one block of ``page_size`` prompt tokens and the page that holds that block's
compressed entries. A path from the root spells a cached prefix in whole pages. The tree
holds one page reference per node (``PagePool``), so a prefix outlives the request that
computed it. A request that reuses a prefix locks its path, which keeps it from
eviction until the request unlocks it; admission locks its match before it evicts for
the rest of its pages, or the eviction could drop the match itself. Eviction frees unlocked leaves, least recently
used first, until enough pages are back in the pool.

A hit needs more than the pages: the SWA window before the match's end and C4's
overlapping block of raw compressor state, per layer. The engine keeps them in a
*snapshot* per node (``Ring.snapshots``, ids ``KVPool.snapshot_ids``), written by the
prefill that computed the block; the tree hands the ids out (``take_snapshot``), owns
them while a node holds one, and frees them with the node.
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
    snap: int = 0  # the snapshot of the state at the block's end (0: none)


@dataclass(frozen=True)
class PrefixMatch:
    """A cached prefix: ``pages`` in order, covering the first ``tokens`` positions."""

    pages: tuple[int, ...]
    tokens: int
    node: _Node  # the deepest matched node (the root for a miss)

    @property
    def snap(self) -> int:
        """The snapshot of the state at the match's end (0 for a miss)."""
        return self.node.snap


@dataclass
class PrefixStats:
    asked_tokens: int = 0  # prompt tokens looked up
    hit_tokens: int = 0  # of those, found cached

    def record(self, asked: int, hit: int) -> None:
        self.asked_tokens += asked
        self.hit_tokens += hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.asked_tokens if self.asked_tokens else 0.0


class PrefixCache:
    """``snapshots``: the ids ``take_snapshot`` hands out (none: a tree of pages alone,
    whose nodes hold no snapshot)."""

    def __init__(self, pages: PagePool, snapshots: Sequence[int] = ()):
        self.pool, self.page_size = pages, pages.page_size
        self._root = _Node((), 0, None)
        self._clock = 0
        self._nodes = 0
        self.stats = PrefixStats()
        self.snapshots = tuple(snapshots)
        self._free_snaps = list(reversed(self.snapshots))  # popped from the end

    @property
    def free_snapshots(self) -> int:
        return len(self._free_snaps)

    def take_snapshot(self) -> int:
        """A free snapshot, evicting the least recently used unlocked leaf if none is
        free -> its id, or 0 when every snapshot is held (by locked paths or pending
        inserts)."""
        if not self._free_snaps:
            self.evict(0, snapshots=1)
        return self._free_snaps.pop() if self._free_snaps else 0

    def give_back(self, snaps: Sequence[int]) -> None:
        """Snapshots taken but not inserted (a failed or duplicate prefill)."""
        for s in snaps:
            if s not in self.snapshots or s in self._free_snaps:
                raise CapacityError(f"prefix cache: snapshot {s} was not taken")
            self._free_snaps.append(s)

    @property
    def cached_pages(self) -> int:
        return self._nodes

    def _blocks(self, tokens: Sequence[int], limit: int) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i:i + ps]) for i in range(0, limit - ps + 1, ps)]

    def match(self, tokens: Sequence[int], limit: int | None = None,
              count: bool = True) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` in whole blocks, of at most ``limit``
        positions (a prefill must still compute its last prompt token: callers pass
        ``len(prompt) - 1``). Counted in ``stats`` unless ``count`` is False (a caller
        that may ask again counts what it used, ``stats.record``); the path's use time is
        refreshed."""
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
        if count:
            self.stats.record(len(tokens), len(pages) * self.page_size)
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

    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               snaps: Sequence[int] | None = None) -> int:
        """Cache the whole blocks of ``tokens``, block i in ``pages[i]`` (a request's
        pages, computed) and its end's state in snapshot ``snaps[i]`` (taken with
        ``take_snapshot``; 0: none, which ends the insert there) -> blocks added. A block
        already cached keeps its page and snapshot: the request's page stays the
        request's to release, its snapshot goes back to the free list, as do those
        of blocks past where the insert ended. A new block's page gets one more holder,
        the tree."""
        blocks = self._blocks(tokens, len(tokens))
        snaps = [0] * len(blocks) if snaps is None else list(snaps)
        if len(pages) < len(blocks) or len(snaps) < len(blocks):
            raise CapacityError(f"prefix cache: {len(blocks)} blocks of tokens but "
                                f"{len(pages)} pages and {len(snaps)} snapshots")
        self._clock += 1
        node, added, unused = self._root, 0, []
        for i, (block, page) in enumerate(zip(blocks, pages)):
            child = node.children.get(block)
            if child is None:
                if self.snapshots and not snaps[i]:  # no state kept: nothing deeper
                    unused += [s for s in snaps[i:] if s]
                    break
                self.pool.share([page])
                child = node.children[block] = _Node(block, page, node, snap=snaps[i])
                self._nodes += 1
                added += 1
            elif snaps[i]:
                unused.append(snaps[i])
            node = child
            node.last_use = self._clock
        self.give_back(unused + [s for s in snaps[len(blocks):] if s])
        return added

    def evict(self, pages: int, snapshots: int = 0) -> int:
        """Drop unlocked leaves, least recently used first, until ``pages`` pages went
        back to the pool and ``snapshots`` snapshots to the free list (or nothing is
        left to drop) -> pages freed. A dropped node whose page a running request still
        holds frees nothing yet: that page goes back when the request releases it."""
        heap = [(n.last_use, id(n), n) for n in self._leaves() if n.locks == 0]
        heapq.heapify(heap)
        freed = snaps = 0
        while heap and (freed < pages or snaps < snapshots):
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.block]
            self._nodes -= 1
            freed += self.pool.release([node.page])
            if node.snap:
                self._free_snaps.append(node.snap)
                snaps += 1
            if parent is not self._root and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        return freed

    def _leaves(self) -> list[_Node]:
        return [n for n in self._nodes_list() if not n.children]

    def _nodes_list(self) -> list[_Node]:
        out, todo = [], list(self._root.children.values())
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(node.children.values())
        return out

    def holdings(self) -> dict[str, list[int]]:
        """The tree's page references, for ``PagePool.audit``."""
        return {"prefix cache": [n.page for n in self._nodes_list()]}

    def audit(self, taken: Sequence[int] = (), matches: Sequence[PrefixMatch] = ()) -> None:
        """Snapshots: the free ones, the nodes' and ``taken`` (held by prefills not
        yet inserted) split ``snapshots`` exactly; locks: each node's count is the
        ``matches`` (of the requests reading the tree) through it (tests and debugging)."""
        nodes = self._nodes_list()
        held = [n.snap for n in nodes if n.snap] + list(taken)
        every = sorted(held + self._free_snaps)
        if every != sorted(self.snapshots):
            raise AssertionError(f"prefix cache snapshots disagree: {len(self._free_snaps)} "
                                 f"free, {len(held)} held, of {len(self.snapshots)}")
        want: dict[int, int] = {}
        for m in matches:
            node = m.node
            while node is not self._root:
                want[id(node)] = want.get(id(node), 0) + 1
                node = node.parent
        wrong = [n for n in nodes if n.locks != want.get(id(n), 0)]
        if wrong or len(want) > sum(1 for n in nodes if n.locks):
            raise AssertionError(f"prefix cache locks disagree on {len(wrong)} nodes: "
                                 f"{len(matches)} requests read the tree")

    @property
    def locked(self) -> int:
        """Nodes some request has locked (0 when no request reads the tree)."""
        return sum(1 for n in self._nodes_list() if n.locks)
