"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams.

Streams are ``[T, hc, D]``. Around every sublayer, ``hc_pre`` mixes the streams
into one sublayer input and yields ``post`` [T, hc] and the doubly stochastic
``comb`` [T, hc, hc]; ``hc_post`` writes ``X_new[j] = post[j]*out + sum_i
comb[i, j] * X[i]`` (that is ``C^T @ X``: comb is not symmetric). ``hc_head``
collapses the streams before the final norm (sigmoid weights, no Sinkhorn).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ops import rms_norm


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax, then alternate column / row normalisation, ending on columns.

    logits: [T, hc, hc] -> [T, hc, hc] whose columns sum to 1 (rows nearly so).
    """
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Weightless RMS over the flattened streams, then the mixing projection."""
    flat = x.flatten(1).float()  # [T, hc*D]
    return F.linear(rms_norm(flat, norm_eps), fn.float())  # [T, rows of fn]


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """x: [T, hc, D] -> (sublayer input [T, D], post [T, hc], comb [T, hc, hc])."""
    hc = x.shape[1]
    mixes = _mixes(x, fn, norm_eps)  # [T, (2+hc)*hc]
    base = base.float()
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb_logits = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    comb = sinkhorn(comb_logits, sinkhorn_iters, hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=1)  # [T, D]
    return y.to(x.dtype), post, comb


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """out: [T, D], residual: [T, hc, D] -> new streams [T, hc, D]."""
    mixed = torch.einsum("tij,tid->tjd", comb, residual.float())  # C^T @ X
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(residual.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Collapse streams for the LM head: x [T, hc, D] -> [T, D]."""
    pre = torch.sigmoid(_mixes(x, fn, norm_eps) * scale[0] + base.float()) + hc_eps  # [T, hc]
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
