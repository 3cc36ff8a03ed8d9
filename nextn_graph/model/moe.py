"""Mixture of experts: sqrt-softplus router with selection bias, hash-routed first
layers, a shared expert, clamped SwiGLU.

Routing is dense masked math (every expert runs on every row, weighted by a
[T, E] matrix that is zero off the chosen experts): no ``bincount().tolist()``,
no data-dependent shapes, so it captures into a static graph. At tiny widths this
costs less than the host round trip it avoids.

Under expert parallelism rank r holds routed experts [r*E/tp, (r+1)*E/tp) only (the
others are ``None`` in ``experts``, so keys keep their global index), sums them over
every row, and one fp32 all-reduce adds the ranks' sums; the gate and the shared
expert are replicated, as in DeepSeek-V4's reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.group import TPGroup
from .config import ModelConfig


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)  # gate
        self.w2 = nn.Linear(inter, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, inter, bias=False)  # up
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return self.w2((F.silu(gate) * up).to(x.dtype))


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.topk, self.scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.hashed = hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:  # the first layers route by token id through a fixed table
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> routing weights [T, E], zero off the chosen experts."""
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()  # [T, E]
        if self.hashed:
            chosen = self.tid2eid[input_ids]  # [T, k]
        else:  # the bias steers selection only; weights use the raw scores
            chosen = (scores + self.bias.float()).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        return torch.zeros_like(scores).scatter(1, chosen, weights)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate = Gate(cfg, hashed)
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        start, n = tp.part(cfg.n_routed_experts, "n_routed_experts")
        self.local = range(start, start + n)  # this rank's experts, by global index
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, inter, limit) if e in self.local else None
            for e in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, inter * cfg.n_shared_experts, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]: the routed experts' weighted sum, then the shared expert."""
        route = self.gate(x, input_ids)  # [T, E]
        routed = None
        for e in self.local:
            y = route[:, e:e + 1] * self.experts[e](x).float()  # [T, D] fp32
            routed = y if routed is None else routed + y
        routed = self.tp.all_reduce(routed)  # every rank's experts (fp32)
        return (routed + self.shared_experts(x).float()).to(x.dtype)
