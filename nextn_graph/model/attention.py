"""DeepSeek-V4 attention: MQA with one shared K=V head over window + compressed keys.

Per row at position p the key set is the sliding window (the last ``window``
positions including p) plus compressed entries: for ratio 128 all finished
blocks ``j < (p+1)//128``; for ratio 4 the lightning indexer's top-k of the
finished blocks; none for ratio 0. One softmax covers both parts and a per-head
attention sink. RoPE is interleaved on the last ``qk_rope_head_dim`` dims and
undone on the output before the grouped low-rank output projection.

The cached path takes what depends on the batch alone (ring slots, key masks as
additive biases, RoPE rotations) from the forward's ``ForwardPlan``: computed by
the first layer that asks, reused by the others. On a sparse kernel set (``triton``)
the keys are not gathered: one ``sparse_attn`` kernel reads them by index lists
(``memory/lists.py``), cached and no-cache paths alike; the reference set keeps the
gathered path above, bitwise as before.
"""

from __future__ import annotations

import torch
from torch import nn

from ..labels import ATTENTION
from ..memory.batch import ForwardPlan
from ..memory.lists import entry_list, sequence_plan, window_list
from ..memory.pool import LayerCache
from ..memory.rings import Ring
from ..parallel.group import TPGroup
from .compressor import Compressor, Indexer
from .config import ModelConfig
from .ops import RMSNorm, RopeTable, UsesKernels, mask_bias, sink_attention
from .quant import grouped_linear


