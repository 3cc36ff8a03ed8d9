"""The NPU kernel set: torch_npu's fused ops where their documented semantics are ours.

Every function takes ``ops``, torch_npu's namespace (the real module on Ascend, passed in
by ``select.py``; ``tests/fake_npu_ops.py`` in the CPU suite), then the fused op's own
arguments, and returns what the fused op (``norm.py``, ``moe.py``, ``mhc.py``) returns.
torch_npu is never imported at module level here (``import_torch_npu`` is the selector's
lazy import). The mapping, the docs read and why the rest is not mapped are in
``docs/kernels_npu.md``; in short (Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/``):

- ``rms_norm``: ``npu_rms_norm`` (1 launch; weightless: a ones gamma, 2).
- ``rope``: ``npu_rotary_mul(rotary_mode="interleave")``, TND with T1D cos/sin built from
  ``rot`` in one copy (2 launches).
- ``q_kv_norm_rope``: two ``npu_rms_norm`` (q with a ones gamma) and two rotations (6).
- ``swiglu``: ``npu_clipped_swiglu(alpha=1, bias=0, interleaved=False)`` on gate|up (2).
- ``moe_combine``: ``npu_moe_finalize_routing`` (dropless, row-ordered indices) of the
  fp32 outputs, rows past ``offs[-1]`` zeroed first (4-5 launches, 2 more for ``pos``
  from the reference route's ``order``: as many as the reference, but two passes over
  the [A, D] rows instead of five).
- ``hc_pre`` / ``hc_post``: ``npu_mhc_pre`` + ``npu_mhc_sinkhorn`` / ``npu_mhc_post`` (2 / 1).
- not mapped (the reference): ``moe_gate`` (npu_moe_gating_top_k scores by softmax or
  sigmoid only, not sqrt-softplus), ``moe_route`` (npu_moe_init_routing_v2 matches but
  needs int32 ids and gathers x, which our interface leaves to the caller: more kernels
  than the reference's sort), ``hc_head``.
- ``grouped_mm`` / ``quant_grouped_mm``: ``npu_grouped_matmul`` (``npu_gemm.py``, 3
  launches; the quantized one after the reference's dequantization of the groups with rows).
- not mapped: ``quant_linear``, ``quant_bmm`` (no documented op reads FP8 / FP4 weights),
  and the sparse path (``sparse_attn``, ``index_scores``, ``index_topk``, ``compress_pool``
  stay None: the docs' ops differ from ours, see ``docs/kernels_npu.md``).

An op is used only on the products its doc lists (``get_soc_version``, read when the set
is built) and only where torch_npu has it; inside a function, shapes or dtypes its doc
rejects fall back to the reference (static checks: capture-safe, no host reads). NOTHING
HERE HAS RUN ON AN NPU: the CPU suite checks the mapping against fakes written from the
docs, so ``projected_kernels`` does not count these ops as fused.
"""

from __future__ import annotations

import importlib
from typing import Callable
from dataclasses import replace

import torch
from torch import Tensor

from . import mhc, moe, norm, npu_gemm
from .select import REFERENCE, Kernels

# torch_npu.npu.get_soc_version() ranges (torch_npu csrc/core/npu/NpuVariables.h)
PRODUCTS = (("A2", 220, 225), ("A3", 250, 256), ("950", 260, 260))
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def import_torch_npu():
    """torch_npu, imported when an NPU set is built (Ascend hosts only)."""
    return importlib.import_module("torch_npu")


def product(ops) -> str | None:
    """``A2`` | ``A3`` | ``950`` from ``ops.npu.get_soc_version()``; None when unknown."""
    get = getattr(getattr(ops, "npu", None), "get_soc_version", None)
    if get is None:
        return None
    soc = int(get())
    return next((name for name, lo, hi in PRODUCTS if lo <= soc <= hi), None)


# ---- norm and RoPE -------------------------------------------------------------------

