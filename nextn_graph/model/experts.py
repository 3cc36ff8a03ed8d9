"""Routed experts packed for grouped GEMMs: one stacked tensor per projection.

The checkpoint keeps one tensor per expert (``ffn.experts.E.w1.weight``, with
``.scale`` when quantized), and so do the modules: every local expert's ``w1``,
``w2``, ``w3`` is an ``nn.Linear`` or a ``QuantLinear``. ``stack_projection`` copies
one projection of every local expert into one tensor ``[E_local, out, ...]`` and
rebinds each expert's tensor to its slice, so memory is not doubled, state-dict
keys do not change, and a ``load_state_dict`` writes straight into the stack.
``MoE`` re-stacks after every ``Module._apply`` (``.to()``, ``.cuda()``, ...), which
converts each expert's tensor on its own.

A stack is applied to rows sorted by expert: ``stack(x [A, in], offs [G])`` is one
grouped GEMM (``qgemm.grouped_mm``, or ``quant_grouped_mm`` on the stored bits), so
the work follows the experts that have rows, not how many experts exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..kernels.select import Kernels
from ..labels import MOE_ROUTED
from .quant import QuantLinear
from .w8a8 import W8A8Linear


@dataclass
class FloatStack:
    """One projection of every local expert as float weights [G, out, in]."""
    profile_label = MOE_ROUTED

    weight: Tensor  # [G, out, in]
    linears: list[nn.Linear]  # their ``weight`` params are views of ``weight``

    def __call__(self, x: Tensor, offs: Tensor, kernels: Kernels) -> Tensor:
        """x [A, in] sorted by expert, offs [G] int32 group ends -> [A, out]."""
        weight = self.weight
        if torch.is_grad_enabled() and any(m.weight.requires_grad for m in self.linears):
            # training: a differentiable stack of the parameters (the views' leaves)
            weight = torch.stack([m.weight for m in self.linears])
        return kernels.grouped_mm(x, weight, offs)


@dataclass
class QuantStack:
    """One projection of every local expert as stored bits and scales."""
    profile_label = MOE_ROUTED

    weight: Tensor  # [G, out, in | in/2] uint8
    scale: Tensor  # [G, ...] uint8 (e8m0) or int32 (fp32 bits)
    fp4_values: Tensor  # [16] the e2m1 table
    fmt: str
    in_features: int

    def __call__(self, x: Tensor, offs: Tensor, kernels: Kernels) -> Tensor:
        return kernels.quant_grouped_mm(x, self.weight, self.scale, self.fp4_values, offs,
                                        self.fmt, self.in_features)


@dataclass
class W8A8Stack:
    """One projection of every local expert as ModelSlim W8A8_DYNAMIC int8 weights: rows
    quantized per token in the op, an exact int32 GEMM, the scales in the epilogue. The
    first GEMM (gate, up) keeps fp32 for the fp32 SwiGLU; the second (down) gives the
    model dtype: Ascend's grouped W8A8 expert path."""
    profile_label = MOE_ROUTED

    weight: Tensor  # [G, out, in] int8
    scale: Tensor  # [G, out] fp32 (a view of the experts' stacked weight_scale bits)
    out_dtype: torch.dtype

    def __call__(self, x: Tensor, offs: Tensor, kernels: Kernels) -> Tensor:
        return kernels.w8a8_grouped_mm(x, self.weight, self.scale, offs, self.out_dtype)


Stack = FloatStack | QuantStack | W8A8Stack


def stack_projection(linears: list[nn.Module], what: str,
                     out_dtype: torch.dtype = torch.float32) -> Stack:
    """Stack one projection (``linears``: the same one of each local expert, in expert
    order) and rebind each module's tensors to slices of the stack. ``out_dtype``: a W8A8
    stack's output (fp32 for gate and up, the model's for down)."""
    if all(isinstance(m, W8A8Linear) for m in linears):
        shapes = {(m.in_features, m.out_features) for m in linears}
        if len(shapes) != 1:
            raise ValueError(f"{what}: the experts' W8A8 shapes differ: {sorted(shapes)}")
        _stack(linears, "weight_offset")
        scale = _stack(linears, "weight_scale").view(torch.float32)[..., 0]  # [G, out]
        return W8A8Stack(_stack(linears, "weight"), scale, out_dtype)
    if all(isinstance(m, QuantLinear) for m in linears):
        kinds = {(m.fmt, m.fp32_scale, m.in_features, m.out_features) for m in linears}
        if len(kinds) != 1:
            raise ValueError(f"{what}: the experts' quantized formats differ: {sorted(kinds)}")
        first = linears[0]
        return QuantStack(_stack(linears, "weight"), _stack(linears, "scale"),
                          first.fp4_values, first.fmt, first.in_features)
    if all(type(m) is nn.Linear for m in linears):
        return FloatStack(_stack(linears, "weight"), list(linears))
    kinds = sorted({type(m).__name__ for m in linears})
    raise ValueError(f"{what}: experts mix plain and quantized weights ({kinds})")


def _stack(modules: list[nn.Module], name: str) -> Tensor:
    """torch.stack of ``module.<name>`` over ``modules``; each becomes a view of it."""
    with torch.no_grad():
        stacked = torch.stack([getattr(m, name).detach() for m in modules])  # [G, ...]
    for i, m in enumerate(modules):
        old = getattr(m, name)
        if isinstance(old, nn.Parameter):
            m._parameters[name] = nn.Parameter(stacked[i], requires_grad=old.requires_grad)
        else:
            m._buffers[name] = stacked[i]
    return stacked
