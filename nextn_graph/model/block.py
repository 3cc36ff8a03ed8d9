"""One DeepSeek-V4 decoder layer on mHC streams: attention and MoE sublayers."""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from ..kernels.mhc import HcConstants
from ..labels import MHC
from ..memory.batch import ForwardPlan
from ..memory.pool import LayerCache
from ..parallel.group import TPGroup
from .attention import Attention
from .config import ModelConfig
from .moe import MoE
from .ops import RMSNorm, RopeTable, UsesKernels


class Block(UsesKernels, nn.Module):
    """``rope``: the model's RoPE table for this layer's kind (``RopeTables.for_ratio``)."""
    profile_label = MHC  # hc_pre / hc_post, the layer's glue

    def __init__(self, cfg: ModelConfig, ratio: int, hashed: bool, tp: TPGroup,
                 rope: RopeTable):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, ratio, tp, rope)
        self.ffn = MoE(cfg, hashed, tp)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        mix = (2 + cfg.hc_mult) * cfg.hc_mult  # pre, post and the hc x hc comb logits
        for part in ("attn", "ffn"):  # mHC parameters are fp32 by design
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, cfg.hc_dim)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def _pre(self, x: torch.Tensor, part: str,
             consts: Callable[[], HcConstants] | None = None):
        cfg = self.cfg
        if consts is None:
            consts = lambda: HcConstants.make(cfg.hc_mult, cfg.hc_eps, x.device)  # noqa: E731
        return self.kernels.hc_pre(
            x, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_scale"),
            getattr(self, f"hc_{part}_base"), cfg.hc_sinkhorn_iters, cfg.hc_eps,
            cfg.rms_norm_eps, consts)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, attend,
                consts: Callable[[], HcConstants] | None = None) -> torch.Tensor:
        """x: [T, hc, D] streams -> [T, hc, D]; ``attend(normed [T, D]) -> [T, D]``.
        ``consts`` makes the reference ``hc_pre``'s constants when first asked (a fused
        kernel needs none)."""
        if consts is None:
            consts = functools.cache(lambda: HcConstants.make(self.cfg.hc_mult,
                                                              self.cfg.hc_eps, x.device))
        h, post, comb = self._pre(x, "attn", consts)
        hc_post = self.kernels.hc_post
        x = hc_post(attend(self.attn_norm(h)), x, post, comb)
        h, post, comb = self._pre(x, "ffn", consts)
        return hc_post(self.ffn(self.ffn_norm(h), input_ids), x, post, comb)

    def cached(self, x: torch.Tensor, plan: ForwardPlan, cache: LayerCache) -> torch.Tensor:
        cfg = self.cfg
        consts = lambda: plan.memo(  # noqa: E731  (made once per forward, if asked for)
            ("hc_constants", cfg.hc_mult, cfg.hc_eps),
            lambda: HcConstants.make(cfg.hc_mult, cfg.hc_eps, x.device))
        return self(x, plan.batch.input_ids, lambda h: self.attn.cached(h, plan, cache), consts)

    def dense(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self(x, input_ids, self.attn.dense)
