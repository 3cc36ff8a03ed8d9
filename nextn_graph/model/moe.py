"""Mixture of experts: sqrt-softplus router with selection bias, hash-routed first
layers, a shared expert, clamped SwiGLU.

Sparse with static shapes. T rows x top-k give A = T*k assignments; they are sorted
by expert (one sort, static shape), each expert's rows are multiplied by its weights
in one grouped GEMM per projection over the local experts' stacked weights
(``experts.py``), and the results are weighted and summed back per row in top-k
order. No host sync and no data-dependent shape, so it captures on every backend;
the work follows the experts that have rows (at most A), not ``n_routed_experts``.

Under expert parallelism rank r holds routed experts [r*E/tp, (r+1)*E/tp) only (the
others are ``None`` in ``experts``, so keys keep their global index). Assignments to
another rank's experts sort after the local ones, outside every group, and add
zero; one fp32 all-reduce adds the ranks' sums. The gate and the shared expert are
replicated, as in DeepSeek-V4's reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.group import TPGroup
from .config import ModelConfig
from .experts import stack_projection


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Clamped SwiGLU of fp32 gate and up projections."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)  # gate
        self.w2 = nn.Linear(inter, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, inter, bias=False)  # up
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = swiglu(self.w1(x).float(), self.w3(x).float(), self.limit)
        return self.w2(act.to(x.dtype))


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

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        """x: [T, D] -> (chosen experts [T, k] int64, their weights [T, k] fp32)."""
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()  # [T, E]
        if self.hashed:
            chosen = self.tid2eid[input_ids]  # [T, k]
        else:  # the bias steers selection only; weights use the raw scores
            chosen = (scores + self.bias.float()).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.gate = Gate(cfg, hashed)
        inter, self.limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        start, n = tp.part(cfg.n_routed_experts, "n_routed_experts")
        self.local = range(start, start + n)  # this rank's experts, by global index
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, inter, self.limit) if e in self.local else None
            for e in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, inter * cfg.n_shared_experts, self.limit)
        self.pack()

    def pack(self) -> None:
        """Stack the local experts' w1, w2, w3 (see ``experts.py``); called after build
        and after every ``_apply``, so a stack never outlives the tensors it holds."""
        local = [self.experts[e] for e in self.local]
        self.stacks = {name: stack_projection([getattr(m, name) for m in local],
                                              f"routed experts' {name}")
                       for name in ("w1", "w2", "w3")}

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.pack()
        return out

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]: the routed experts' weighted sum, then the shared expert."""
        chosen, weights = self.gate(x, input_ids)  # [T, k] each
        routed = self.tp.all_reduce(self._routed(x, chosen, weights))  # every rank's (fp32)
        return (routed + self.shared_experts(x).float()).to(x.dtype)

    def _routed(self, x: torch.Tensor, chosen: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts over the T*k assignments -> [T, D] fp32."""
        t, k = chosen.shape
        n = len(self.local)
        key = chosen.flatten()  # [A] expert of each assignment
        if self.tp.parallel:  # another rank's experts sort last, outside every group
            key = key - self.local.start
            key = torch.where((key >= 0) & (key < n), key, n)
        key, order = key.sort(stable=True)  # [A]: by expert
        groups = torch.arange(n, device=x.device)
        offs = torch.searchsorted(key, groups, right=True, out_int32=True)  # [n] group ends
        xs = x[order // k]  # [A, D] each assignment's row
        s = self.stacks
        act = swiglu(s["w1"](xs, offs).float(), s["w3"](xs, offs).float(), self.limit)
        ys = s["w2"](act.to(x.dtype), offs).float()  # [A, D]; rows past offs[-1] undefined
        ys = ys * weights.flatten()[order].unsqueeze(1)
        if self.tp.parallel:  # (NaN-safe: the undefined rows are replaced, not scaled)
            ys = torch.where((key < n).unsqueeze(1), ys, 0.0)
        y = torch.empty_like(ys).index_copy_(0, order, ys)  # back in (row, top-k) order
        return y.view(t, k, -1).sum(dim=1)
