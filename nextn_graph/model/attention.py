"""DeepSeek-V4 attention: MQA with one shared K=V head over window + compressed keys.

Per row at position p the key set is the sliding window (the last ``window``
positions including p) plus compressed entries: for ratio 128 all finished
blocks ``j < (p+1)//128``; for ratio 4 the lightning indexer's top-k of the
finished blocks; none for ratio 0. One softmax covers both parts and a per-head
attention sink. RoPE is interleaved on the last ``qk_rope_head_dim`` dims and
undone on the output before the grouped low-rank output projection.
"""

from __future__ import annotations

import torch
from torch import nn

from ..memory.batch import ForwardBatch
from ..memory.pool import LayerCache
from ..parallel.group import TPGroup
from .compressor import Compressor, Indexer
from .config import ModelConfig
from .ops import RMSNorm, RopeTable, apply_rope, rms_norm, sink_attention
from .quant import linear_weight


class Attention(nn.Module):
    """Under tensor parallelism a rank holds its heads (``wq_b``, ``attn_sink``) and their
    output groups (``wo_a``, ``wo_b``'s columns); the one K=V head is replicated."""

    def __init__(self, cfg: ModelConfig, ratio: int, tp: TPGroup):
        super().__init__()
        self.ratio, self.tp = ratio, tp
        _, self.n_heads = tp.part(cfg.num_attention_heads, "num_attention_heads")  # local
        _, self.n_groups = tp.part(cfg.o_groups, "o_groups")  # local
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.o_rank = cfg.o_lora_rank
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        group_in = cfg.num_attention_heads * self.head_dim // cfg.o_groups
        self.wo_a = nn.Linear(group_in, self.n_groups * self.o_rank, bias=False)
        self.wo_b = nn.Linear(self.n_groups * self.o_rank, cfg.hidden_size, bias=False)
        if ratio:
            self.compressor = Compressor(cfg, ratio, self.head_dim)
        if ratio == 4:
            self.indexer = Indexer(cfg, ratio, tp)
        self.rope = RopeTable(cfg, compressed=ratio > 0)

    def _project(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [T, D] -> (q [T, H, hd], kv [T, hd], qr [T, q_lora]) with RoPE applied."""
        cos, sin = self.rope.lookup(positions)
        qr = self.q_norm(self.wq_a(x))
        q = rms_norm(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), self.eps)
        kv = self.kv_norm(self.wkv(x))
        return apply_rope(q, cos, sin), apply_rope(kv, cos, sin), qr

    def _output(self, q, keys, valid, positions) -> torch.Tensor:
        """Attend, undo RoPE, grouped low-rank output: -> [T, D]. H, G: this rank's."""
        o = sink_attention(q, keys, valid, self.attn_sink, self.scale)  # [T, H, hd]
        o = apply_rope(o, *self.rope.lookup(positions), inverse=True)
        o = o.reshape(o.shape[0], self.n_groups, -1)  # [T, G, H*hd/G]
        wo_a = linear_weight(self.wo_a, o.dtype).view(self.n_groups, self.o_rank, -1)
        o = torch.einsum("tgd,grd->tgr", o, wo_a)  # [T, G, o_rank]
        if not self.tp.parallel:
            return self.wo_b(o.flatten(1))
        y = self.wo_b(o.flatten(1)).float()  # [T, D], this rank's groups' part
        return self.tp.all_reduce(y).to(o.dtype)  # summed in fp32, as the reference does

    def cached(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        q, kv, qr = self._project(x, batch.positions)
        keys, key_pos = cache.swa.gather_recent(kv, batch, self.window)  # [T, W, hd]
        valid = key_pos >= 0
        cache.swa.write(kv, batch)
        if self.ratio:
            self.compressor.cached(x, batch, cache.compressed, self.rope)
            if self.ratio == 4:  # only the indexer's top-k entries are read
                idx, picked = self.indexer.cached(x, qr, batch, cache.index, self.rope)
                entries = cache.compressed.select_entries(batch, idx)  # [T, k, hd]
            else:
                entries = cache.compressed.request_entries(batch)  # [T, E, hd]
                n = entries.shape[1]
                picked = torch.arange(n, device=x.device).unsqueeze(0) < (
                    (batch.positions + 1) // self.ratio).unsqueeze(1)  # [T, E]
            keys = torch.cat((keys, entries), dim=1)
            valid = torch.cat((valid, picked), dim=1)
        return self._output(q, keys, valid, batch.positions)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence, no cache (the oracle): x [S, D] -> [S, D]."""
        s = x.shape[0]
        positions = torch.arange(s, device=x.device)
        q, kv, qr = self._project(x, positions)
        dist = positions.unsqueeze(1) - positions.unsqueeze(0)  # [S, S] query minus key
        valid = (dist >= 0) & (dist < self.window)
        keys = kv
        if self.ratio:
            entries = self.compressor.dense(x, self.rope)  # [nb, hd]
            nb = entries.shape[0]
            finished = torch.arange(nb, device=x.device).unsqueeze(0) < (
                (positions + 1) // self.ratio).unsqueeze(1)  # [S, nb]
            if self.ratio == 4:
                idx, picked = self.indexer.dense(x, qr, self.rope)
                chosen = torch.zeros_like(finished).scatter(1, idx, picked)
                finished = finished & chosen
            keys = torch.cat((kv, entries), dim=0)
            valid = torch.cat((valid, finished), dim=1)
        return self._output(q, keys.expand(s, -1, -1), valid, positions)
