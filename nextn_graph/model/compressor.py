"""Gated pooling compressor (C4 with overlap, C128) and the lightning indexer.

The compressor turns each finished block of ``ratio`` positions into one KV
entry: softmax-gated pooling of ``wkv(x)`` with gate ``wgate(x) + ape[p % ratio]``,
per channel, then RMS norm and RoPE at the block start. C4 entries overlap: entry
j pools the first half-channels of block j-1 with the second half of block j
(8 tokens). An entry is emitted by the row at position ``(j+1)*ratio - 1``.

Two data paths share the math: ``cached`` (rows of a forward, raw state from a
per-position ring, entries written to the pool) and ``dense`` (one whole
sequence, no cache: the oracle).
"""

from __future__ import annotations

import torch
from torch import nn

from ..memory.batch import ForwardBatch
from ..memory.pool import CompressedCache
from ..parallel.group import TPGroup
from .config import ModelConfig
from .ops import RMSNorm, RopeTable, apply_rope, pool_softmax


class Compressor(nn.Module):
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

    def raw(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, 2*coff*d]: values, then gate scores with the position bias."""
        score = self.wgate(x) + self.ape[positions % self.ratio].to(x.dtype)
        return torch.cat((self.wkv(x), score), dim=-1)

    def _pool(self, cand: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """cand: [..., span, 2*coff*d], valid: [..., span] -> pooled [..., d]."""
        kv, score = cand.chunk(2, dim=-1)  # [..., span, coff*d] each
        if self.coff == 2:  # earlier block: first half-channels; own block: second half
            d, r = self.head_dim, self.ratio
            kv = torch.cat((kv[..., :r, :d], kv[..., r:, d:]), dim=-2)  # [..., 2r, d]
            score = torch.cat((score[..., :r, :d], score[..., r:, d:]), dim=-2)
        score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        return pool_softmax(kv, score)

    def _finish(self, pooled: torch.Tensor, block_start: torch.Tensor,
                rope: RopeTable) -> torch.Tensor:
        cos, sin = rope.lookup(block_start)
        return apply_rope(self.norm(pooled), cos, sin)

    def cached(self, x: torch.Tensor, batch: ForwardBatch, cache: CompressedCache,
               rope: RopeTable) -> None:
        """Update the raw ring and write every entry a row of this forward closes."""
        raw = self.raw(x, batch.positions)  # [T, 2*coff*d]
        # Pool only rows that can close a block: a static number K of rows, block
        # closers first (a stable sort keeps them in row order), the rest padding.
        closes = (batch.positions + 1) % self.ratio == 0  # [T]
        k = batch.max_block_closers(self.ratio)
        sel = torch.sort((~closes).to(torch.uint8), stable=True).indices[:k]  # [K]
        rows = batch.select(sel)
        cand, key_pos = cache.raw.gather_recent(raw, rows, self.span, sel)  # [K, span, 2cd]
        cache.raw.write(raw, batch)
        pooled = self._pool(cand, key_pos >= 0)  # [K, d]; garbage on rows closing no block
        block_start = (rows.positions + 1 - self.ratio).clamp(min=0)
        cache.write_entries(self._finish(pooled, block_start, rope), rows, self.ratio)

    def dense(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """All finished entries of one sequence: x [S, D] -> [S // ratio, d]."""
        s, r = x.shape[0], self.ratio
        nb = s // r
        raw = self.raw(x[: nb * r], torch.arange(nb * r, device=x.device))
        blocks = raw.view(nb, r, raw.shape[-1])  # [nb, r, 2*coff*d]
        if self.coff == 2:  # prepend the previous block (zeros before block 0)
            prev = torch.cat((torch.zeros_like(blocks[:1]), blocks[:-1]), dim=0)
            blocks = torch.cat((prev, blocks), dim=1)  # [nb, 2r, 2*coff*d]
        starts = torch.arange(nb, device=x.device).unsqueeze(1) * r  # [nb, 1]
        cand_pos = starts + torch.arange(self.span, device=x.device) - (self.span - r)
        valid = cand_pos >= 0  # [nb, span]; block -1 does not exist
        pooled = self._pool(blocks, valid)
        return self._finish(pooled, torch.arange(nb, device=x.device) * r, rope)


class Indexer(nn.Module):
    """Lightning indexer: scores finished C4 entries per query row, keeps the top-k.

    Under tensor parallelism a rank scores with its heads (``wq_b``, ``weights_proj``) and
    the partial scores are all-reduced before the top-k; the compressor is replicated."""

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

    def _scores(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor,
                keys: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """keys: [T, E, di] -> scores [T, E] = sum_h relu(q_h . k) * w_h over all heads."""
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)  # [T, Hi, di] (local heads)
        q = apply_rope(q, *rope.lookup(positions))
        w = self.weights_proj(x) * self.score_scale  # [T, Hi]
        part = (torch.einsum("thd,ted->the", q, keys).relu() * w.unsqueeze(-1)).sum(dim=1)
        return self.tp.all_reduce(part)  # [T, E]: the sum over every rank's heads

    def _select(self, scores: torch.Tensor, positions: torch.Tensor):
        """Mask unfinished entries, keep the top-k: -> (entry ids [T, k], valid [T, k])."""
        finished = torch.arange(scores.shape[1], device=scores.device).unsqueeze(0) < (
            (positions + 1) // self.ratio).unsqueeze(1)  # [T, E]
        scores = scores.masked_fill(~finished, float("-inf"))
        # Stable sort, not topk: relu makes exact ties (often 0.0) common, and the
        # cached path scores more (unfinished) entries than the oracle; a stable
        # order picks the lowest entry id among ties on both paths.
        order = scores.sort(dim=-1, descending=True, stable=True).indices
        idx = order[:, : min(self.topk, scores.shape[1])]  # [T, k]
        return idx, finished.gather(1, idx)

    def cached(self, x, qr, batch: ForwardBatch, cache: CompressedCache, rope: RopeTable):
        self.compressor.cached(x, batch, cache, rope)
        keys = cache.request_entries(batch)  # [T, E, di]
        return self._select(self._scores(x, qr, batch.positions, keys, rope), batch.positions)

    def dense(self, x, qr, rope: RopeTable):
        keys = self.compressor.dense(x, rope)  # [nb, di]
        positions = torch.arange(x.shape[0], device=x.device)
        scores = self._scores(x, qr, positions, keys.expand(x.shape[0], -1, -1), rope)
        return self._select(scores, positions)
