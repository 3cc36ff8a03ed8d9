"""The kernel set a model runs: every fused op's implementation, chosen once per model.

``kernels`` (YAML, ``SpecEngine``, ``load_checkpoint``, ``--kernels``):

- ``reference``: the exact reference code (aten ops): the CPU kernels and the oracle.
- ``triton``: the fused Triton kernels. On CUDA as compiled kernels; on a CPU only under
  Triton's interpreter (``TRITON_INTERPRET=1`` in the environment before start), which
  runs the very kernels on CPU tensors: how the CPU suite proves them.
- ``auto``: what the device has: ``triton`` on CUDA (where Triton imports), the NPU set on
  Ascend (torch_npu's fused ops where their semantics match ours, ``npu.py``; the
  reference for the rest), ``reference`` on a CPU.

Every call site in ``model/`` goes through a ``Kernels``, never through a backend, and
the same kernel runs eagerly and inside a captured graph, so graph = eager stays bitwise
for every set. A set's functions share one signature per op (the reference adapters
below take what the model holds: an ``RMSNorm``'s eps as a float and as its one-element
tensor).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import KERNEL_MODES
from ..errors import ConfigError
from . import attention, compress, gemm, indexer, mhc, moe, norm, qgemm, w8a8


@dataclass(frozen=True)
class Kernels:
    name: str  # reference | triton | npu
    # (x [..., d], weight [d] | None, eps, eps_tensor [1, 1, 1]) -> x.dtype
    rms_norm: Callable[..., Any]
    # (q [T, H, hd], kv [T, hd], kv_weight [hd], eps, eps_tensor, rot [T, hd/2, 2, 2]) -> (q, kv)
    q_kv_norm_rope: Callable[..., Any]
    rope: Callable[..., Any]  # (x [T, ..., d], rot, inverse) -> x.dtype
    # (x [T, hc, D], fn, scale, base, iters, hc_eps, norm_eps, consts) -> (y, post, comb);
    # consts() makes the reference's ``HcConstants`` (called only where the reference runs)
    hc_pre: Callable[..., Any]
    hc_post: Callable[..., Any]  # (out [T, D], residual [T, hc, D], post, comb) -> [T, hc, D]
    hc_head: Callable[..., Any]  # (x [T, hc, D], fn, scale, base, hc_eps, norm_eps) -> [T, D]
    # (x [T, D], weight [E, D], bias [E] | None, chosen [T, k] | None, topk, scale)
    #   -> (chosen [T, k] int64, weights [T, k] fp32)
    moe_gate: Callable[..., Any]
    # (chosen [T, k], n_local, local_start, parallel) -> (order [A], offs [n] int32, aux)
    moe_route: Callable[..., Any]
    swiglu: Callable[..., Any]  # (gate [A, I], up [A, I], limit) -> gate.dtype
    # (ys [A, D], order, aux, weights [T, k], offs, n_local, parallel) -> [T, D] fp32
    moe_combine: Callable[..., Any]
    # GEMMs, ``qgemm.py``'s signatures: (x [A, in], weight [G, out, in], offs [G] int32)
    grouped_mm: Callable[..., Any]
    quant_linear: Callable[..., Any]  # (x, weight, scale, fp4_values, fmt, in_features)
    quant_bmm: Callable[..., Any]  # (x [G, T, in], weight [G, ...], ...) -> [G, T, out]
    quant_grouped_mm: Callable[..., Any]  # (x, weight, scale, fp4_values, offs, fmt, in)
    # ModelSlim W8A8 (``w8a8.py``): (x [*, K], weight int8 [N, K], scale fp32 [N], out_dtype)
    w8a8_linear: Callable[..., Any] = w8a8.w8a8_linear
    # (x [A, K] sorted, weight int8 [G, N, K], scale fp32 [G, N], offs [G] int32, out_dtype)
    w8a8_grouped_mm: Callable[..., Any] = w8a8.w8a8_grouped_mm
    # (x, weight, deq_scale [N], quant_bias [N] int32, input_scale [1], input_offset [1], dt)
    w8a8_static_linear: Callable[..., Any] = w8a8.w8a8_static_linear
    # The sparse path over index lists (``memory/lists.py``); None: the model gathers its
    # keys and runs the reference attention, indexer and compressor (``model/``).
    # (q, ring, chunk, swa_idx, swa_count, entries, cmp_idx, cmp_count, sink, scale, ratio)
    sparse_attn: Callable[..., Any] | None = None
    index_scores: Callable[..., Any] | None = None  # (q, w, keys, pages, per_page, count, n)
    index_topk: Callable[..., Any] | None = None  # (scores, count, pages, per_page, k)
    # (ring, chunk, cand_idx, positions, ape, norm_weight, eps, rot, ratio, coff) -> [K, d]
    compress_pool: Callable[..., Any] | None = None

    @property
    def fused(self) -> bool:
        return self.name != "reference"

    @property
    def sparse(self) -> bool:
        """Attention, indexer and compressor run over index lists."""
        return self.sparse_attn is not None


def _ref_rms_norm(x, weight, eps, eps_tensor):
    y = norm.rms_norm(x, eps_tensor)
    return y if weight is None else y * weight


def _ref_q_kv(q, kv, kv_weight, eps, eps_tensor, rot):
    return norm.q_kv_norm_rope(q, kv, kv_weight, eps_tensor, rot)


def _ref_hc_pre(x, fn, scale, base, iters, hc_eps, norm_eps, consts):
    return mhc.hc_pre(x, fn, scale, base, iters, hc_eps, norm_eps, consts())


def _ref_route(chosen, n_local, local_start, parallel):
    key, order, offs = moe.route_reference(chosen, n_local, local_start, parallel)
    return order, offs, key


def _ref_combine(ys, order, key, weights, offs, n_local, parallel):
    return moe.combine_reference(ys, key, order, weights, n_local, parallel)


REFERENCE = Kernels(
    "reference", rms_norm=_ref_rms_norm, q_kv_norm_rope=_ref_q_kv, rope=norm.apply_rope,
    hc_pre=_ref_hc_pre, hc_post=mhc.hc_post, hc_head=mhc.hc_head, moe_gate=moe.gate_reference,
    moe_route=_ref_route, swiglu=moe.swiglu_reference, moe_combine=_ref_combine,
    grouped_mm=qgemm.grouped_mm, quant_linear=qgemm.quant_linear, quant_bmm=qgemm.quant_bmm,
    quant_grouped_mm=qgemm.quant_grouped_mm)


def _fused_rms_norm(x, weight, eps, eps_tensor):
    return norm.rms_norm_fused(x, weight, eps)


def _fused_q_kv(q, kv, kv_weight, eps, eps_tensor, rot):
    return norm.q_kv_norm_rope_fused(q, kv, kv_weight, eps, rot)


def _fused_hc_pre(x, fn, scale, base, iters, hc_eps, norm_eps, consts):
    return mhc.hc_pre_fused(x, fn, scale, base, iters, hc_eps, norm_eps)


def _fused_route(chosen, n_local, local_start, parallel):
    return moe.moe_route_fused(chosen, n_local, local_start)


def _fused_combine(ys, order, pos, weights, offs, n_local, parallel):
    return moe.moe_combine_fused(ys, pos, weights, offs)


def _fused_grouped_mm(x, weight, offs):
    """torch's grouped GEMM where it runs (host, CUDA bf16 from sm90), the Triton one
    elsewhere; training (autograd) keeps the reference's differentiable loop."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return qgemm.grouped_mm(x, weight, offs)
    if qgemm._native_grouped(x):
        return qgemm.float_grouped_mm(x, weight, offs)
    return gemm.fused_grouped_mm(x, weight, offs)


