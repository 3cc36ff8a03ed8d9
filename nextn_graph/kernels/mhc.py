"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams; the
references (the model's code verbatim, from ``model/mhc.py``: the CPU kernels and the
oracle) and their fused Triton ops.

Streams are ``[T, hc, D]``. Around every sublayer, ``hc_pre`` mixes the streams
into one sublayer input and yields ``post`` [T, hc] and the doubly stochastic
``comb`` [T, hc, hc]; ``hc_post`` writes ``X_new[j] = post[j]*out + sum_i
comb[i, j] * X[i]`` (that is ``C^T @ X``: comb is not symmetric). ``hc_head``
collapses the streams before the final norm (sigmoid weights, no Sinkhorn).

Kernel economy of the references (every layer runs two ``hc_pre``): sums that need
``+ eps`` are one ``baddbmm`` against a ones tensor (``beta=eps`` adds eps through that
same tensor), so a Sinkhorn normalisation is two kernels, sum and divide; the RMS factor
scales the projected mixes (``F.linear(x, fn) * rsqrt``, as DeepSeek's reference orders
it) and the per-group scale and base are one ``addcmul``.

The fused ops (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``; kernels in
``triton_mhc.py``), fp32 math, one rounding to the output dtype:

- ``nextn_graph::hc_pre``: 2 kernels. The projection of the flattened streams by ``fn``
  and their sum of squares, split over K (a partial per K-slice, summed in a fixed order:
  deterministic); then per row the gates, the Sinkhorn alternation of the hc x hc comb
  and the collapse ``y``, reading x again (the reference: ~50 kernels at 20 iterations).
- ``nextn_graph::hc_post``: 1 kernel (the reference: 2 GEMMs and the casts).
- ``nextn_graph::hc_head``: 2 kernels, the same two without post and Sinkhorn.

The mHC parameters may be fp32 or bf16 (upcast inside the kernels); x, out, residual,
post and comb are read through their strides (the first layer's streams are an expanded
embedding), fn, scale and base are parameters and contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import triton_op, wrap_triton

from ..labels import MHC

profile_label = MHC  # the references' ops; the fused ones are their callers' (labels.py)


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


# ---- fused ops -----------------------------------------------------------------------

