"""RMS norm and RoPE: the model's references and their fused ops, ONE kernel each.

- ``nextn_graph::rms_norm(x, weight, eps)``: ``x * rsqrt(mean(x^2) + eps)`` over the
  last dim, times ``weight`` when given (``RMSNorm.forward``; weightless: ``rms_norm``).
  The reference takes three kernels (``baddbmm``, ``rsqrt``, a multiply) and a fourth
  for the weight.
- ``nextn_graph::q_kv_norm_rope(q, kv, kv_weight, eps, rot)``: the middle of
  ``Attention._project``: q's H heads (weightless) and the kv row (times ``kv_weight``)
  RMS-normed, then all H+1 rows rotated by ``rot``, without the reference's cat, in-place
  multiply, slices, or its seven kernels.
- ``nextn_graph::rope(x, rot, inverse)``: ``apply_rope`` (two kernels there).

The references are the model's code verbatim (``model/ops.py``, ``Attention._project``):
the host's kernels and the fused ops' oracle. The fused ops compute in fp32 and round
once to the output dtype (the input's: ``x.dtype``, ``q.dtype``, where the reference
would promote a bf16 input with an fp32 ``rot`` or weight); a bf16 reference rounds
after every op, so the two differ by a few bf16 ULPs (the tests state how many).
Inputs are contiguous in the model; the ops make them so otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

TILE = 4096  # elements of a program's tile in the rotating kernels (rows x pairs)


def rms_norm(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Weightless RMS norm over the last dim: ``x * rsqrt(mean(x^2) + eps)``, three
    kernels: the mean of squares plus ``eps`` (a one-element tensor, e.g. an
    ``RMSNorm.eps_tensor``) is one ``baddbmm`` of each row with itself."""
    d = x.shape[-1]
    rows = x.reshape(-1, 1, d)  # [N, 1, d]
    ms = torch.baddbmm(eps.to(x.dtype), rows, rows.transpose(1, 2), alpha=1.0 / d)  # [N, 1, 1]
    return x * torch.rsqrt(ms).view(*x.shape[:-1], 1)


