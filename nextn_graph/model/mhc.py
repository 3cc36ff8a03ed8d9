"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams.

Streams are ``[T, hc, D]``. Around every sublayer, ``hc_pre`` mixes the streams
into one sublayer input and yields ``post`` [T, hc] and the doubly stochastic
``comb`` [T, hc, hc]; ``hc_post`` writes ``X_new[j] = post[j]*out + sum_i
comb[i, j] * X[i]`` (that is ``C^T @ X``: comb is not symmetric). ``hc_head``
collapses the streams before the final norm (sigmoid weights, no Sinkhorn).

Kernel economy (every layer runs two ``hc_pre``): sums that need ``+ eps`` are one
``baddbmm`` against a ones tensor (``beta=eps`` adds eps through that same tensor),
so a Sinkhorn normalisation is two kernels, sum and divide; the RMS factor scales
the projected mixes (``F.linear(x, fn) * rsqrt``, as DeepSeek's reference orders it)
and the per-group scale and base are one ``addcmul``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _sinkhorn(logits: torch.Tensor, iters: int, eps: float, ones: torch.Tensor) -> torch.Tensor:
    """``sinkhorn`` with a ones tensor [1, hc, 1] of the logits' dtype."""
    t, hc, _ = logits.shape
    rows_in, cols_in = ones, ones.transpose(1, 2)  # [1, hc, 1], [1, 1, hc]
    row_vec, col_vec = ones.expand(t, hc, 1), cols_in.expand(t, 1, hc)

    def by_cols(c: torch.Tensor) -> torch.Tensor:  # c / (column sums + eps)
        return c / torch.baddbmm(cols_in, col_vec, c, beta=eps)  # sums: [T, 1, hc]

    def by_rows(c: torch.Tensor) -> torch.Tensor:  # c / (row sums + eps)
        return c / torch.baddbmm(rows_in, c, row_vec, beta=eps)  # sums: [T, hc, 1]

    comb = by_cols(logits.softmax(dim=-1) + eps)
    for _ in range(iters - 1):
        comb = by_cols(by_rows(comb))
    return comb


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, then alternate column / row normalisation (each dividing by
    the sums plus eps), ending on columns.

    logits: [T, hc, hc] -> [T, hc, hc] whose columns sum to 1 (rows nearly so).
    """
    return _sinkhorn(logits, iters, eps, logits.new_ones(1, logits.shape[1], 1))


def _mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           norm_eps: float, ones: torch.Tensor) -> torch.Tensor:
    """Weightless RMS over the flattened streams, the mixing projection, then per-row
    ``* scale + base``: x [T, hc, D] -> [T, rows of fn]. ``scale`` [rows of fn] or [1];
    ``ones``: a ones tensor [1, n, 1] of fp32 (its first element adds ``norm_eps``)."""
    flat = x.flatten(1).float()  # [T, hc*D]
    # mean of squares + eps in one kernel: a row-by-itself product scaled by 1/n
    ms = torch.baddbmm(ones[:, :1], flat.unsqueeze(1), flat.unsqueeze(2), beta=norm_eps,
                       alpha=1.0 / flat.shape[1])  # [T, 1, 1]
    r = torch.rsqrt(ms).view(-1, 1) * scale  # [T, rows]: the RMS factor and the scales
    return torch.addcmul(base.float(), F.linear(flat, fn.float()), r)


@dataclass(frozen=True)
class HcConstants:
    """Constants of ``hc_pre``, made by a few kernels once per forward (a ``ForwardPlan``
    memo) instead of in every layer."""

    ones: torch.Tensor  # [1, hc, 1] fp32: Sinkhorn's summing vector, also the eps carrier
    gate_scale: torch.Tensor  # [2*hc] fp32: 1 for pre, 2 for post
    gate_shift: torch.Tensor  # [2*hc] fp32: hc_eps for pre, 0 for post

    @staticmethod
    def make(hc: int, hc_eps: float, device: torch.device) -> "HcConstants":
        scale = torch.ones(2 * hc, device=device)
        scale[hc:].fill_(2.0)
        shift = torch.zeros(2 * hc, device=device)
        shift[:hc].fill_(hc_eps)
        return HcConstants(torch.ones(1, hc, 1, device=device), scale, shift)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float,
           consts: HcConstants | None = None):
    """x: [T, hc, D] -> (sublayer input [T, D], post [T, hc], comb [T, hc, hc]).
    ``consts``: ``HcConstants.make(hc, hc_eps, x.device)``, made here if not given."""
    hc = x.shape[1]
    if consts is None:
        consts = HcConstants.make(hc, hc_eps, x.device)
    # the per-row scale: scale[0] for pre, [1] for post, [2] for the hc x hc comb logits
    scales = torch.cat((scale[0:1].expand(hc), scale[1:2].expand(hc),
                        scale[2:3].expand(hc * hc))).float()  # [(2+hc)*hc]
    mixes = _mixes(x, fn, scales, base, norm_eps, consts.ones)  # [T, (2+hc)*hc]
    # pre = sigmoid + hc_eps, post = 2 * sigmoid: one sigmoid, one affine, both exact
    gates = torch.addcmul(consts.gate_shift, torch.sigmoid(mixes[:, : 2 * hc]), consts.gate_scale)
    pre, post = gates[:, :hc], gates[:, hc:]
    comb = _sinkhorn(mixes[:, 2 * hc:].view(-1, hc, hc), sinkhorn_iters, hc_eps, consts.ones)
    y = torch.bmm(pre.unsqueeze(1), x.float()).squeeze(1)  # [T, D]: sum_i pre_i * x_i
    return y.to(x.dtype), post, comb


def hc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """out: [T, D], residual: [T, hc, D] -> new streams [T, hc, D]."""
    mixed = torch.bmm(comb.transpose(1, 2), residual.float())  # C^T @ X: [T, hc, D]
    new = torch.baddbmm(mixed, post.unsqueeze(-1), out.float().unsqueeze(1))  # + post (x) out
    return new.to(residual.dtype)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Collapse streams for the LM head: x [T, hc, D] -> [T, D]."""
    ones = torch.ones(1, 1, 1, device=x.device)
    pre = torch.sigmoid(_mixes(x, fn, scale.float(), base, norm_eps, ones)) + hc_eps  # [T, hc]
    return torch.bmm(pre.unsqueeze(1), x.float()).squeeze(1).to(x.dtype)
