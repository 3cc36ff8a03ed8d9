"""Grouped and quantized GEMMs as custom ops, each ONE kernel to every graph backend,
to Dynamo and to the ``meta`` device (``torch.library``).

- ``nextn_graph::grouped_mm(x, weight, offs)``: rows of ``x [A, in]`` sorted by group,
  group g = rows ``offs[g-1]..offs[g]`` times ``weight[g]`` (``[G, out, in]``) ->
  ``[A, out]``; rows past ``offs[-1]`` are left undefined (the caller masks them).
  Empty groups are not read.
- ``nextn_graph::quant_grouped_mm(x, weight, scale, fp4_values, offs, fmt, in_features)``:
  the same on stored FP8 / packed FP4 bits and their scales.
- ``nextn_graph::quant_linear(x, weight, scale, fp4_values, fmt, in_features)``:
  ``x [*, in] @ W.T`` with W the dequantized ``weight [out, in | in/2]``.
- ``nextn_graph::quant_bmm(x, weight, scale, fp4_values, fmt, in_features)``: a
  block-diagonal linear, ``x [G, T, in]`` times group g's ``weight[g]`` -> ``[G, T, out]``
  (attention's grouped ``wo_a``).

The quantized ops keep the weight as stored until the kernel needs its values: a fused
dequant-GEMM is what a device kernel does (Ascend's grouped matmul with antiquant
scales, DeepGEMM on CUDA), and the work profile counts them so.
The implementations here are references, exact by construction: they dequantize the
blocks a GEMM needs (never the whole stacked tensor of experts; no int64 temporaries)
and run the very GEMM a dequantized model runs, so ``weights: quantized`` is bitwise
``weights: dequantized``. On the host the grouped op dequantizes only the groups that
have rows (a CPU kernel may read its own offsets); on a device, where no host read is
allowed inside a graph, it dequantizes a static ``min(A, G)`` groups: those with rows,
padded. The fused device kernels are ``gemm.py``'s (the ``triton`` set calls them); on a
device the work profile counts each of these reference ops as the decomposition a device
runs (``registry.py``), not as one kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

FP8_BLOCK = 128  # the release's weight_block_size
FP4_BLOCK = 32  # FP4 inputs per scale


def scale_values(scale: Tensor) -> Tensor:
    """Stored scale bits (uint8 e8m0, or int32 holding fp32) -> fp32 powers of two."""
    if scale.dtype == torch.int32:
        return scale.view(torch.float32)
    return scale.view(torch.float8_e8m0fnu).float()


def _fp4_pairs(fp4_values: Tensor) -> Tensor:
    """The two e2m1 values of every byte, low nibble first: [256, 2] fp32."""
    return torch.stack((fp4_values.repeat(16), fp4_values.repeat_interleave(16)), dim=-1)


def dequantize(fmt: str, weight: Tensor, scale: Tensor, out: int, inp: int,
               fp4_values: Tensor, dtype: torch.dtype) -> Tensor:
    """W [..., out, in] in ``dtype`` from stored bits [..., out, in | in/2] and scales
    [..., ceil(out/128), ceil(in/128) | in/32]; exact in fp32 and bf16. Leading dims are
    groups (stacked experts). Temporaries: the int32 byte codes and the fp32 values."""
    lead = weight.shape[:-2]
    s = scale_values(scale)
    if fmt == "fp8":
        w = weight.view(torch.float8_e4m3fn).float()  # [..., out, in]
        so, si = s.shape[-2:]
        if out == so * FP8_BLOCK and inp == si * FP8_BLOCK:  # whole blocks: no expanded scale
            w = w.view(*lead, so, FP8_BLOCK, si, FP8_BLOCK) * s[..., :, None, :, None]
            return w.view(*lead, out, inp).to(dtype)
        block = s[..., :, None, :, None].expand(*lead, so, FP8_BLOCK, si, FP8_BLOCK)
        block = block.reshape(*lead, so * FP8_BLOCK, si * FP8_BLOCK)[..., :out, :inp]
        return (w * block).to(dtype)
    values = _fp4_pairs(fp4_values)[weight.int()]  # [..., out, in/2, 2]
    values = values.view(*lead, out, inp // FP4_BLOCK, FP4_BLOCK) * s[..., None]
    return values.view(*lead, out, inp).to(dtype)


def grouped_mm(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """Float grouped GEMM: x [A, in] sorted by group, weight [G, out, in], offs [G] int32
    group ends -> [A, out] (rows past ``offs[-1]`` undefined). One ``nextn_graph::grouped_mm``
    kernel; with autograd on (training: eager, never captured), a differentiable loop."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _looped_mm(x, weight, offs)
    return float_grouped_mm(x, weight, offs)


