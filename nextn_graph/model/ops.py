"""Small numeric building blocks shared by the target and the NextN draft.

Everything here is capture-safe: static shapes, no host syncs, no data-dependent
branches. Tensors are fp32 or the model dtype; shape comments use T = rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps) * self.weight


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMS norm over the last dim."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


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
    the host even under a meta device: a streamed load builds the model on meta."""

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

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]  # [..., rd/2] each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of the last ``2*cos.shape[-1]`` dims of ``x``.

    x: [T, ..., d]; cos/sin: [T, rd/2] (broadcast over the middle dims).
    """
    rd = 2 * cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rot = x[..., :-rd], x[..., -rd:]
    x0, x1 = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated), dim=-1)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor,
                   sink: torch.Tensor, scale: float) -> torch.Tensor:
    """MQA over a per-row key set with a per-head attention sink in the denominator.

    q: [T, H, d]; keys: [T, K, d] (K = V, one shared head); valid: [T, K] bool;
    sink: [H]. Returns [T, H, d].
    """
    scores = torch.einsum("thd,tkd->thk", q, keys) * scale  # [T, H, K]
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_col = sink.to(scores.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.cat((scores, sink_col), dim=-1).softmax(dim=-1)[..., :-1]  # [T, H, K]
    return torch.einsum("thk,tkd->thd", probs, keys)


def pool_softmax(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling over candidates, per channel: [..., C, d] -> [..., d]."""
    return (kv * score.softmax(dim=-2)).sum(dim=-2)
