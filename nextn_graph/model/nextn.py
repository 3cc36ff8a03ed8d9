"""The NextN (MTP) draft: one DeepSeek-V4 layer fed by token embedding and the
target's ``pre_hc_head``, with its own ``hc_head`` and norm, sharing the target's
embedding and LM head. Its layer is forced to compress ratio 0 (SWA only, base
RoPE), so its pool holds a sliding-window ring and nothing else."""

from __future__ import annotations

import torch
from torch import nn

from ..labels import NEXTN_FUSE
from ..memory.batch import ForwardBatch, ForwardPlan
from ..memory.pool import KVPool, PoolLayout
from ..parallel.group import TPGroup
from .block import Block
from .config import NEXTN_COMPRESS_RATIO, ModelConfig
from .deepseek_v4 import DeepseekV4ForCausalLM, ForwardOutput, add_stream_head, stream_output
from .ops import RMSNorm, RopeTable


class NextNLayer(Block):
    """``mtp.0.*``: fusion projections, the decoder layer, and the stream head."""
    profile_label = NEXTN_FUSE  # its own code: fuse (Block's methods: MHC)

    def __init__(self, cfg: ModelConfig, tp: TPGroup, rope: RopeTable):
        super().__init__(cfg, NEXTN_COMPRESS_RATIO, hashed=False, tp=tp, rope=rope)
        add_stream_head(self, cfg)
        self.e_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.h_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """tokens: [T, H] embedded ids, hidden: [T, hc*H] -> streams [T, hc, H].

        The token side is broadcast over the streams; the streams are kept, never averaged.
        """
        h = hidden.view(hidden.shape[0], self.cfg.hc_mult, self.cfg.hidden_size)
        return self.e_proj(self.enorm(tokens)).unsqueeze(1) + self.h_proj(self.hnorm(h))


class DeepseekV4ForCausalLMNextN(nn.Module):
    """Sharded as the target is, over the target's group, sharing its embedding and
    head shards."""
    profile_label = NEXTN_FUSE

    def __init__(self, cfg: ModelConfig, target: DeepseekV4ForCausalLM):
        super().__init__()
        self.cfg = cfg
        self.tp = target.tp
        # the target's base-theta table: owned (registered, moved, counted) by the target
        rope = target.rope_tables.for_ratio(NEXTN_COMPRESS_RATIO)
        self.mtp = nn.ModuleList([NextNLayer(cfg, self.tp, rope)])
        self._shared = (target.embed, target.head)  # not submodules: owned by the target

    @property
    def layer(self) -> NextNLayer:
        return self.mtp[0]

    def new_pool(self, layout: PoolLayout) -> KVPool:
        p = self.layer.enorm.weight  # a float tensor even when e_proj is quantized
        return KVPool(self.cfg, layout, [NEXTN_COMPRESS_RATIO], device=p.device, dtype=p.dtype)

    def _check_hidden(self, hidden: torch.Tensor, rows: int) -> None:
        if hidden.shape != (rows, self.cfg.hc_dim):
            raise ValueError(f"NextN hidden must be [T, hc_mult*hidden_size] = "
                             f"[{rows}, {self.cfg.hc_dim}], got {list(hidden.shape)}")

    def forward(self, batch: ForwardBatch, hidden: torch.Tensor, pool: KVPool) -> ForwardOutput:
        """Cached path. hidden: [T, hc*H] (target or draft pre_hc_head, row-aligned)."""
        self._check_hidden(hidden, batch.num_rows)
        embed, head = self._shared
        x = self.layer.fuse(embed(batch.input_ids), hidden)
        x = self.layer.cached(x, ForwardPlan(batch), pool.layers[0])
        return stream_output(self.layer, self.cfg, x, head, self.tp)

    def reference(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> ForwardOutput:
        """Whole sequence, no cache: row p pairs token input_ids[p] with hidden[p]."""
        self._check_hidden(hidden, input_ids.shape[0])
        embed, head = self._shared
        x = self.layer.fuse(embed(input_ids), hidden)
        return stream_output(self.layer, self.cfg, self.layer.dense(x, input_ids), head,
                             self.tp)
