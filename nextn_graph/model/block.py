"""One DeepSeek-V4 decoder layer on mHC streams: attention and MoE sublayers."""

from __future__ import annotations

import torch
from torch import nn

from ..memory.batch import ForwardBatch
from ..memory.pool import LayerCache
from ..parallel.group import TPGroup
from .attention import Attention
from .config import ModelConfig
from .mhc import hc_post, hc_pre
from .moe import MoE
from .ops import RMSNorm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int, hashed: bool, tp: TPGroup):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, ratio, tp)
        self.ffn = MoE(cfg, hashed, tp)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        mix = (2 + cfg.hc_mult) * cfg.hc_mult  # pre, post and the hc x hc comb logits
        for part in ("attn", "ffn"):  # mHC parameters are fp32 by design
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, cfg.hc_dim)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def _pre(self, x: torch.Tensor, part: str):
        cfg = self.cfg
        return hc_pre(x, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_scale"),
                      getattr(self, f"hc_{part}_base"), cfg.hc_sinkhorn_iters, cfg.hc_eps,
                      cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, attend) -> torch.Tensor:
        """x: [T, hc, D] streams -> [T, hc, D]; ``attend(normed [T, D]) -> [T, D]``."""
        h, post, comb = self._pre(x, "attn")
        x = hc_post(attend(self.attn_norm(h)), x, post, comb)
        h, post, comb = self._pre(x, "ffn")
        return hc_post(self.ffn(self.ffn_norm(h), input_ids), x, post, comb)

    def cached(self, x: torch.Tensor, batch: ForwardBatch, cache: LayerCache) -> torch.Tensor:
        return self(x, batch.input_ids, lambda h: self.attn.cached(h, batch, cache))

    def dense(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self(x, input_ids, self.attn.dense)