def _looped_mm(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """One matmul per group with rows, offsets read on the host; rows past the last
    group are zeros. For training only (``torch._grouped_mm`` has no CPU backward)."""
    parts, start = [], 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            parts.append(x[start:end] @ weight[g].transpose(0, 1))
        start = end
    parts.append(x.new_zeros(x.shape[0] - start, weight.shape[1]))
    return torch.cat(parts)


@torch.library.custom_op("nextn_graph::grouped_mm", mutates_args=())
def float_grouped_mm(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm`` reads each group's weight once and skips empty groups; it runs
    on the host in any float dtype and on CUDA in bf16 from sm90. Elsewhere (CUDA fp32,
    older GPUs, NPU) each row's group weight is gathered for a batched matmul: exact, but
    it reads one weight per row, so it is the fallback only. (An op of its own: Dynamo's
    fake ``_grouped_mm`` takes bf16 only, whatever the device.)"""
    if _native_grouped(x):
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
    return _gathered_mm(x, weight, offs)


@float_grouped_mm.register_fake
def _(x, weight, offs):
    return x.new_empty(x.shape[0], weight.shape[1])


def _gathered_mm(x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    a = x.shape[0]
    rows = torch.arange(a, device=x.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True).clamp(max=weight.shape[0] - 1)  # [A]
    return torch.bmm(weight[group], x.unsqueeze(-1)).squeeze(-1)


def _native_grouped(x: Tensor) -> bool:
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


@torch.library.custom_op("nextn_graph::quant_linear", mutates_args=())
def quant_linear(x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor, fmt: str,
                 in_features: int) -> Tensor:
    return dequant_linear(x, weight, scale, fp4_values, fmt, in_features)


def dequant_linear(x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor, fmt: str,
                   in_features: int) -> Tensor:
    """``quant_linear``'s body: the whole weight dequantized, then the GEMM."""
    w = dequantize(fmt, weight, scale, weight.shape[0], in_features, fp4_values, x.dtype)
    return F.linear(x, w)


@quant_linear.register_fake
def _(x, weight, scale, fp4_values, fmt, in_features):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("nextn_graph::quant_bmm", mutates_args=())
def quant_bmm(x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor, fmt: str,
              in_features: int) -> Tensor:
    return dequant_bmm(x, weight, scale, fp4_values, fmt, in_features)


def dequant_bmm(x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor, fmt: str,
                in_features: int) -> Tensor:
    """``quant_bmm``'s body."""
    w = dequantize(fmt, weight, scale, weight.shape[1], in_features, fp4_values, x.dtype)
    return torch.bmm(x, w.transpose(1, 2))


@quant_bmm.register_fake
def _(x, weight, scale, fp4_values, fmt, in_features):
    return x.new_empty(x.shape[0], x.shape[1], weight.shape[1])


@torch.library.custom_op("nextn_graph::quant_grouped_mm", mutates_args=())
def quant_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor,
                     offs: Tensor, fmt: str, in_features: int) -> Tensor:
    return grouped_dequant_mm(x, weight, scale, fp4_values, offs, fmt, in_features,
                              static=x.device.type != "cpu")


def grouped_dequant_mm(x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor,
                       offs: Tensor, fmt: str, in_features: int, static: bool,
                       mm=None) -> Tensor:
    """``quant_grouped_mm``'s body. ``static``: dequantize ``min(A, G)`` groups, those
    with rows first (ascending), then padding groups with none (no host read: what a
    graph on a device can hold); else exactly the groups with rows (read on the host).
    ``mm(x, w, ends)``: the float grouped GEMM run on them (``float_grouped_mm``)."""
    g, out = weight.shape[0], weight.shape[1]
    counts = torch.diff(offs, prepend=offs.new_zeros(1))  # [G] rows per group
    if static:
        active = torch.argsort((counts == 0).to(torch.uint8), stable=True)[: min(x.shape[0], g)]
    else:
        active = torch.nonzero(counts).flatten()  # [U] ascending
        if active.numel() == 0:
            return x.new_zeros(x.shape[0], out)
    w = dequantize(fmt, weight[active], scale[active], out, in_features, fp4_values, x.dtype)
    # each active group's end; a padding group (no rows) ends where the last one does
    ends = torch.where(counts[active] > 0, offs[active], offs[-1])  # [U]
    return (mm or float_grouped_mm)(x, w, ends)


@quant_grouped_mm.register_fake
def _(x, weight, scale, fp4_values, offs, fmt, in_features):
    return x.new_empty(x.shape[0], weight.shape[1])
