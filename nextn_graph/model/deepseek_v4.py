"""The DeepSeek-V4 target: embedding copied into mHC streams, decoder layers with
per-layer SWA / C4 / C128 attention, ``hc_head``, final norm and LM head.

Over a tensor-parallel group (``TPGroup``) the embedding and the LM head split the
vocabulary (all-reduce of the looked-up rows, all-gather of the logits); the layers
split heads and experts (``checkpoint/sharding.py`` is the table). A group of one runs
the single-device code, collectives and all skipped."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..labels import EMBED, HEAD, MHC, labelled
from ..memory.batch import ForwardBatch, ForwardPlan
from ..memory.pool import KVPool, PoolLayout
from ..parallel.group import TPGroup
from .block import Block
from .config import ModelConfig
from .ops import RMSNorm, RopeTables, UsesKernels


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


@labelled(MHC)  # the stream head's hc_head, reference or fused
def hc_collapse(module: UsesKernels, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """The stream head's ``hc_head``: x [T, hc, D] -> [T, D]."""
    return module.kernels.hc_head(x, module.hc_head_fn, module.hc_head_scale,
                                  module.hc_head_base, cfg.hc_eps, cfg.rms_norm_eps)


@labelled(HEAD)  # the target's and the draft's
def stream_output(module: UsesKernels, cfg: ModelConfig, x: torch.Tensor,
                  head: nn.Linear, tp: TPGroup) -> ForwardOutput:
    """hc_head, norm, LM head: x [T, hc, D] -> logits [T, V] and pre_hc_head [T, hc*D]."""
    logits = head(module.norm(hc_collapse(module, cfg, x))).float()  # [T, V/tp]: this rank's
    return ForwardOutput(logits=tp.all_gather(logits), hidden=x.flatten(1))


class ParallelEmbedding(nn.Module):
    """The token embedding, rows [start, start + V/tp) of it on this rank (``weight``).

    Capture-safe: ids outside the rank's rows are clamped into range and their rows
    zeroed with ``torch.where`` (no boolean indexing, no host sync), then the ranks'
    rows are summed; each id has exactly one owner, so the sum is exact."""
    profile_label = EMBED

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.start, rows = tp.part(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(rows, dim).normal_())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] global token ids -> [T, D]."""
        if not self.tp.parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.start  # [T]
        rows = self.weight.shape[0]
        mine = (local >= 0) & (local < rows)  # [T]
        out = F.embedding(local.clamp(0, rows - 1), self.weight)  # [T, D]
        out = torch.where(mine.unsqueeze(-1), out, 0.0)  # another rank's rows: zero
        return self.tp.all_reduce(out)


class DeepseekV4ForCausalLM(UsesKernels, nn.Module):
    profile_label = HEAD

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp if tp is not None else TPGroup.single()
        add_stream_head(self, cfg)
        self.embed = ParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.tp)
        self.rope_tables = RopeTables(cfg)  # one per kind of layer, the draft's included
        self.layers = nn.ModuleList(
            Block(cfg, cfg.layer_ratio(i), hashed=i < cfg.num_hash_layers, tp=self.tp,
                  rope=self.rope_tables.for_ratio(cfg.layer_ratio(i)))
            for i in range(cfg.num_hidden_layers))
        _, vocab = self.tp.part(cfg.vocab_size, "vocab_size")
        self.head = nn.Linear(cfg.hidden_size, vocab, bias=False)  # [V/tp, D]

    def layer_ratios(self) -> list[int]:
        return [layer.attn.ratio for layer in self.layers]

    def new_pool(self, layout: PoolLayout) -> KVPool:
        p = self.embed.weight
        return KVPool(self.cfg, layout, self.layer_ratios(), device=p.device, dtype=p.dtype)

    @labelled(EMBED)
    def _streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding copied into every stream: [T] -> [T, hc, D]."""
        return self.embed(input_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1)

    def forward(self, batch: ForwardBatch, pool: KVPool) -> ForwardOutput:
        """Cached path: rows of many requests against the pool (prefill, decode, verify)."""
        x = self._streams(batch.input_ids)
        plan = ForwardPlan(batch)  # what every layer derives from the batch, once
        for layer, cache in zip(self.layers, pool.layers):
            x = layer.cached(x, plan, cache)
        return stream_output(self, self.cfg, x, self.head, self.tp)

    def reference(self, input_ids: torch.Tensor) -> ForwardOutput:
        """Full recompute of one whole sequence with no cache: the oracle."""
        x = self._streams(input_ids)
        for layer in self.layers:
            x = layer.dense(x, input_ids)
        return stream_output(self, self.cfg, x, self.head, self.tp)