TRITON = Kernels(
    "triton", rms_norm=_fused_rms_norm, q_kv_norm_rope=_fused_q_kv, rope=norm.rope_fused,
    hc_pre=_fused_hc_pre, hc_post=mhc.hc_post_fused, hc_head=mhc.hc_head_fused,
    moe_gate=moe.moe_gate_fused, moe_route=_fused_route, swiglu=moe.swiglu_fused,
    moe_combine=_fused_combine, grouped_mm=_fused_grouped_mm,
    quant_linear=gemm.fused_quant_linear, quant_bmm=gemm.fused_quant_bmm,
    quant_grouped_mm=gemm.fused_quant_grouped_mm, sparse_attn=attention.sparse_attn,
    index_scores=indexer.index_scores, index_topk=indexer.index_topk,
    compress_pool=compress.compress_pool)


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401  (optional: CUDA builds of torch bring it)
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def select_kernels(mode: str, device: str, npu_ops: object | None = None) -> Kernels:
    """The kernel set for ``mode`` (``auto`` | ``reference`` | ``triton``) on ``device``
    (a device type: ``cpu``, ``cuda``, ``npu``). ``npu_ops``: torch_npu's namespace on Ascend
    (a fake in the tests); imported here when None. A set the device cannot run is a
    ``ConfigError`` naming the setting."""
    if mode not in KERNEL_MODES:
        raise ConfigError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")
    device = str(device).split(":")[0]
    if mode == "reference" or (mode == "auto" and device == "cpu"):
        return REFERENCE
    if device == "npu":
        if mode == "triton":
            raise ConfigError("kernels 'triton': the Triton kernels are built for CUDA; on an "
                              "NPU use kernels 'auto' (torch_npu's fused ops) or 'reference'")
        from . import npu
        return npu.npu_kernels(npu_ops if npu_ops is not None else npu.import_torch_npu())
    if device == "cuda" and mode == "auto" and not triton_importable():
        return REFERENCE  # a CUDA torch without Triton: nothing fused to run
    if not triton_importable():
        raise ConfigError("kernels 'triton' needs the triton package (pip install triton)")
    if device == "cpu" and not interpreting():
        raise ConfigError("kernels 'triton' on a CPU runs the kernels under Triton's "
                          "interpreter: set TRITON_INTERPRET=1 in the environment (before "
                          "start), or use kernels 'reference' / 'auto'")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"kernels {mode!r}: no fused kernels for device {device!r}")
    return TRITON


def projected_kernels(mode: str, backend: str) -> Kernels:
    """The set a device of ``backend`` (``cuda`` | ``npu``) would run, for the work profile on
    the ``meta`` device (nothing runs: Triton need not be installed). On NPU ``auto``
    projects the reference: the torch_npu ops mapped in ``npu.py`` are not counted as fused
    until they have run on an NPU."""
    if mode not in KERNEL_MODES:
        raise ConfigError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")
    if mode == "reference" or (mode == "auto" and backend != "cuda"):
        return REFERENCE
    if backend != "cuda":
        raise ConfigError(f"kernels 'triton': the Triton kernels are built for CUDA, not for "
                          f"a {backend} device")
    return TRITON
