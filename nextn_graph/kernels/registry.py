"""Which of the project's ops a device has a kernel for, and what it runs where it has none.

The work profile counts a ``nextn_graph::`` op as one kernel only where the device has an
implementation of it in this tree (or in torch); elsewhere it counts the op's capture-safe
decomposition, as that device would run it. Today:

- the fused ops of ``mhc``, ``norm`` and ``moe`` have Triton kernels for CUDA; they are
  called only by the ``triton`` kernel set (``select.py``), so on CUDA they count one each;
- ``grouped_mm`` is ``torch._grouped_mm`` on CUDA in bf16 (sm90 and later: the H200 spec),
  and a gather of one weight per row elsewhere (``_gathered_mm``);
- the quantized GEMMs (``quant_linear``, ``quant_bmm``, ``quant_grouped_mm``) are the
  reference ops: a device dequantizes the weights it needs (``static``: ``min(A, G)``
  experts) and runs the float GEMM. The ``triton`` set calls the fused forms instead
  (``fused_*``, ``gemm.py``), which read the stored bits.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import qgemm

# The ops with a Triton kernel (``triton_<family>.py``), called by the ``triton`` set only.
TRITON_OPS = tuple(f"nextn_graph::{name}" for name in (
    "hc_pre", "hc_post", "hc_head", "rms_norm", "q_kv_norm_rope", "rope", "moe_gate",
    "moe_route", "swiglu", "moe_combine", "fused_grouped_mm", "fused_quant_linear",
    "fused_quant_bmm", "fused_quant_grouped_mm", "sparse_attn", "index_scores", "index_topk",
    "compress_pool"))
# Triton kernels each fused op launches, where more than one (tested against the kernels'
# own launch hooks): the work profile counts every launch as a kernel.
LAUNCHES = {"nextn_graph::hc_pre": 2, "nextn_graph::hc_head": 2, "nextn_graph::moe_route": 2}


def launches(op_name: str) -> int:
    """Device kernels one call of op ``op_name`` (``namespace::name``) launches."""
    return LAUNCHES.get(op_name, 1)


def _static_grouped(x, weight, scale, fp4_values, offs, fmt, in_features):
    return qgemm.grouped_dequant_mm(x, weight, scale, fp4_values, offs, fmt, in_features,
                                    static=True)


def decompositions(backend: str, dtype: torch.dtype) -> dict[object, Callable]:
    """The ops with no kernel on ``backend`` (``cuda`` | ``npu``) at ``dtype``, each mapped to
    the function a device runs instead (same arguments)."""
    ops = torch.ops.nextn_graph
    out: dict[object, Callable] = {
        ops.quant_linear.default: qgemm.dequant_linear,
        ops.quant_bmm.default: qgemm.dequant_bmm,
        ops.quant_grouped_mm.default: _static_grouped,
    }
    if not has_device_kernel("nextn_graph::grouped_mm", backend, dtype):
        out[ops.grouped_mm.default] = qgemm._gathered_mm
    return out


def has_device_kernel(op_name: str, backend: str, dtype: torch.dtype) -> bool:
    """Whether a device of ``backend`` runs op ``op_name`` as a kernel of its own."""
    if op_name in TRITON_OPS:
        return backend == "cuda"
    if op_name == "nextn_graph::grouped_mm":
        return backend == "cuda" and dtype == torch.bfloat16
    return False
