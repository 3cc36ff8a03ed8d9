"""Bytes of the ops whose work follows each request's length, not the pool's shapes.

The sparse kernels (``kernels/attention.py``, ``indexer.py``, ``compress.py``) read their
index lists only up to a per-row count held in a device tensor; on the ``meta`` device
there are no values, so the profile takes the requests' length ``L`` (positions already
in the cache, ``--context-len``) and derives every count as the kernels do:

- ``sparse_attn``: the window's ``min(W, L)`` keys, and ``min(K, L // ratio)`` compressed
  entries (the C4 top-k list holds K = index_topk, C128's every finished entry), each a
  ``d``-wide row plus its 4-byte index, per query row;
- ``index_scores``: ``min(E, L // 4)`` index keys per row read, as many fp32 scores written
  (the lightning indexer is C4's);
- ``index_topk``: those scores read once (its passes after the first hit the cache);
- ``compress_pool``: the ``span`` candidate raw rows of each of its K rows (never the ring).

``L = None`` (no ``--context-len``): every list full, the worst case of the pool's shapes.
"""

from __future__ import annotations

from typing import Callable

from torch import Tensor

from .traffic import OpSchema, Traffic, extent, out_bytes

INDEXER_RATIO = 4  # positions per lightning-indexer entry (C4)


def _count(capacity: int, length: int | None, ratio: int) -> int:
    """Entries of a list of ``capacity`` a row at length ``length`` reads."""
    if length is None:
        return capacity
    return min(capacity, length // ratio if ratio else length)


def _small(*ts) -> int:
    return sum(extent(t) for t in ts if isinstance(t, Tensor))


def sparse_attn_traffic(length: int | None) -> Traffic:
    def rule(s: OpSchema, args: tuple, kwargs: dict, out) -> tuple[int, int]:
        g = lambda name: s.get(args, kwargs, name)  # noqa: E731
        q, ring, swa_idx, entries, cmp_idx = (g(n) for n in (
            "q", "ring", "swa_idx", "entries", "cmp_idx"))
        t, w = swa_idx.shape
        read = _small(q, g("sink"), g("swa_count"), g("cmp_count"))
        read += t * _count(w, length, 0) * (ring.shape[-1] * ring.element_size() + 4)
        if isinstance(cmp_idx, Tensor):
            n = _count(cmp_idx.shape[1], length, g("ratio"))
            read += t * n * (entries.shape[-1] * entries.element_size() + 4)
        return read, out_bytes(out)
    return rule


def index_scores_traffic(length: int | None) -> Traffic:
    def rule(s: OpSchema, args: tuple, kwargs: dict, out) -> tuple[int, int]:
        g = lambda name: s.get(args, kwargs, name)  # noqa: E731
        keys, t, e = g("keys"), out.shape[0], out.shape[1]
        n = _count(e, length, INDEXER_RATIO)
        read = _small(g("q"), g("w"), g("base"), g("count"))
        return read + t * n * keys.shape[-1] * keys.element_size(), t * n * out.element_size()
    return rule


def index_topk_traffic(length: int | None) -> Traffic:
    def rule(s: OpSchema, args: tuple, kwargs: dict, out) -> tuple[int, int]:
        g = lambda name: s.get(args, kwargs, name)  # noqa: E731
        scores = g("scores")
        t, e = scores.shape
        read = _small(g("count"), g("base"))
        return read + t * _count(e, length, INDEXER_RATIO) * scores.element_size(), out_bytes(out)
    return rule


def compress_pool_traffic(length: int | None) -> Traffic:
    def rule(s: OpSchema, args: tuple, kwargs: dict, out) -> tuple[int, int]:
        g = lambda name: s.get(args, kwargs, name)  # noqa: E731
        ring, cand = g("ring"), g("cand_idx")
        read = cand.numel() * ring.shape[-1] * ring.element_size()
        read += _small(cand, g("positions"), g("ape"), g("norm_weight"), g("rot"))
        return read, out_bytes(out)
    return rule


RULES: dict[str, Callable[[int | None], Traffic]] = {
    "nextn_graph.sparse_attn": sparse_attn_traffic,
    "nextn_graph.index_scores": index_scores_traffic,
    "nextn_graph.index_topk": index_topk_traffic,
    "nextn_graph.compress_pool": compress_pool_traffic,
}


def length_rule(name: str, length: int | None) -> Traffic | None:
    """The rule of op ``name`` (an overload packet, ``nextn_graph.sparse_attn``) if its
    bytes follow the requests' length, else None."""
    make = RULES.get(name)
    return None if make is None else make(length)
