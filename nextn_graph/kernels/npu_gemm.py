"""The NPU set's GEMMs: torch_npu's ``npu_grouped_matmul`` where its doc's math is ours.

Each function takes ``ops`` (torch_npu's namespace, a fake in the CPU suite) and then the
arguments of the ``Kernels`` field it serves (``qgemm.py``'s signatures). The docs read and
why the other GEMMs are not mapped are in ``docs/kernels_npu.md``; in short (Ascend/op-plugin
``docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md``):

- ``grouped_mm``: ``npu_grouped_matmul([x], [weight^T], group_list=ends, split_item=3,
  group_type=0, group_list_type=0)``, the doc's "single x, single weight, single y" case:
  ``y[rows of g] = x[rows of g] @ weight_g`` with group g's rows ``ends[g-1]..ends[g]``
  (non-quantized: fp16, bf16, or fp32 with single tensors; ``weight`` [G, K, N], the
  transposed view of ours is documented; x not transposed). The doc requires the last
  group end to equal x's rows: ours may be less (expert parallelism: the other rank's
  rows past ``offs[-1]``, undefined in our output), so the last end is set to A and the
  last group computes those undefined rows too. 3 launches (the int64 cast, that fill,
  the GEMM); the reference on NPU gathers each row's weight for a bmm (qgemm
  ``_gathered_mm``): one weight read per row instead of per group.
- ``quant_grouped_mm``: the reference's device path (dequantize the ``min(A, G)`` groups
  with rows, padded, as ``qgemm.grouped_dequant_mm(static=True)``), then the mapped
  ``grouped_mm``: the same dequantized bits and the same GEMM math.
- not mapped: ``quant_linear`` / ``quant_bmm`` (on NPU the reference already is a
  dequantize and one CANN matmul; no torch_npu op reads FP8 e4m3 or packed e2m1 weights
  on the products whose docs list them), the fused dequant-GEMM on the stored bits
  (``npu_grouped_matmul``'s antiquant takes int8 / int4 weights only, int8 per channel
  only: e4m3 is not an integer format and e2m1 x 2 spans [-12, 12], outside int4).

Outside what the doc allows (dtypes, more than 1024 groups, an inner dim >= 65536, no
rows, autograd: the op is for inference) the reference runs: static checks, capture-safe.
Nothing is read back to the host (``split_item=3`` sizes y from x, not from group_list).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import qgemm

GROUPS_MAX = 1024  # group_list's first dim, single-tensor case
INNER_LIMIT = 65536  # "InnerLimit": each x's and weight's last dim must stay below it
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def grouped_ok(x: Tensor, weight: Tensor) -> bool:
    """The doc's non-quantized single-tensor case: x [A>0, K], weight [G, N, K] alike."""
    return (x.dim() == 2 and weight.dim() == 3 and x.dtype == weight.dtype
            and x.dtype in _FLOATS and x.shape[0] > 0 and x.shape[1] == weight.shape[2]
            and 1 <= weight.shape[0] <= GROUPS_MAX
            and max(x.shape[1], weight.shape[1]) < INNER_LIMIT)


def _training(x: Tensor, weight: Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def group_list(offs: Tensor, rows: int) -> Tensor:
    """offs [G] int32 group ends -> [G] int64 with the last end set to ``rows`` (the doc:
    group_list's last value equals x's first dim). 2 launches, no host read."""
    ends = offs.to(torch.int64)  # [G]
    ends[-1:].fill_(rows)
    return ends


def grouped_mm(ops, x: Tensor, weight: Tensor, offs: Tensor) -> Tensor:
    """x [A, in] sorted by group, weight [G, out, in], offs [G] int32 group ends -> [A, out]
    in x.dtype; rows past ``offs[-1]`` undefined (they are the last group's products)."""
    if _training(x, weight) or not grouped_ok(x, weight):
        return qgemm.grouped_mm(x, weight, offs)
    ends = group_list(offs, x.shape[0])  # [G] int64
    return ops.npu_grouped_matmul([x.contiguous()], [weight.transpose(1, 2)],
                                  group_list=ends, split_item=3, group_type=0,
                                  group_list_type=0)[0]


def quant_grouped_mm(ops, x: Tensor, weight: Tensor, scale: Tensor, fp4_values: Tensor,
                     offs: Tensor, fmt: str, in_features: int) -> Tensor:
    """``qgemm.quant_grouped_mm`` with the float GEMM mapped: the ``min(A, G)`` groups
    with rows first (ascending), then padding groups with none, dequantized exactly
    (``qgemm.dequantize``), then ``grouped_mm``. -> [A, out] in x.dtype."""
    if (x.dim() != 2 or x.shape[0] == 0 or x.dtype not in _FLOATS
            or weight.shape[0] > GROUPS_MAX):
        return qgemm.quant_grouped_mm(x, weight, scale, fp4_values, offs, fmt, in_features)
    return qgemm.grouped_dequant_mm(x, weight, scale, fp4_values, offs, fmt, in_features,
                                    static=True, mm=lambda xs, w, e: grouped_mm(ops, xs, w, e))
