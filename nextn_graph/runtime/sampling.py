"""Sampling that a static graph can hold: per-request parameters, counter-based
uniforms, filtered distributions and inverse-CDF draws, all plain tensor ops.

No host RNG and no generator state: a uniform is a hash of (request seed, position,
draft step, stream), computed with 32-bit integer mixing on int64 tensors. So a
replay draws fresh numbers without re-capture (the positions moved on), the value
one request gets never depends on which other requests share its batch or
bucket, and the same seed gives the same numbers eagerly and on every graph
backend. The CPU emulator keeps refusing RNG ops at capture; nothing here uses one.

Shapes: B requests, W positions per request (a verify window, or 1), V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError, show_value

SEED_LIMIT = 2**63  # seeds are int64 tensors
MASK32 = 0xFFFFFFFF
# Streams keep the uses of one (seed, position, step) apart.
DRAFT, ACCEPT, RESIDUAL, TARGET = 0, 1, 2, 3


@dataclass(frozen=True)
class SamplingParams:
    """Per request. ``temperature`` 0 is greedy decoding (the default, token for token
    what the engine has always done); ``top_k`` 0 and ``top_p`` 1 switch those off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def checked(self, where: str) -> "SamplingParams":
        """These values, or an ``InputError`` naming the bad one."""
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        if not _real(t) or not (math.isfinite(t) and t >= 0):
            raise InputError(f"{where}: temperature must be a finite number >= 0 (0 = greedy), "
                             f"got {show_value(t)}")
        if not _real(p) or not 0 < p <= 1:
            raise InputError(f"{where}: top_p must lie in (0, 1], got {show_value(p)}")
        if not _integer(k) or k < 0:
            raise InputError(f"{where}: top_k must be an integer >= 0 (0 = off), got "
                             f"{show_value(k)}")
        if not _integer(s) or not 0 <= s < SEED_LIMIT:
            raise InputError(f"{where}: seed must be an integer in [0, 2**63), got "
                             f"{show_value(s)}")
        return SamplingParams(float(t), float(p), int(k), int(s))


def _real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- counter-based uniforms ----------------------------------------------------------------

def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of int64 tensors holding values in
    [0, 2**32): products wrap modulo 2**64, so their low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, position: torch.Tensor, step: int | torch.Tensor,
            stream: int) -> torch.Tensor:
    """U[0, 1) float32, one per element of the broadcast of ``seed`` [B, 1] (int64) and
    ``position`` [B, W] (int64): a function of (seed, position, step, stream) only."""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    key = _mix32((torch.as_tensor(step, device=position.device) * 4 + stream) & MASK32)
    h = _mix32(lo ^ _mix32(hi ^ _mix32((position & MASK32) ^ key)))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))  # 24 bits: exact in float32


# -- distributions and draws ---------------------------------------------------------------

def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """logits [..., V] fp32; temperature, top_k, top_p [...] per row -> probabilities
    [..., V] of the tempered distribution restricted to the top-k tokens and then to
    the smallest prefix (by probability) holding top_p of it, renormalised. Rows with
    temperature 0 get the one-hot argmax (greedy). Static shapes: a sort, no masks
    that change size."""
    v = logits.shape[-1]
    t = temperature.unsqueeze(-1)  # [..., 1]
    scaled = logits / torch.where(t > 0, t, torch.ones_like(t))
    order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = order.values.softmax(dim=-1)  # sorted, [..., V]
    rank = torch.arange(v, device=logits.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, v)).unsqueeze(-1)
    keep = rank < k
    probs = probs * keep
    probs = probs / probs.sum(dim=-1, keepdim=True)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above
    keep = keep & (before < top_p.unsqueeze(-1))  # the first token is always kept
    probs = probs * keep
    probs = probs / probs.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(probs).scatter(-1, order.indices, probs)
    greedy = torch.zeros_like(out).scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(t > 0, out, greedy)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: probs [..., V] (need not be normalised), u [...] in [0, 1) -> ids
    [...] int64. Tokens of zero mass are never drawn."""
    cdf = probs.cumsum(dim=-1)
    target = u.unsqueeze(-1) * cdf[..., -1:]
    idx = (cdf <= target).sum(dim=-1)  # tokens whose cumulative mass is passed
    return idx.clamp(max=probs.shape[-1] - 1)
