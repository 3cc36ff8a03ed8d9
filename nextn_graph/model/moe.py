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
from torch import nn

from ..labels import DEFER, MOE_GATE, MOE_ROUTED, MOE_SHARED, labelled
from ..parallel.group import TPGroup
from .config import ModelConfig
from .experts import stack_projection
from .ops import UsesKernels


class Expert(UsesKernels, nn.Module):
    profile_label = DEFER  # its MoE's: routed, or shared (MoE._shared)

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)  # gate
        self.w2 = nn.Linear(inter, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, inter, bias=False)  # up
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.kernels.swiglu(self.w1(x), self.w3(x), self.limit))


class Gate(UsesKernels, nn.Module):
    profile_label = MOE_GATE

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
        # the hash layers route by token id; the others by biased top-k (the bias steers
        # selection only; weights use the raw scores)
        chosen = self.tid2eid[input_ids] if self.hashed else None  # [T, k]
        return self.kernels.moe_gate(x, self.weight, None if self.hashed else self.bias,
                                     chosen, self.topk, self.scale)


class MoE(UsesKernels, nn.Module):
    profile_label = MOE_ROUTED

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
        dtype = self.gate.weight.dtype  # the model's (W8A8: the down GEMM's output)
        self.stacks = {name: stack_projection([getattr(m, name) for m in local],
                                              f"routed experts' {name}",
                                              dtype if name == "w2" else torch.float32)
                       for name in ("w1", "w2", "w3")}

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.pack()
        return out

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, D] -> [T, D]: the routed experts' weighted sum, then the shared expert."""
        chosen, weights = self.gate(x, input_ids)  # [T, k] each
        routed = self.tp.all_reduce(self._routed(x, chosen, weights))  # every rank's (fp32)
        # one add in fp32 (the bf16 shared output promoted exactly, no copy of its own)
        return torch.add(routed, self._shared(x)).to(x.dtype)

    @labelled(MOE_SHARED)
    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert: x [T, D] -> [T, D]. A method of its own for its label (the
        expert defers to its caller)."""
        return self.shared_experts(x)

    def _routed(self, x: torch.Tensor, chosen: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts over the T*k assignments -> [T, D] fp32."""
        k, n, kern = chosen.shape[1], len(self.local), self.kernels
        # [A] by expert, [n] int32 group ends; another rank's experts sort last, outside
        # every group
        order, offs, aux = kern.moe_route(chosen, n, self.local.start, self.tp.parallel)
        xs = x[order // k]  # [A, D] each assignment's row
        s = self.stacks
        act = kern.swiglu(s["w1"](xs, offs, kern), s["w3"](xs, offs, kern), self.limit)
        ys = s["w2"](act, offs, kern)  # [A, D]; rows past offs[-1] undefined
        return kern.moe_combine(ys, order, aux, weights, offs, n,
                                self.tp.parallel)  # [T, D] fp32
