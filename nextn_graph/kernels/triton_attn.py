"""Triton kernel of V4's sparse attention (``attention.py`` launches it; its reference there).

``sparse_attn_kernel``: one program per (query row t, block of BLOCK_H heads). It loads
its q block [BLOCK_H, d] once, starts the online softmax at the sink (running max m =
sink[h], running denominator den = exp(sink - m) = 1, accumulator 0: the sink is a column
whose value adds nothing), then walks the row's key list BLOCK_N keys at a time: list
position j < swa_count[t] is the window's ``swa_idx[t, j]`` (a ring row, or for v < 0 the
forward's own row ``chunk[-1 - v]``), the next cmp_count[t] positions are
``entries[cmp_idx[t, j - swa_count]]``. Each step gathers its keys [BLOCK_N, d] by row
pointer, scores s = scale * q.k (tl.dot), rescales (m' = max(m, max s); den, acc times
exp(m - m')) and adds p = exp(s - m') and p.k (tl.dot again: K = V, the one tile serves
both products). The loop ends at the row's count (a bound read on the device), so work
follows the row's length whatever W and K are; list slots past the counts are never read.

fp32 softmax and accumulators; one rounding to the output dtype. For bf16 keys the p.v
product takes p rounded to bf16 (the tensor cores' operand, as flash attention does: a
relative error <= 2^-8 per weight). ``UPCAST`` (the interpreter, whose bf16 ``tl.dot`` is
wrong) feeds fp32 copies of the same operands to the dot; the bf16 rounding of p stays.
fp32 dots are ``input_precision="ieee"`` (the GPU's default TF32 the interpreter would not
show). Row offsets are int64 (a pool's entries times d pass 2^31).
(No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr``.)
"""

import triton
import triton.language as tl

from .aot import Build

BLOCK_H = 16  # heads a program: tl.dot's least M; V4's 64 heads -> 4 programs a row
BLOCK_N = 32  # keys a step: [32, 512] bf16 = 32 KB a tile
# 8 warps: at V4 widths ptxas gives 157 registers (bf16; fp32 204), no spills; at 4 warps
# 244 (fp32 spills). Measured with the launch's 16-divisibility of pointers and strides.
NUM_WARPS = 8


@triton.jit
def sparse_attn_kernel(q_ptr, ring_ptr, chunk_ptr, swa_idx_ptr, swa_count_ptr, entries_ptr,
                       cmp_idx_ptr, cmp_count_ptr, sink_ptr, out_ptr, H, W, K, scale,
                       stride_qt, stride_qh, stride_ring, stride_chunk, stride_entries,
                       HAS_CMP: tl.constexpr, UPCAST: tl.constexpr, D: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t, h] = (sum_j exp(s_j - m) key_j) / (exp(sink_h - m) + sum_j exp(s_j - m)),
    s_j = scale * q[t, h].key_j over the row's listed keys (see the module docstring)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dd = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    h_ok = h < H
    d_ok = dd < D
    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + dd[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    m = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)  # [BLOCK_H] running max
    den = tl.full([BLOCK_H], 1.0, tl.float32)  # the sink's exp(sink - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    n_swa = tl.load(swa_count_ptr + t)
    n = n_swa
    if HAS_CMP:
        n = n_swa + tl.load(cmp_count_ptr + t)
    for j0 in range(0, n, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] list positions
        live = j < n
        in_swa = j < n_swa
        v = tl.load(swa_idx_ptr + t * W + j, mask=in_swa, other=0).to(tl.int64)
        row = tl.where(v >= 0, ring_ptr + v * stride_ring, chunk_ptr + (-1 - v) * stride_chunk)
        if HAS_CMP:
            in_cmp = live & (j >= n_swa)
            c = tl.load(cmp_idx_ptr + t * K + (j - n_swa), mask=in_cmp, other=0).to(tl.int64)
            row = tl.where(in_swa, row, entries_ptr + c * stride_entries)
        key = tl.load(row[:, None] + dd[None, :], mask=live[:, None] & d_ok[None, :],
                      other=0.0)  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            kd = key.to(tl.float32)
        else:
            kd = key
        s = tl.dot(q, tl.trans(kd), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: m starts at the sink
        alpha = tl.exp(m - m_new)  # [BLOCK_H]
        p = tl.exp(s - m_new[:, None])  # [BLOCK_H, BLOCK_N], 0 where not live
        den = den * alpha + tl.sum(p, axis=1)
        pk = p.to(key.dtype)  # the dot's operand: bf16 for bf16 keys
        if UPCAST:
            pk = pk.to(tl.float32)
        acc = tl.dot(pk, kd, acc * alpha[:, None], input_precision="ieee")
        m = m_new
    out = acc / den[:, None]
    tl.store(out_ptr + (t * H + h[:, None]) * D + dd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


# ---- representative builds at DeepSeek-V4-Flash widths: H 64, d 512 --------------------

def _signature(dtype: str, sink: str) -> dict[str, str]:
    return {"q_ptr": f"*{dtype}", "ring_ptr": f"*{dtype}", "chunk_ptr": f"*{dtype}",
            "swa_idx_ptr": "*i32", "swa_count_ptr": "*i32", "entries_ptr": f"*{dtype}",
            "cmp_idx_ptr": "*i32", "cmp_count_ptr": "*i32", "sink_ptr": f"*{sink}",
            "out_ptr": f"*{dtype}", "H": "i32", "W": "i32", "K": "i32",
            "scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_ring": "i32",
            "stride_chunk": "i32", "stride_entries": "i32", "HAS_CMP": "constexpr",
            "UPCAST": "constexpr", "D": "constexpr", "BLOCK_H": "constexpr",
            "BLOCK_N": "constexpr", "BLOCK_D": "constexpr"}


def _constexprs(has_cmp: bool) -> dict[str, object]:
    return {"HAS_CMP": has_cmp, "UPCAST": False, "D": 512, "BLOCK_H": BLOCK_H,
            "BLOCK_N": BLOCK_N, "BLOCK_D": 512}


BUILDS: list[Build] = [
    # the C4 / C128 layers (window + compressed list), bf16 with the fp32 sink parameter
    Build(sparse_attn_kernel, _signature("bf16", "fp32"), _constexprs(True), NUM_WARPS),
    # the window-only layers (ratio 0), sink in the model dtype
    Build(sparse_attn_kernel, _signature("bf16", "bf16"), _constexprs(False), NUM_WARPS),
    # an fp32 model (the dots are fp32 FMA, not tensor cores)
    Build(sparse_attn_kernel, _signature("fp32", "fp32"), _constexprs(True), NUM_WARPS),
]
