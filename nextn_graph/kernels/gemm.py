"""Fused GEMMs on the stored FP8 / FP4 bits, and a float grouped GEMM (Triton).

The same arguments as the references in ``qgemm.py`` (``dequant_linear``, ``dequant_bmm``,
``grouped_dequant_mm``, ``float_grouped_mm``), so a kernel set swaps one for the other:

- ``fused_quant_linear(x [*, in], weight, scale, fp4_values, fmt, in_features)`` -> [*, out]
- ``fused_quant_bmm(x [G, T, in], weight [G, out, ..], scale [G, ..], ...)`` -> [G, T, out]
- ``fused_quant_grouped_mm(x [A, in], weight [G, out, ..], scale [G, ..], fp4_values,
  offs [G], fmt, in_features)`` -> [A, out]; rows past ``offs[-1]`` are zeros
- ``fused_grouped_mm(x [A, in], weight [G, out, in] fp32 | bf16, offs [G])`` -> [A, out],
  rows past ``offs[-1]`` zeros

Each is ONE launch of ``triton_gemm.qgemm_kernel``. Its grid is static: (N tiles, row
tiles, groups). A program owns one BLOCK_N slice of the outputs of one group and walks
K in steps of 128 (one fp8 scale block; four fp4 scales), loading the stored bytes and
decoding them in registers (fp8: a bitcast to e4m3, then fp32; fp4: the e2m1 nibble's
bits), times the block's power-of-two scale; no dequantized weight is ever written.
fp32 accumulation, the output in x's dtype. The linear and the bmm put row tiles in the
grid (group g's rows are g*T..(g+1)*T). The grouped ops give each group one program per N
tile that reads its rows' range from ``offs`` on the device and loops over it in BLOCK_M
tiles: a group with no rows exits at once, and a group whose rows fit one tile (every
decode step) reads its weight tile exactly once. The last group's programs zero the rows
past ``offs[-1]``. Nothing is read back to the host: every op captures in a CUDA graph.

Tiles. Decode is bandwidth-bound (the weight bytes), so the row tile is the least
``tl.dot`` takes (16) unless the rows need more (up to 64: prefill); BLOCK_N 64, narrowed
to 32 or 16 when fewer than ~2 programs per SM would run (``wkv`` [512, 4096] at
decode). There is no split over K (one launch, deterministic): a narrow linear at decode
runs as few as 32 programs. Under the interpreter (a program costs per op, a dot per
padded row) BLOCK_N is up to 2048 and the row tile the rows' power of two, from 1.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

MIN_ROWS = 16  # tl.dot's least M
MAX_ROWS = 64  # the largest row tile (prefill)
GPU_BLOCK_N = 64
MIN_BLOCK_N = 16
SM_PROGRAMS = 264  # programs to aim for on an H200: ~2 per SM (132)
INTERPRETED_BLOCK_N = 2048


def _pow2(n: int) -> int:
    """The least power of two >= n (tl.arange sizes)."""
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(n: int, block: int) -> int:
    return (n + block - 1) // block


def _block_m(x: Tensor, rows: int) -> int:
    """The row tile for ``rows`` rows a group (expected): 16..64 on a GPU (tl.dot's least
    M); from 1 under the interpreter, whose dot (numpy's matmul) costs per padded row."""
    least = MIN_ROWS if x.is_cuda else 1
    return min(MAX_ROWS, max(least, _pow2(rows)))


def _block_n(x: Tensor, n: int, tiles: int) -> int:
    """The output tile: BLOCK_N 64 on a GPU, halved (down to 16) while fewer than
    SM_PROGRAMS programs would run over ``tiles`` row tiles x groups; up to 2048 under the
    interpreter (fewer, wider programs: its cost is per op)."""
    if not x.is_cuda:
        return min(INTERPRETED_BLOCK_N, max(MIN_BLOCK_N, _pow2(n)))
    block = GPU_BLOCK_N
    while block > MIN_BLOCK_N and _cdiv(n, block) * tiles < SM_PROGRAMS:
        block //= 2
    return block


def _weight_kind(fmt: str) -> str:
    if fmt not in ("fp8", "fp4"):
        raise ValueError(f"unknown quantized format {fmt!r} (fp8 or fp4)")
    return fmt


def _launch(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor | None, kind: str,
            in_features: int, rows_per_group: int, groups: int) -> Tensor:
    """One qgemm_kernel launch: x [M, in] contiguous, weight [G, N, ..], scale [G, ..]
    (the weight itself for ``kind`` float), offs [G] int32 (grouped) or None (group g owns
    rows g*rows_per_group..) -> [M, N] in x.dtype."""
    from . import triton_gemm as tk  # Triton is optional: imported when a fused kernel runs

    m = x.shape[0]
    n = weight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0 or n == 0:
        return out
    weight, scale = weight.contiguous(), scale.contiguous()  # [G, N, ..], [G, ..]
    grouped = offs is not None
    block_m = _block_m(x, _cdiv(m, groups) if grouped else rows_per_group)
    row_tiles = 1 if grouped else _cdiv(rows_per_group, block_m)
    busy = min(m, groups) if grouped else row_tiles * groups  # programs with rows, at most
    block_n = _block_n(x, n, busy)
    si = scale.shape[-1] if kind != "float" else 0
    offs_in = offs.contiguous() if grouped else x  # [G] (unread when not grouped)
    wrap_triton(tk.qgemm_kernel)[(_cdiv(n, block_n), row_tiles, groups)](
        x, weight, scale, offs_in, out, m, n, in_features, rows_per_group, si, groups,
        weight[0].numel(), scale[0].numel(), WEIGHT=kind, GROUPED=grouped,
        DOT_LOW=x.is_cuda and x.dtype in (torch.bfloat16, torch.float16),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=tk.BLOCK_K)
    return out


@triton_op("nextn_graph::fused_quant_linear", mutates_args=())
def fused_quant_linear(x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor,
                       fmt: str, in_features: int) -> Tensor:
    """``dequant_linear``: x [*, in] @ W^T -> [*, out] in x.dtype, W the stored weight
    [out, in | in/2] times its scale [ceil(out/128), ceil(in/128)] | [out, in/32], decoded
    in registers. ``fp4_values`` is unused (the kernel decodes e2m1 from the bits)."""
    kind = _weight_kind(fmt)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features).contiguous()  # [M, in]
    out = _launch(x2, weight.unsqueeze(0), scale.unsqueeze(0), None, kind, in_features,
                  x2.shape[0], 1)
    return out.view(*lead, weight.shape[0])


