"""Gated pooling compressor (C4 with overlap, C128) and the lightning indexer.

The compressor turns each finished block of ``ratio`` positions into one KV
entry: softmax-gated pooling of ``wkv(x)`` with gate ``wgate(x) + ape[p % ratio]``,
per channel, then RMS norm and RoPE at the block start. C4 entries overlap: entry
j pools the first half-channels of block j-1 with the second half of block j
(8 tokens). An entry is emitted by the row at position ``(j+1)*ratio - 1``.

Two data paths share the math: ``cached`` (rows of a forward, raw state from a
per-position ring, entries written to the pool) and ``dense`` (one whole
sequence, no cache: the oracle). What the cached path derives from the batch
alone (block closers, ring slots, masks, rotations) comes from the forward's
``ForwardPlan``, computed once for all layers. On a sparse kernel set the pooling,
norm and RoPE are one ``compress_pool`` kernel reading the candidates by index, and the
indexer's scoring and top-k are ``index_scores`` / ``index_topk`` over each row's
finished entries only (``kernels/compress.py``, ``kernels/indexer.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.compress import pool
from ..labels import COMPRESSOR, INDEXER
from ..memory.batch import ForwardPlan
from ..memory.lists import candidate_list, finished_count, flat_pages
from ..memory.pool import CompressedCache
from ..parallel.group import TPGroup
from .config import ModelConfig
from .ops import RMSNorm, RopeTable, UsesKernels, mask_bias


class Compressor(UsesKernels, nn.Module):
    profile_label = COMPRESSOR

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int):
        super().__init__()
        self.ratio = ratio
        self.head_dim = head_dim
        self.coff = 2 if ratio == 4 else 1
        width = self.coff * head_dim
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.wkv = nn.Linear(cfg.hidden_size, width, bias=False)
        self.wgate = nn.Linear(cfg.hidden_size, width, bias=False)
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps)

    @property
    def span(self) -> int:
        """Positions one entry pools: 2*ratio with overlap, else ratio."""
        return self.coff * self.ratio

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, 2*coff*d]: values, then gate scores. The position bias ``ape``
        is added at pooling, where a candidate's phase ``p % ratio`` is its place in
        the block: a static pattern, not a gather per row."""
        return torch.cat((self.wkv(x), self.wgate(x)), dim=-1)

    def _pool(self, cand: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """cand: [K, span, 2*coff*d], the ``raw`` rows of the span positions ending at
        each row's block end -> pooled [K, d]. bias: [K, span] (-inf: no such position),
        or None where every candidate exists (C128 blocks never start before 0)."""
        return pool(cand, bias, self.ape, self.ratio, self.coff)

    def _fused(self, ring: torch.Tensor, raw: torch.Tensor, cand: torch.Tensor,
               ends: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """A sparse kernel set's one kernel: pooling, norm and RoPE of the candidates
        ``cand`` [K, span] (rows of ``ring`` or of ``raw``) ending at ``ends`` [K] -> [K, d]."""
        return self.kernels.compress_pool(ring, raw, cand, ends, self.ape, self.norm.weight,
                                          self.norm.eps, rot, self.ratio, self.coff)

    def cached(self, x: torch.Tensor, plan: ForwardPlan, cache: CompressedCache,
               rope: RopeTable) -> None:
        """Update the raw ring and write every entry a row of this forward closes."""
        r = self.ratio
        raw = self.raw(x)  # [T, 2*coff*d]
        # Pool only rows that can close a block: a static number K of rows, block
        # closers first, the rest padding (garbage entries, written to slot 0).
        rows = plan.block_closers(r)
        rot = rows.memo((rope, "block_start", self.head_dim), lambda: rope.rotation(
            (rows.batch.positions + 1 - r).clamp(min=0), self.head_dim))
        if self.kernels.sparse:  # the kernel reads the ring before this forward writes it
            entry = self._fused(cache.raw.data, raw, candidate_list(rows, cache.raw, self.span),
                                rows.batch.positions, rot)
            cache.raw.write(raw, plan)
            cache.write_entries(entry, rows, r)
            return
        cand, ring = cache.raw.gather_recent(raw, rows, self.span)  # [K, span, 2cd]
        cache.raw.write(raw, plan)
        bias = None if self.coff == 1 else rows.memo(
            ("pool_bias", cache.raw.size, self.span, x.dtype),
            lambda: mask_bias(ring.valid, x.dtype))  # [K, span]: C4's block -1
        entry = self.kernels.rope(self.norm(self._pool(cand, bias)), rot, False)  # [K, d]
        cache.write_entries(entry, rows, r)

    def dense(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """All finished entries of one sequence: x [S, D] -> [S // ratio, d]."""
        s, r = x.shape[0], self.ratio
        nb = s // r
        if self.kernels.sparse:  # candidates as the sequence's rows; block -1 masked
            ends = torch.arange(nb, device=x.device) * r + r - 1  # [nb] block ends
            pos = ends.unsqueeze(1) + torch.arange(1 - self.span, 1, device=x.device)
            raw = self.raw(x)
            rot = rope.rotation(ends + 1 - r, self.head_dim)
            return self._fused(raw, raw, (-1 - pos.clamp(min=0)).to(torch.int32), ends, rot)
        raw = self.raw(x[: nb * r])
        blocks = raw.view(nb, r, raw.shape[-1])  # [nb, r, 2*coff*d]
        bias = None
        if self.coff == 2:  # prepend the previous block (zeros before block 0)
            prev = torch.cat((torch.zeros_like(blocks[:1]), blocks[:-1]), dim=0)
            blocks = torch.cat((prev, blocks), dim=1)  # [nb, 2r, 2*coff*d]
            starts = torch.arange(nb, device=x.device).unsqueeze(1) * r  # [nb, 1]
            cand_pos = starts + torch.arange(self.span, device=x.device) - r
            bias = mask_bias(cand_pos >= 0, x.dtype)  # [nb, span]; block -1 does not exist
        rot = rope.rotation(torch.arange(nb, device=x.device) * r, self.head_dim)
        return self.kernels.rope(self.norm(self._pool(blocks, bias)), rot, False)


# Tie-breaking of the indexer's top-k (``stable_topk``). ``torch.topk`` leaves the order
# of equal values open and relu makes exact ties common (0.0 above all); a stable sort
# keeps the lowest entry first. The float64 key of a score s (float32, bf16 or fp16) at
# entry e < E <= 2**b,
#     s - |s| * e * 2**-(26 + b) - e * 2**-(200 + b)    for a finished entry,
#     -(2**900 + e * 2**870)                              for an unfinished one,
# is exact where it must be and strictly decreasing in e for equal s (-0.0 = 0.0 too):
# the relative term, under 2**-26, never reaches the next float32 value (2**-24 apart),
# and its steps of at least 2**-48 (b <= 22) dwarf float64 rounding (2**-53); the
# absolute term orders zeros and stays far below the smallest float32, 2**-149. One top-k
# of it returns exactly the first k entries of the stable descending sort of the scores
# with unfinished entries at -inf (those in entry order, as the sort leaves them).
_MAX_INDEX_BITS = 22
_MASKED = -(2.0 ** 900)


def stable_topk_terms(finished: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """finished [T, E] bool -> (base [T, E], slope [E]) float64 for ``stable_topk``."""
    n = finished.shape[-1]
    b = max(n - 1, 1).bit_length()
    if b > _MAX_INDEX_BITS:
        raise ValueError(f"stable_topk: {n} entries exceed the 2**{_MAX_INDEX_BITS} its "
                         f"float64 key orders exactly")
    e = torch.arange(n, dtype=torch.float64, device=finished.device)  # [E]
    base = torch.where(finished, e * -(2.0 ** -(200 + b)), e * -(2.0 ** (900 - 30)) + _MASKED)
    return base, e * -(2.0 ** -(26 + b))


def stable_topk(scores: torch.Tensor, k: int, base: torch.Tensor,
                slope: torch.Tensor) -> torch.Tensor:
    """Indices [T, k] of the first k entries of a stable descending sort of ``scores``
    [T, E] (lowest entry first among equal scores) where unfinished entries (``base``,
    ``slope`` from ``stable_topk_terms``) count as -inf. One top-k, not a sort; the key
    is exact, so the cached and the dense path pick the same entries."""
    key = torch.addcmul(base + scores, scores.abs(), slope)  # [T, E] float64
    return key.topk(k, dim=-1).indices


class Indexer(UsesKernels, nn.Module):
    """Lightning indexer: scores finished C4 entries per query row, keeps the top-k.

    Under tensor parallelism a rank scores with its heads (``wq_b``, ``weights_proj``) and
    the partial scores are all-reduced before the top-k; the compressor is replicated."""
    profile_label = INDEXER

    def __init__(self, cfg: ModelConfig, ratio: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        _, self.n_heads = tp.part(cfg.index_n_heads, "index_n_heads")  # this rank's heads
        self.head_dim = cfg.index_head_dim
        # the weights' scale counts every head of the model, not this rank's
        self.score_scale = self.head_dim ** -0.5 * cfg.index_n_heads ** -0.5
        self.topk = cfg.index_topk
        self.ratio = ratio
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg, ratio, self.head_dim)

    def rotation(self, rope: RopeTable, positions: torch.Tensor) -> torch.Tensor:
        """The query's RoPE rotation times ``score_scale``: relu(a*s) = a*relu(s) for
        a > 0, so the scale rides on the rotation (built once per forward) instead of
        costing a kernel per layer."""
        return rope.rotation(positions, self.head_dim) * self.score_scale

    def _rotation_at(self, plan: ForwardPlan, rope: RopeTable) -> torch.Tensor:
        """``rotation`` at the plan's positions: once per forward for every C4 layer."""
        return plan.memo((rope, "indexer_query", self.head_dim, self.score_scale),
                         lambda: self.rotation(rope, plan.batch.positions))

    def _query(self, qr: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """qr [T, q_lora] -> the RoPE'd, scaled queries [T, Hi, di] (this rank's heads)."""
        return self.kernels.rope(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), rot, False)

    def _scores(self, x: torch.Tensor, qr: torch.Tensor, rot: torch.Tensor,
                keys: torch.Tensor) -> torch.Tensor:
        """keys: [T, E, di], rot: ``rotation`` -> scores [T, E] = sum_h relu(q_h . k) * w_h
        * score_scale over all heads."""
        q = self._query(qr, rot)
        w = self.weights_proj(x)  # [T, Hi]
        relu = torch.bmm(q, keys.transpose(1, 2)).relu()  # [T, Hi, E]
        part = torch.bmm(w.unsqueeze(1), relu).squeeze(1)  # the weighted sum over heads
        return self.tp.all_reduce(part)  # [T, E]: the sum over every rank's heads

    def _select(self, x, qr, rot, keys, pages, per_page, count, n):
        """A sparse kernel set's scoring and top-k over the ``count`` [T] finished entries
        of each row's request (``keys`` rows through its page ids ``pages`` [T, P] of
        ``per_page`` entries) -> (rows [T, k] int32, n [T])."""
        scores = self.kernels.index_scores(self._query(qr, rot), self.weights_proj(x), keys,
                                           pages, per_page, count, n)
        scores = self.tp.all_reduce(scores)  # [T, n]: every rank's heads (past count: unread)
        return self.kernels.index_topk(scores, count, pages, per_page, min(self.topk, n))

    def selected(self, x, qr, plan: ForwardPlan, cache: CompressedCache,
                 rope: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        """``cached`` on a sparse kernel set: -> (pool rows of the chosen entries [T, k]
        int32, their count [T] int32), in entry order."""
        self.compressor.cached(x, plan, cache, rope)
        n = cache.per_request
        return self._select(x, qr, self._rotation_at(plan, rope), cache.entries,
                            cache.pages(plan), cache.per_page,
                            finished_count(plan, self.ratio, n), n)

    def dense_selected(self, x, qr, rope: RopeTable, plan: ForwardPlan):
        """``dense`` on a sparse kernel set (``plan``: ``lists.sequence_plan``)."""
        keys = self.compressor.dense(x, rope)  # [nb, di]
        n = keys.shape[0]
        return self._select(x, qr, self.rotation(rope, plan.batch.positions), keys,
                            flat_pages(plan), n, finished_count(plan, self.ratio, n), n)

    def cached(self, x, qr, plan: ForwardPlan, cache: CompressedCache,
               rope: RopeTable) -> torch.Tensor:
        """-> entry ids [T, k]; unfinished ones among them are masked by the caller."""
        self.compressor.cached(x, plan, cache, rope)
        keys = cache.request_entries(plan)  # [T, E, di]
        n = keys.shape[1]
        base, slope = plan.memo(("stable_topk", self.ratio, n), lambda: stable_topk_terms(
            plan.finished_entries(self.ratio, n)))
        scores = self._scores(x, qr, self._rotation_at(plan, rope), keys)
        return stable_topk(scores, min(self.topk, n), base, slope)

    def dense(self, x, qr, rope: RopeTable):
        """-> (entry ids [S, k], picked [S, k]: the id is a finished entry)."""
        keys = self.compressor.dense(x, rope)  # [nb, di]
        positions = torch.arange(x.shape[0], device=x.device)
        finished = torch.arange(keys.shape[0], device=x.device).unsqueeze(0) < (
            (positions + 1) // self.ratio).unsqueeze(1)  # [S, nb]
        scores = self._scores(x, qr, self.rotation(rope, positions),
                              keys.expand(x.shape[0], -1, -1))
        idx = stable_topk(scores, min(self.topk, keys.shape[0]), *stable_topk_terms(finished))
        return idx, finished.gather(1, idx)