def apply_rope(x: torch.Tensor, rot: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` by ``rot`` (``RopeTable.rotation``): two kernels,
    a multiply and a sum over each pair, for the whole width (no slice / stack / cat).

    x: [T, ..., d]; rot: [T, d/2, 2, 2] (broadcast over the middle dims). Each output is
    ``x0*cos - x1*sin`` / ``x0*sin + x1*cos`` computed as before (a two-term sum), so the
    result equals the slice-and-stack rotation bitwise, up to the sign of zeros.
    ``inverse``: rotate back (the transposed rotation).
    """
    if inverse:
        rot = rot.transpose(-1, -2)
    for _ in range(x.dim() - 2):  # broadcast over the middle (head) dims
        rot = rot.unsqueeze(1)
    pairs = x.unflatten(-1, (-1, 2)).unsqueeze(-1)  # [T, ..., d/2, 2 (in), 1]
    return (pairs * rot).sum(dim=-2).flatten(-2)  # [T, ..., d]


def q_kv_norm_rope(q: Tensor, kv: Tensor, kv_weight: Tensor, eps_tensor: Tensor,
                   rot: Tensor) -> tuple[Tensor, Tensor]:
    """``Attention._project``'s norms and RoPE: q [T, H, hd], kv [T, hd], kv_weight [hd]
    (``kv_norm.weight``), eps_tensor (``kv_norm.eps_tensor``), rot [T, hd/2, 2, 2]
    -> (q [T, H, hd], kv [T, hd]), views of one [T, H+1, hd] result."""
    heads = rms_norm(torch.cat((q, kv.unsqueeze(1)), dim=1), eps_tensor)  # [T, H+1, hd]
    heads[:, -1].mul_(kv_weight)
    heads = apply_rope(heads, rot)  # [T, H+1, hd]
    return heads[:, :-1], heads[:, -1]


def _pow2(n: int) -> int:
    """The least power of two >= n (>= 1): Triton's block sizes."""
    return 1 << max(n - 1, 0).bit_length()


def _warps(tile: int) -> int:
    return 8 if tile >= 4096 else 4


@triton_op("nextn_graph::rms_norm", mutates_args=())
def rms_norm_fused(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x [..., d] (last dim contiguous), weight [d] or None -> [..., d] in x.dtype:
    ``rms_norm(x, eps) * weight``. One program per row, the row in one block (d up to
    the hidden width, 4096)."""
    from . import triton_norm as tk  # Triton is optional: imported when a fused kernel runs

    d = x.shape[-1]
    rows = x.reshape(-1, d)  # [N, d]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [..., d]
    block = _pow2(d)
    w = rows if weight is None else weight  # [d]; unread without a weight
    wrap_triton(tk.rms_norm_kernel)[(rows.shape[0],)](
        rows, w, out, eps, d, rows.stride(0), HAS_WEIGHT=weight is not None,
        BLOCK_D=block, num_warps=_warps(block))
    return out


@rms_norm_fused.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@triton_op("nextn_graph::q_kv_norm_rope", mutates_args=())
def q_kv_norm_rope_fused(q: Tensor, kv: Tensor, kv_weight: Tensor, eps: float,
                         rot: Tensor) -> tuple[Tensor, Tensor]:
    """q [T, H, hd], kv [T, hd], kv_weight [hd], rot [T, hd/2, 2, 2] -> (q [T, H, hd],
    kv [T, hd]) in q.dtype: ``q_kv_norm_rope`` with ``eps`` as a float. One program per
    token and block of up to TILE / (hd/2) of the H+1 rows, rot read once a program."""
    from . import triton_norm as tk  # Triton is optional: imported when a fused kernel runs

    t, h, hd = q.shape
    q, kv, rot = q.contiguous(), kv.contiguous(), rot.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, H, hd]
    kv_out = torch.empty(kv.shape, dtype=q.dtype, device=q.device)  # [T, hd]
    block_p = _pow2(hd // 2)
    block_h = min(_pow2(h + 1), max(TILE // block_p, 1))
    grid = (t, (h + block_h) // block_h)  # ceil((H+1) / block_h)
    wrap_triton(tk.q_kv_norm_rope_kernel)[grid](
        q, kv, kv_weight, rot, q_out, kv_out, eps, h, hd // 2,
        BLOCK_H=block_h, BLOCK_P=block_p, num_warps=_warps(block_h * block_p))
    return q_out, kv_out


@q_kv_norm_rope_fused.register_fake
def _(q, kv, kv_weight, eps, rot):
    return q.new_empty(q.shape), q.new_empty(kv.shape)


@triton_op("nextn_graph::rope", mutates_args=())
def rope_fused(x: Tensor, rot: Tensor, inverse: bool) -> Tensor:
    """x [T, ..., d], rot [T, d/2, 2, 2] -> [T, ..., d] in x.dtype: ``apply_rope``. The
    middle dims are M rows per token; one program per token and block of them."""
    from . import triton_norm as tk  # Triton is optional: imported when a fused kernel runs

    x, rot = x.contiguous(), rot.contiguous()
    t, d = x.shape[0], x.shape[-1]
    m = x.numel() // (t * d) if t * d else 0  # middle rows per token (1 for [T, d])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # [T, ..., d]
    block_p = _pow2(d // 2)
    block_m = min(_pow2(m), max(TILE // block_p, 1))
    grid = (t, (m + block_m - 1) // block_m)
    wrap_triton(tk.rope_kernel)[grid](
        x, rot, out, m, d // 2, INVERSE=inverse, BLOCK_M=block_m, BLOCK_P=block_p,
        num_warps=_warps(block_m * block_p))
    return out


@rope_fused.register_fake
def _(x, rot, inverse):
    return x.new_empty(x.shape)
