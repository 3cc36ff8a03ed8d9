"""Small numeric building blocks shared by the target and the NextN draft.

Everything here is capture-safe: static shapes, no host syncs, no data-dependent
branches. Tensors are fp32 or the model dtype; shape comments use T = rows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.attention import mask_bias, sink_attention  # noqa: F401 (re-exported)
from ..kernels.select import REFERENCE, Kernels
from ..labels import NORM
from ..memory.batch import ForwardPlan
from .config import ModelConfig


class UsesKernels:
    """A module whose forward calls fused ops through ``self.kernels`` (the reference set
    until ``use_kernels`` gives its model another)."""

    kernels: Kernels = REFERENCE


def use_kernels(model: nn.Module, kernels: Kernels) -> None:
    """Give every kernel-using module of ``model`` the set ``kernels``."""
    for module in model.modules():
        if isinstance(module, UsesKernels):
            module.kernels = kernels


def kernels_of(model: nn.Module) -> Kernels:
    """The set a model runs (one for all its modules: ``use_kernels``)."""
    sets = {m.kernels.name: m.kernels for m in model.modules() if isinstance(m, UsesKernels)}
    if len(sets) != 1:
        raise ValueError(f"a model runs one kernel set, this one mixes {sorted(sets)}")
    return next(iter(sets.values()))


class RMSNorm(UsesKernels, nn.Module):
    profile_label = NORM

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # eps as a tensor makes mean(x^2) + eps one kernel (``rms_norm``); on the host
        # even under a meta device, like the RoPE tables (a load moves it with the model)
        self.register_buffer("eps_tensor", torch.full((1, 1, 1), eps, device="cpu"),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps, self.eps_tensor)


def _yarn_inv_freq(dim: int, base: float, cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies with YaRN interpolation (DeepSeek-V4 style) for ``dim`` rope dims.

    Applied whatever ``max_position_embeddings`` is, as V4's reference code and HF
    transformers' ``deepseek_v4`` do (``original_seq_len > 0``); skipping it when the
    context fits the original window was DeepSeek-V3's rule, and gave a checkpoint
    with a small ``max_position_embeddings`` other logits than both.
    """
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    y = cfg.rope_scaling

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(y.beta_fast)), 0)
    high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.arange(dim // 2, dtype=torch.float64, device="cpu")
    ramp = ((ramp - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp  # 1 keeps the original frequency, 0 interpolates by the factor
    return inv / y.factor * (1 - smooth) + inv * smooth


class RopeTable(nn.Module):
    """cos/sin tables indexed by absolute position (a gather, so capture-safe). Built on
    the host even under a meta device: a streamed load builds the model on meta. One per
    kind of layer (``RopeTables``), shared by every layer of that kind."""

    def __init__(self, cfg: ModelConfig, compressed: bool):
        super().__init__()
        dim = cfg.qk_rope_head_dim
        if compressed:  # C4 / C128 layers: compress_rope_theta with YaRN
            inv = _yarn_inv_freq(dim, cfg.compress_rope_theta, cfg)
        else:  # SWA-only layers and the NextN layer: base theta, no YaRN
            inv = 1.0 / (cfg.rope_theta ** (
                torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
        positions = torch.arange(cfg.max_position_embeddings, dtype=torch.float64, device="cpu")
        angles = torch.outer(positions, inv)
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # [P, rd/2]
        self.register_buffer("sin", angles.sin().float(), persistent=False)  # [P, rd/2]

    def rotation(self, positions: torch.Tensor, dim: int) -> torch.Tensor:
        """The 2x2 rotation of every pair of a ``dim``-wide vector at ``positions`` [...]:
        the identity on the leading ``dim - rd`` (no-RoPE) dims, RoPE on the last ``rd``.
        -> [..., dim/2, 2, 2]; ``rot[..., i, j]`` weighs a pair's input i into output j.
        Built once per forward and width (``ForwardPlan``), then used by ``apply_rope``."""
        c, s = self.cos[positions], self.sin[positions]  # [..., rd/2]
        nope = dim // 2 - c.shape[-1]
        if nope:  # identity pairs: cos 1, sin 0
            c, s = F.pad(c, (nope, 0), value=1.0), F.pad(s, (nope, 0), value=0.0)
        return torch.stack((c, s, -s, c), dim=-1).unflatten(-1, (2, 2))

    def at(self, plan: ForwardPlan, dim: int) -> torch.Tensor:
        """``rotation`` at the plan's positions: once per forward, table and width."""
        return plan.memo((self, dim), lambda: self.rotation(plan.batch.positions, dim))


class RopeTables(nn.Module):
    """A model's RoPE tables: base theta for sliding-window layers and the NextN layer,
    YaRN'd ``compress_rope_theta`` for C4 / C128 layers (built only if a layer has one).
    One table per kind instead of one per layer: at V4-Flash's 1M positions a table is
    256 MB of host memory, 43 layers' worth was 11 GB."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swa = RopeTable(cfg, compressed=False)
        if any(cfg.layer_ratio(i) for i in range(cfg.num_hidden_layers)):
            self.compressed = RopeTable(cfg, compressed=True)

    def for_ratio(self, ratio: int) -> RopeTable:
        return self.compressed if ratio else self.swa