class Attention(UsesKernels, nn.Module):
    """Under tensor parallelism a rank holds its heads (``wq_b``, ``attn_sink``) and their
    output groups (``wo_a``, ``wo_b``'s columns); the one K=V head is replicated.

    ``rope``: the model's table for this kind of layer (``RopeTables.for_ratio``), shared
    with the other layers of the kind and owned (registered) by the model."""
    profile_label = ATTENTION

    def __init__(self, cfg: ModelConfig, ratio: int, tp: TPGroup, rope: RopeTable):
        super().__init__()
        self.ratio, self.tp = ratio, tp
        _, self.n_heads = tp.part(cfg.num_attention_heads, "num_attention_heads")  # local
        _, self.n_groups = tp.part(cfg.o_groups, "o_groups")  # local
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.o_rank = cfg.o_lora_rank
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
        self._rope = (rope,)  # a tuple: not a submodule of every layer

    @property
    def rope(self) -> RopeTable:
        return self._rope[0]

    def _project(self, x: torch.Tensor, rot: torch.Tensor):
        """x: [T, D] -> (q [T, H, hd], kv [T, hd], qr [T, q_lora]) with RoPE applied."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(-1, self.n_heads, self.head_dim)  # [T, H, hd]
        # q's weightless per-head norm and kv_norm (one eps, rms_norm_eps), kv_norm's
        # weight on the kv row, one RoPE for all
        kv_norm = self.kv_norm
        q, kv = self.kernels.q_kv_norm_rope(q, self.wkv(x), kv_norm.weight, kv_norm.eps,
                                            kv_norm.eps_tensor, rot)  # [T, H, hd], [T, hd]
        return q, kv, qr

    def _output(self, q, keys, bias, rot) -> torch.Tensor:
        """Attend, undo RoPE, grouped low-rank output: -> [T, D]. H, G: this rank's."""
        return self._project_out(sink_attention(q, keys, bias, self.attn_sink, self.scale), rot)

    def _project_out(self, o: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """o [T, H, hd] attended -> [T, D]: RoPE undone, the grouped low-rank output."""
        o = self.kernels.rope(o, rot, True)
        t = o.shape[0]
        o = o.view(t, self.n_groups, -1).transpose(0, 1)  # [G, T, H*hd/G]
        o = grouped_linear(self.wo_a, o)  # [G, T, o_rank]: each group's projection
        o = o.transpose(0, 1).contiguous().view(t, -1)  # [T, G*o_rank]
        if not self.tp.parallel:
            return self.wo_b(o)
        y = self.wo_b(o).float()  # [T, D], this rank's groups' part
        return self.tp.all_reduce(y).to(o.dtype)  # summed in fp32, as the reference does

    def _attend(self, q, ring, kv, swa, entries, cmp) -> torch.Tensor:
        """One sparse-attention kernel over index lists (``memory/lists.py``): swa = the
        window's (idx, count) over ``ring`` and the forward's ``kv``; cmp = the compressed
        entries' (rows, count) over ``entries`` (None without) -> [T, H, hd]."""
        cmp_idx, cmp_count = cmp if cmp is not None else (None, None)
        return self.kernels.sparse_attn(q, ring, kv, swa[0], swa[1], entries, cmp_idx,
                                        cmp_count, self.attn_sink, self.scale,
                                        self.ratio if entries is not None else 0)

    def cached(self, x: torch.Tensor, plan: ForwardPlan, cache: LayerCache) -> torch.Tensor:
        if self.kernels.sparse:
            return self._cached_lists(x, plan, cache)
        rot = self.rope.at(plan, self.head_dim)
        q, kv, qr = self._project(x, rot)
        keys, ring = cache.swa.gather_recent(kv, plan, self.window)  # [T, W, hd]
        cache.swa.write(kv, plan)
        window_key = ("window_bias", cache.swa.size, self.window, x.dtype)
        window_bias = plan.memo(window_key, lambda: mask_bias(ring.valid, x.dtype))  # [T, W]
        if not self.ratio:
            return self._output(q, keys, window_bias, rot)
        self.compressor.cached(x, plan, cache.compressed, self.rope)
        n = cache.compressed.per_request
        entry_bias = plan.memo(("entry_bias", self.ratio, n, x.dtype), lambda: mask_bias(
            plan.finished_entries(self.ratio, n), x.dtype))  # [T, E]
        if self.ratio == 4:  # only the indexer's top-k entries are read
            idx = self.indexer.cached(x, qr, plan, cache.index, self.rope)  # [T, k]
            entries = cache.compressed.select_entries(plan, idx)  # [T, k, hd]
            bias = torch.cat((window_bias, entry_bias.gather(1, idx)), dim=1)
        else:  # every entry slot of the request, unfinished ones masked
            entries = cache.compressed.request_entries(plan)  # [T, E, hd]
            bias = plan.memo(window_key + (self.ratio, n), lambda: torch.cat(
                (window_bias, entry_bias), dim=1))  # [T, W + E]
        return self._output(q, torch.cat((keys, entries), dim=1), bias, rot)

    def _cached_lists(self, x: torch.Tensor, plan: ForwardPlan,
                      cache: LayerCache) -> torch.Tensor:
        """``cached`` on a sparse kernel set: the kernel reads the ring, the forward's rows
        and the pool's entries by index; the ring is written after it read."""
        rot = self.rope.at(plan, self.head_dim)
        q, kv, qr = self._project(x, rot)
        swa = window_list(plan, cache.swa, self.window)
        entries = cmp = None
        if self.ratio:
            self.compressor.cached(x, plan, cache.compressed, self.rope)
            entries = cache.compressed.entries
            cmp = (self.indexer.selected(x, qr, plan, cache.index, self.rope) if self.ratio == 4
                   else entry_list(plan, cache.compressed, cache.compressed.per_request,
                                   self.ratio))
        o = self._attend(q, cache.swa.data, kv, swa, entries, cmp)
        cache.swa.write(kv, plan)
        return self._project_out(o, rot)

    def _dense_lists(self, x: torch.Tensor) -> torch.Tensor:
        """``dense`` on a sparse kernel set: the same kernels over lists of the sequence's
        own rows (nothing cached), so the oracle runs what the cached path runs."""
        plan = sequence_plan(x.shape[0], x.device)
        rot = self.rope.rotation(plan.batch.positions, self.head_dim)
        q, kv, qr = self._project(x, rot)
        swa = window_list(plan, Ring(kv, 1), self.window)  # every key one of kv's rows
        entries = cmp = None
        if self.ratio and x.shape[0] >= self.ratio:
            entries = self.compressor.dense(x, self.rope)  # [nb, hd]
            cmp = (self.indexer.dense_selected(x, qr, self.rope, plan) if self.ratio == 4
                   else entry_list(plan, None, entries.shape[0], self.ratio))
        return self._project_out(self._attend(q, kv, kv, swa, entries, cmp), rot)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence, no cache (the oracle): x [S, D] -> [S, D]."""
        if self.kernels.sparse:
            return self._dense_lists(x)
        s = x.shape[0]
        positions = torch.arange(s, device=x.device)
        rot = self.rope.rotation(positions, self.head_dim)
        q, kv, qr = self._project(x, rot)
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
        return self._output(q, keys.expand(s, -1, -1), mask_bias(valid, x.dtype), rot)