BLOCK_T = 16  # rows of a projection program (tl.dot needs >= 16); of the others interpreted
BLOCK_K = 64  # K elements of a projection step
BLOCK_D = 512  # columns of a mixing / hc_post program on the GPU
INTERPRETED_TILE = 8192  # rows x columns of an interpreted collapse step / hc_post program
PROGRAMS = 128  # projection programs to aim for: about one per SM of an H200 (132)
MIN_STEPS = 4  # BLOCK_K steps a projection program makes at least (its setup amortised)
MAX_BLOCK_S = 64  # K-slices a mixing program sums per step


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _tiles(x: Tensor) -> tuple[int, int, int]:
    """(rows, cols, span) of the mixing and hc_post programs for streams x [T, hc, D]:
    ``rows`` rows side by side in [rows, hc, cols] tiles; a mixing program covers ``span``
    columns, ``cols`` at a time. On the GPU one row a program in [hc, 512] tiles (each thread
    then holds one row's hc x hc comb; rows side by side would put every row's in every
    thread: 255 registers and spills at 16 rows, by ptxas). Interpreted (CPU tensors), where
    a program costs per op whatever its tiles hold: up to BLOCK_T rows side by side, the
    row's columns in few wide steps, one mixing program per row block."""
    t, _, d = x.shape
    if x.is_cuda:
        return 1, BLOCK_D, BLOCK_D
    rows = min(BLOCK_T, _pow2(t))
    return rows, min(INTERPRETED_TILE // rows, _pow2(d)), _pow2(d)


def _project(tk, x: Tensor, fn: Tensor) -> tuple[Tensor, Tensor]:
    """Kernel 1: x [T, hc, D] by fn [N, hc*D] -> (part [S, T, N], sq [S, T]) fp32, the
    K-slices' projections and sums of squares. Decode (few row blocks) splits each stream
    into several slices so that ~PROGRAMS programs run; prefill has rows enough."""
    t, hc, d = x.shape
    n = fn.shape[0]
    blocks = _cdiv(t, BLOCK_T)
    per_stream = max(1, min(_cdiv(PROGRAMS, blocks * hc), _cdiv(d, BLOCK_K * MIN_STEPS)))
    d_chunk = _cdiv(_cdiv(d, per_stream), BLOCK_K) * BLOCK_K
    per_stream = _cdiv(d, d_chunk)  # no empty slice
    s = hc * per_stream
    part = torch.empty(s, t, n, dtype=torch.float32, device=x.device)  # [S, T, N]
    sq = torch.empty(s, t, dtype=torch.float32, device=x.device)  # [S, T]
    wrap_triton(tk.hc_project_kernel)[(blocks, s)](
        x, fn, part, sq, t, d, n, per_stream, d_chunk, x.stride(0), x.stride(1), x.stride(2),
        HC=hc, BLOCK_T=BLOCK_T, BLOCK_N=max(16, _pow2(n)), BLOCK_K=BLOCK_K)
    return part, sq


def _mix(tk, x: Tensor, part: Tensor, sq: Tensor, scale: Tensor, base: Tensor, y: Tensor,
         post: Tensor, comb: Tensor, iters: int, hc_eps: float, norm_eps: float,
         sinkhorn: bool) -> None:
    """Kernel 2: gates (and Sinkhorn) from the K-slices, then y = sum_i pre_i * x_i."""
    t, hc, d = x.shape
    s = part.shape[0]
    rows, cols, span = _tiles(x)
    wrap_triton(tk.hc_mix_kernel)[(_cdiv(t, rows), _cdiv(d, span))](
        x, part, sq, scale, base, y, post, comb, t, d, s, iters, 1.0 / (hc * d), hc_eps,
        norm_eps, x.stride(0), x.stride(1), x.stride(2), HC=hc, N=part.shape[2],
        SINKHORN=sinkhorn, BLOCK_T=rows, BLOCK_S=min(_pow2(s), MAX_BLOCK_S), BLOCK_D=span,
        CHUNK_D=cols)


@triton_op("nextn_graph::hc_pre", mutates_args=())
def hc_pre_fused(x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, sinkhorn_iters: int,
                 hc_eps: float, norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``hc_pre`` in 2 kernels: x [T, hc, D], fn [(2+hc)*hc, hc*D], scale [3], base
    [(2+hc)*hc] -> (y [T, D] x.dtype, post [T, hc] fp32, comb [T, hc, hc] fp32)."""
    from . import triton_mhc as tk  # Triton is optional: imported when a fused kernel runs

    t, hc, d = x.shape
    fn, scale, base = fn.contiguous(), scale.contiguous(), base.contiguous()
    part, sq = _project(tk, x, fn)  # [S, T, (2+hc)*hc], [S, T]
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)  # [T, D]
    post = torch.empty(t, hc, dtype=torch.float32, device=x.device)  # [T, hc]
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=x.device)  # [T, hc, hc]
    _mix(tk, x, part, sq, scale, base, y, post, comb, sinkhorn_iters, hc_eps, norm_eps, True)
    return y, post, comb


@hc_pre_fused.register_fake
def _(x, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps):
    t, hc, d = x.shape
    return (x.new_empty(t, d), x.new_empty(t, hc, dtype=torch.float32),
            x.new_empty(t, hc, hc, dtype=torch.float32))


@triton_op("nextn_graph::hc_post", mutates_args=())
def hc_post_fused(out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """``hc_post`` in 1 kernel: out [T, D], residual [T, hc, D], post [T, hc], comb
    [T, hc, hc] -> new streams [T, hc, D] residual.dtype."""
    from . import triton_mhc as tk  # Triton is optional: imported when a fused kernel runs

    t, hc, d = residual.shape
    new = torch.empty(t, hc, d, dtype=residual.dtype, device=residual.device)  # [T, hc, D]
    rows, cols, _ = _tiles(residual)
    wrap_triton(tk.hc_post_kernel)[(_cdiv(t, rows), _cdiv(d, cols))](
        out, residual, post, comb, new, t, d, out.stride(0), out.stride(1),
        residual.stride(0), residual.stride(1), residual.stride(2), post.stride(0),
        post.stride(1), comb.stride(0), comb.stride(1), comb.stride(2), HC=hc,
        BLOCK_T=rows, BLOCK_D=cols)
    return new


@hc_post_fused.register_fake
def _(out, residual, post, comb):
    return torch.empty_like(residual, memory_format=torch.contiguous_format)


@triton_op("nextn_graph::hc_head", mutates_args=())
def hc_head_fused(x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, hc_eps: float,
                  norm_eps: float) -> Tensor:
    """``hc_head`` in 2 kernels: x [T, hc, D], fn [hc, hc*D], scale [1], base [hc] ->
    [T, D] x.dtype."""
    from . import triton_mhc as tk  # Triton is optional: imported when a fused kernel runs

    t, hc, d = x.shape
    fn, scale, base = fn.contiguous(), scale.contiguous(), base.contiguous()
    part, sq = _project(tk, x, fn)  # [S, T, hc], [S, T]
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)  # [T, D]
    # no post / comb: the fp32 workspace stands in for those (unused) pointers
    _mix(tk, x, part, sq, scale, base, y, part, part, 1, hc_eps, norm_eps, False)
    return y


@hc_head_fused.register_fake
def _(x, fn, scale, base, hc_eps, norm_eps):
    return x.new_empty(x.shape[0], x.shape[2])
