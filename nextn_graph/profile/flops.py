"""Matmul-class FLOPs of an op; elementwise and reduction FLOPs are not counted.

``torch.utils.flop_counter.flop_registry`` gives them where it has the op (``mm``,
``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``, convolutions, SDPA). The rest are
formulas here, one per op:

- ``aten._grouped_mm(a, b, offs)``: every row of ``a`` meets one group's matrix, so
  2 x (output elements) x K; with ``a`` and ``b`` both 2-D the groups split K instead,
  2 x M x N x K over all groups.
- ``nextn_graph::grouped_mm(x, weight, offs)``, ``nextn_graph::quant_linear(x, weight,
  scale, ...)``, ``nextn_graph::quant_bmm(x [G, T, in], weight, ...)`` and
  ``nextn_graph::quant_grouped_mm(x, weight, scale, ..., offs, ...)``: 2 x rows x out x
  in = 2 x (output elements) x in, ``in`` the last dim of ``x`` (an FP4 weight stores
  in/2 bytes per row, so the weight's shape does not give it); their fused Triton forms
  (``nextn_graph::fused_*``, ``kernels/gemm.py``) alike.
- The sparse kernels (``sparse_attn``, ``index_scores``) are not counted: their FLOPs
  follow the per-row counts the meta device does not have, and at decode they are
  memory-bound (their bytes are counted by ``lengths.py``).
- ``aten.mv``: 2 x M x N; ``aten.dot``: 2 x N.
"""

from __future__ import annotations

from typing import Callable

from torch.utils.flop_counter import flop_registry

Flops = Callable[[tuple, dict, object], int]


def grouped_mm_flops(args: tuple, kwargs: dict, out) -> int:
    a, b = args[0], args[1]
    if a.dim() == 2 and b.dim() == 2:  # offs splits the contraction dim K
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    return 2 * out.numel() * a.shape[-1]


def quant_flops(args: tuple, kwargs: dict, out) -> int:
    """x [rows, in] @ W.T -> out [rows, out_features]."""
    return 2 * out.numel() * args[0].shape[-1]


def mv_flops(args: tuple, kwargs: dict, out) -> int:
    return 2 * args[0].numel()


def dot_flops(args: tuple, kwargs: dict, out) -> int:
    return 2 * args[0].numel()


FORMULAS: dict[str, Flops] = {
    "aten._grouped_mm": grouped_mm_flops,
    "nextn_graph.grouped_mm": quant_flops,
    "nextn_graph.quant_linear": quant_flops,
    "nextn_graph.quant_bmm": quant_flops,
    "nextn_graph.quant_grouped_mm": quant_flops,
    "nextn_graph.fused_grouped_mm": quant_flops,
    "nextn_graph.fused_quant_linear": quant_flops,
    "nextn_graph.fused_quant_bmm": quant_flops,
    "nextn_graph.fused_quant_grouped_mm": quant_flops,
    "aten.mv": mv_flops,
    "aten.dot": dot_flops,
}


def flop_rule(func) -> Flops | None:
    """The FLOP formula of an op, or None for an op whose FLOPs are not counted."""
    formula = FORMULAS.get(str(func.overloadpacket))
    if formula is not None:
        return formula
    registered = flop_registry.get(func.overloadpacket)
    if registered is None:
        return None

    def from_registry(args: tuple, kwargs: dict, out) -> int:
        return int(registered(*args, **kwargs, out_val=out))
    return from_registry