@fused_quant_linear.register_fake
def _(x, weight, scale, fp4_values, fmt, in_features):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@triton_op("nextn_graph::fused_quant_bmm", mutates_args=())
def fused_quant_bmm(x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor, fmt: str,
                    in_features: int) -> Tensor:
    """``dequant_bmm``: x [G, T, in] times group g's W_g^T (weight [G, out, in | in/2],
    scale [G, ...]) -> [G, T, out] in x.dtype."""
    kind = _weight_kind(fmt)
    g, t, _ = x.shape
    x2 = x.contiguous().view(g * t, in_features)  # [G*T, in]
    out = _launch(x2, weight, scale, None, kind, in_features, t, g)
    return out.view(g, t, weight.shape[1])


@fused_quant_bmm.register_fake
def _(x, weight, scale, fp4_values, fmt, in_features):
    return x.new_empty(x.shape[0], x.shape[1], weight.shape[1])


@triton_op("nextn_graph::fused_quant_grouped_mm", mutates_args=())
def fused_quant_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor,
                           offs: Tensor, fmt: str, in_features: int) -> Tensor:
    """``grouped_dequant_mm``: rows of x [A, in] sorted by group, group g's rows
    offs[g-1]..offs[g] times W_g^T -> [A, out] in x.dtype; rows past offs[-1] zeros.
    Empty groups are not read."""
    kind = _weight_kind(fmt)
    return _launch(x.contiguous(), weight, scale, offs, kind, in_features, 0,
                   weight.shape[0])


@fused_quant_grouped_mm.register_fake
def _(x, weight, scale, fp4_values, offs, fmt, in_features):
    return x.new_empty(x.shape[0], weight.shape[1])


@triton_op("nextn_graph::fused_grouped_mm", mutates_args=())
def fused_grouped_mm(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """``float_grouped_mm``: x [A, in] sorted by group times weight[g]^T ([G, out, in], fp32
    or bf16) -> [A, out] in x.dtype, each active group's weight read once; rows past
    offs[-1] zeros."""
    weight = weight.contiguous()  # [G, out, in]
    return _launch(x.contiguous(), weight, weight, offs, "float", weight.shape[2], 0,
                   weight.shape[0])


@fused_grouped_mm.register_fake
def _(x, weight, offs):
    return x.new_empty(x.shape[0], weight.shape[1])