def rms_norm(ops, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``npu_rms_norm(x, gamma, epsilon)[0]``: x [..., d] -> x.dtype. gamma must be x's
    dtype or fp32; a weightless norm passes ones."""
    if x.dim() > 8 or x.dtype not in _FLOATS:
        y = norm.rms_norm(x, x.new_full((1, 1, 1), eps))
        return (y if weight is None else y * weight).to(x.dtype)
    gamma = x.new_ones(x.shape[-1]) if weight is None else weight  # [d]
    if gamma.dtype not in (x.dtype, torch.float32):
        gamma = gamma.to(x.dtype)
    rows = x if x.dim() >= 2 else x.unsqueeze(0)  # the op takes 2-8 dims
    return ops.npu_rms_norm(rows, gamma, epsilon=eps)[0].view(x.shape)


def rotary_tables(rot: Tensor, inverse: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """rot [T, d/2, 2, 2] (``RopeTable.rotation``, maybe scaled: a*[[c, s], [-s, c]]) ->
    (cos, sin) [T, 1, d] for npu_rotary_mul's interleave mode, ``x*cos + (-x1, x0)*sin``
    per pair: cos repeats rot[i, 0, 0], sin repeats rot[i, 0, 1] (inverse, the transposed
    rotation: rot[i, 1, 0]). One copy; both contiguous."""
    t, half = rot.shape[0], rot.shape[1]
    first = rot[:, :, :, 0] if inverse else rot[:, :, 0, :]  # [T, d/2, (cos, sin)]
    src = first.permute(2, 0, 1).unsqueeze(-1).expand(2, t, half, 2)  # each value twice
    tables = torch.empty(2, t, half, 2, dtype=dtype, device=rot.device).copy_(src)
    tables = tables.view(2, t, 1, 2 * half)  # [2, T, 1, d]
    return tables[0], tables[1]


def _rotary_ok(x: Tensor, rows: int) -> bool:
    """npu_rotary_mul's documented interleave limits: D even and < 896, N < 1000."""
    d = x.shape[-1]
    return x.dtype in _FLOATS and d % 2 == 0 and d < 896 and rows < 1000


def rope(ops, x: Tensor, rot: Tensor, inverse: bool) -> Tensor:
    """``npu_rotary_mul(x [T, N, d], cos, sin, "interleave")``: x [T, ..., d] -> x.dtype."""
    t, d = x.shape[0], x.shape[-1]
    rows = x.numel() // (t * d) if t * d else 0  # the middle dims as N
    if x.dim() < 2 or not _rotary_ok(x, rows):
        return norm.apply_rope(x, rot, inverse).to(x.dtype)
    cos, sin = rotary_tables(rot, inverse, x.dtype)
    tnd = x.reshape(t, rows, d).contiguous()  # [T, N, d]: the doc states no strided input
    out = ops.npu_rotary_mul(tnd, cos, sin, rotary_mode="interleave")
    return out.view(x.shape)


def q_kv_norm_rope(ops, q: Tensor, kv: Tensor, kv_weight: Tensor, eps: float,
                   rot: Tensor) -> tuple[Tensor, Tensor]:
    """q [T, H, hd], kv [T, hd] -> (q, kv) in q.dtype: each row RMS-normed (q weightless,
    kv times kv_weight), then rotated; no cat of the H+1 rows."""
    t, h, hd = q.shape
    if not _rotary_ok(q, h) or q.dtype != kv.dtype:
        return norm.q_kv_norm_rope(q, kv, kv_weight, q.new_full((1, 1, 1), eps), rot)
    qn = rms_norm(ops, q, None, eps)  # [T, H, hd]
    kvn = rms_norm(ops, kv, kv_weight, eps).unsqueeze(1)  # [T, 1, hd]
    cos, sin = rotary_tables(rot, False, q.dtype)  # [T, 1, hd] each
    q_out = ops.npu_rotary_mul(qn, cos, sin, rotary_mode="interleave")
    kv_out = ops.npu_rotary_mul(kvn, cos, sin, rotary_mode="interleave")
    return q_out, kv_out.squeeze(1)


# ---- MoE ------------------------------------------------------------------------------

def swiglu(ops, gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """``npu_clipped_swiglu(cat(gate, up), alpha=1, limit, bias=0, interleaved=False)``:
    A.clamp(max=limit) * sigmoid(A) * B.clamp(-limit, limit) = ours; [A, I] -> gate.dtype.
    Without a limit (``limit <= 0``: no clamp) the reference."""
    if limit <= 0 or gate.dtype != up.dtype or gate.dim() < 2 or gate.dtype not in _FLOATS:
        return moe.swiglu_reference(gate, up, limit)
    both = torch.cat((gate, up), dim=-1)  # [A, 2I]: A = gate, B = up
    return ops.npu_clipped_swiglu(both, dim=-1, alpha=1.0, limit=float(limit), bias=0.0,
                                  interleaved=False)


def moe_combine(ops, ys: Tensor, pos: Tensor, weights: Tensor, offs: Tensor) -> Tensor:
    """``npu_moe_finalize_routing(ys, None, None, None, weights, pos, None,
    drop_pad_mode=2)``: out[t] = sum_j weights[t, j] * ys[pos[t*k + j]] ([T, D] fp32), the
    rows of ys past offs[-1] (another rank's experts: undefined) zeroed first, as the
    reference replaces them (NaN-safe: a zero weight would not be)."""
    a = ys.shape[0]
    rows = torch.arange(a, device=ys.device).unsqueeze(1) < offs[-1]  # [A, 1]
    ys = torch.where(rows, ys.float(), 0.0)  # [A, D] fp32
    return ops.npu_moe_finalize_routing(ys, None, None, None, weights.float(), pos.int(),
                                        None, drop_pad_mode=2)


def inverse_order(order: Tensor) -> Tensor:
    """order [A] -> pos [A] int32 with pos[order[i]] = i (2 launches)."""
    a = order.numel()
    ids = torch.arange(a, dtype=torch.int32, device=order.device)
    return torch.empty_like(ids).scatter_(0, order, ids)


# ---- mHC -------------------------------------------------------------------------------

def _mhc_ok(x: Tensor) -> bool:
    """npu_mhc_pre / npu_mhc_post: x [T, n, D] bf16/fp16, n in 4, 6, 8, D 16-aligned."""
    return (x.dim() == 3 and x.dtype in (torch.float16, torch.bfloat16)
            and x.shape[1] in (4, 6, 8) and x.shape[2] % 16 == 0 and x.shape[2] <= 16384)


def hc_pre(ops, x: Tensor, fn: Tensor, scale: Tensor, base: Tensor, sinkhorn_iters: int,
           hc_eps: float, norm_eps: float,
           consts: Callable[[], mhc.HcConstants] | None = None,
           ) -> tuple[Tensor, Tensor, Tensor]:
    """``npu_mhc_pre`` (weightless RMS, the mixes, the gates, y) then ``npu_mhc_sinkhorn``
    of its pre-Sinkhorn comb logits: x [T, hc, D] -> (y [T, D], post [T, hc], comb)."""
    hc = x.shape[1] if x.dim() == 3 else 0
    if (not _mhc_ok(x) or tuple(fn.shape) != ((2 + hc) * hc, hc * x.shape[2])
            or scale.numel() != 3 or not 1 <= sinkhorn_iters <= 100):
        return mhc.hc_pre(x, fn, scale, base, sinkhorn_iters, hc_eps, norm_eps,
                          consts() if consts is not None else None)
    y, post, logits = ops.npu_mhc_pre(x, fn.float(), scale.float(), base.float(),
                                      norm_eps=norm_eps, hc_eps=hc_eps)[:3]
    comb = ops.npu_mhc_sinkhorn(logits, eps=hc_eps, num_iters=sinkhorn_iters)[0]
    return y, post, comb


def hc_post(ops, out: Tensor, residual: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """``npu_mhc_post(residual, comb, out, post)``: X_new[j] = post[j]*out + sum_i
    comb[i, j] * X[i], in residual.dtype."""
    if not _mhc_ok(residual) or out.dtype != residual.dtype:
        return mhc.hc_post(out, residual, post, comb)
    return ops.npu_mhc_post(residual, comb.float(), out, post.float())


# ---- the set -----------------------------------------------------------------------------

# which products each mapped op's doc lists (its "产品支持情况" table)
SUPPORT = {
    "npu_rms_norm": ("A2", "A3"), "npu_rotary_mul": ("A2", "A3"),
    "npu_clipped_swiglu": ("A2", "A3"), "npu_moe_finalize_routing": ("A2",),
    "npu_mhc_pre": ("950",), "npu_mhc_sinkhorn": ("950",), "npu_mhc_post": ("950",),
    "npu_grouped_matmul": ("A2", "A3"),  # and Atlas inference (310P, fp16 only): not a PRODUCT
}


def available(ops, *names: str) -> bool:
    """Every op of ``names`` exists in ``ops`` and its doc lists this product."""
    where = product(ops)
    return all(hasattr(ops, n) and where in SUPPORT[n] for n in names)


def npu_kernels(ops) -> Kernels:
    """The ``npu`` set for torch_npu namespace ``ops``: the mapped ops this product and
    torch_npu version have, the reference for every other op (``Kernels``' signatures)."""
    mapped = {}
    if available(ops, "npu_rms_norm"):
        mapped["rms_norm"] = lambda x, weight, eps, eps_tensor: rms_norm(ops, x, weight, eps)
    if available(ops, "npu_rms_norm", "npu_rotary_mul"):
        mapped["q_kv_norm_rope"] = lambda q, kv, w, eps, eps_tensor, rot: q_kv_norm_rope(
            ops, q, kv, w, eps, rot)
    if available(ops, "npu_rotary_mul"):
        mapped["rope"] = lambda x, rot, inverse: rope(ops, x, rot, inverse)
    if available(ops, "npu_clipped_swiglu"):
        mapped["swiglu"] = lambda gate, up, limit: swiglu(ops, gate, up, limit)
    if available(ops, "npu_moe_finalize_routing"):
        mapped["moe_combine"] = lambda ys, order, key, weights, offs, n, parallel: moe_combine(
            ops, ys, inverse_order(order), weights, offs)
    if available(ops, "npu_mhc_pre", "npu_mhc_sinkhorn"):
        mapped["hc_pre"] = lambda x, fn, scale, base, iters, hc_eps, norm_eps, consts: hc_pre(
            ops, x, fn, scale, base, iters, hc_eps, norm_eps, consts)
    if available(ops, "npu_mhc_post"):
        mapped["hc_post"] = lambda out, residual, post, comb: hc_post(ops, out, residual, post,
                                                                      comb)
    if available(ops, "npu_grouped_matmul"):
        mapped["grouped_mm"] = lambda x, weight, offs: npu_gemm.grouped_mm(ops, x, weight, offs)
        mapped["quant_grouped_mm"] = lambda x, weight, scale, fp4_values, offs, fmt, inp: (
            npu_gemm.quant_grouped_mm(ops, x, weight, scale, fp4_values, offs, fmt, inp))
    return replace(REFERENCE, name="npu", **mapped)
