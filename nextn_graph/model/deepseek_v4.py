"""The DeepSeek-V4 target: embedding copied into mHC streams, decoder layers with
per-layer SWA / C4 / C128 attention, ``hc_head``, final norm and LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..memory.batch import ForwardBatch
from ..memory.pool import KVPool, PoolLayout
from .block import Block
from .config import ModelConfig
from .mhc import hc_head
from .ops import RMSNorm


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor  # [T, vocab] fp32
    hidden: torch.Tensor  # [T, hc_mult*H]: pre_hc_head, the streams flattened


def add_stream_head(module: nn.Module, cfg: ModelConfig) -> None:
    """Give ``module`` the ``hc_head_*`` params and final ``norm`` of a stream head."""
    module.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    module.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_dim))
    module.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
    module.hc_head_scale = nn.Parameter(torch.ones(1))


def stream_output(module: nn.Module, cfg: ModelConfig, x: torch.Tensor,
                  head: nn.Linear) -> ForwardOutput:
    """hc_head, norm, LM head: x [T, hc, D] -> logits [T, V] and pre_hc_head [T, hc*D]."""
    collapsed = hc_head(x, module.hc_head_fn, module.hc_head_scale, module.hc_head_base,
                        cfg.hc_eps, cfg.rms_norm_eps)
    logits = head(module.norm(collapsed)).float()
    return ForwardOutput(logits=logits, hidden=x.flatten(1))


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        add_stream_head(self, cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Block(cfg, cfg.layer_ratio(i), hashed=i < cfg.num_hash_layers)
            for i in range(cfg.num_hidden_layers))
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def layer_ratios(self) -> list[int]:
        return [layer.attn.ratio for layer in self.layers]

    def new_pool(self, layout: PoolLayout) -> KVPool:
        p = self.embed.weight
        return KVPool(self.cfg, layout, self.layer_ratios(), device=p.device, dtype=p.dtype)

    def _streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding copied into every stream: [T] -> [T, hc, D]."""
        return self.embed(input_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1)

    def forward(self, batch: ForwardBatch, pool: KVPool) -> ForwardOutput:
        """Cached path: rows of many requests against the pool (prefill, decode, verify)."""
        x = self._streams(batch.input_ids)
        for layer, cache in zip(self.layers, pool.layers):
            x = layer.cached(x, batch, cache)
        return stream_output(self, self.cfg, x, self.head)

    def reference(self, input_ids: torch.Tensor) -> ForwardOutput:
        """Full recompute of one whole sequence with no cache: the oracle."""
        x = self._streams(input_ids)
        for layer in self.layers:
            x = layer.dense(x, input_ids)
        return stream_output(self, self.cfg, x, self.head)
