"""Triton kernels of the mHC ops (``mhc.py`` launches them; fp32 math throughout).

- ``hc_project_kernel``: the mixing projection of the flattened streams, split over K:
  program (row block, K-slice) writes ``part[s, t, n] = sum_k x[t, k] * fn[n, k]`` and
  ``sq[s, t] = sum_k x[t, k]**2`` over its slice (a K-slice lies inside one stream, so the
  flat index needs no division). The slices are summed, in slice order, by the next kernel:
  deterministic, no atomics.
- ``hc_mix_kernel``: per row, the RMS factor, the gates and (``SINKHORN``) the Sinkhorn
  normalisation of the hc x hc comb, then the collapse ``y = sum_i pre_i * x_i`` of one
  ``BLOCK_D`` span of the row, ``CHUNK_D`` columns a step (the span-0 program also writes
  post and comb).
- ``hc_post_kernel``: ``new[j] = sum_i comb[i, j] * res[i] + post[j] * out`` for one chunk.

Both take ``BLOCK_T`` rows a program, side by side in every tile ([BLOCK_T, HC, HC] for
Sinkhorn, [BLOCK_T, HC, columns] for the collapse and hc_post), each row's operations in
the one-row order: the results do not depend on it. The GPU launches one row (``mhc.py``:
more would give every thread every row's comb); the interpreter, whose cost is per op per
program, up to 16.

The projection's ``tl.dot`` is fp32 with ``input_precision="ieee"``: the default would be
TF32 on the GPU, which the interpreter does not emulate (its tests would not see it).
Divisions and the square root are the correctly rounded ``div_rn`` / ``sqrt_rn``.
"""

import inspect

import triton
import triton.language as tl

from nextn_graph.kernels.aot import Build
from nextn_graph.kernels.mhc import BLOCK_D, BLOCK_K, BLOCK_T, MAX_BLOCK_S


# tl.sum and tl.max of fp32 are tl.reduce with these combines: the same IR, but tl.reduce is a
# builtin where they are nested @jit functions, which the interpreter re-patches
# triton.language for on every call (~0.5 ms, ten elementwise ops' worth).
_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


@triton.jit
def hc_project_kernel(x_ptr, fn_ptr, part_ptr, sq_ptr, T, D, N, per_stream, d_chunk,
                      stride_xt, stride_xh, stride_xd,
                      HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """x [T, HC, D] (strided), fn [N, HC*D] contiguous -> part [S, T, N], sq [S, T] fp32;
    grid (cdiv(T, BLOCK_T), S = HC * per_stream), a slice ``d_chunk`` (a BLOCK_K multiple)
    of one stream. (No ``tl.num_programs``: it fails to build under TRITON_INTERPRET=1.)"""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    h = pid_s // per_stream  # the stream this K-slice lies in
    d_start = (pid_s % per_stream) * d_chunk
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, BLOCK_N)  # [BLOCK_N]: fn rows, padded to a power of two >= 16
    k_row = tl.arange(0, BLOCK_K)[None, :]  # [1, BLOCK_K]
    k_col = tl.arange(0, BLOCK_K)[:, None]  # [BLOCK_K, 1]
    row_ok = (rows < T)[:, None]  # [BLOCK_T, 1]
    col_ok = (cols < N)[None, :]  # [1, BLOCK_N]
    # the step's tiles [BLOCK_T, BLOCK_K] and [BLOCK_K, BLOCK_N], advanced BLOCK_K columns
    # a step (the invariant offsets hoisted: the interpreter's cost is per op)
    xp = x_ptr + rows[:, None] * stride_xt + h * stride_xh + (d_start + k_row) * stride_xd
    wp = fn_ptr + cols[None, :] * (HC * D) + h * D + d_start + k_col
    acc = tl.full((BLOCK_T, BLOCK_N), 0.0, tl.float32)
    sq = tl.full((BLOCK_T, BLOCK_K), 0.0, tl.float32)
    for d0 in range(d_start, d_start + d_chunk, BLOCK_K):
        left = D - d0  # the step's columns inside the stream: k < left
        xt = tl.load(xp, mask=row_ok & (k_row < left), other=0.0).to(tl.float32)
        w = tl.load(wp, mask=(k_col < left) & col_ok, other=0.0).to(tl.float32)  # fn^T
        acc = tl.dot(xt, w, acc, input_precision="ieee")
        sq += xt * xt
        xp += BLOCK_K * stride_xd
        wp += BLOCK_K
    tl.store(part_ptr + (pid_s * T + rows[:, None]) * N + cols[None, :], acc,
             mask=row_ok & col_ok)
    tl.store(sq_ptr + pid_s * T + rows[:, None], tl.reduce(sq, 1, _ADD, keep_dims=True),
             mask=row_ok)


@triton.jit
def hc_mix_kernel(x_ptr, part_ptr, sq_ptr, scale_ptr, base_ptr, y_ptr, post_ptr, comb_ptr,
                  T, D, S, iters, inv_k, hc_eps, norm_eps, stride_xt, stride_xh, stride_xd,
                  HC: tl.constexpr, N: tl.constexpr, SINKHORN: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  CHUNK_D: tl.constexpr):
    """part [S, T, N], sq [S, T] (the projection's K-slices), scale [3 | 1], base [N]
    (fp32 or bf16) -> y [T, D] (x's dtype); with SINKHORN also post [T, HC] and
    comb [T, HC, HC] fp32. Grid (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)): BLOCK_T rows, their
    BLOCK_D columns collapsed CHUNK_D at a time. The tiles sum the slices along the axes
    the one-row kernel did (the interpreter's sums, numpy's, are then bitwise its own)."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    row_ok = rows < T
    h = tl.arange(0, HC)  # [HC]
    ss = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    t3 = rows[None, :, None]  # [1, BLOCK_T, 1]
    ok3 = row_ok[None, :, None]
    sq = tl.full((BLOCK_T, BLOCK_S), 0.0, tl.float32)  # summed along the slices' last axis
    lin = tl.full((BLOCK_S, BLOCK_T, HC), 0.0, tl.float32)  # the pre-gate projections
    for s0 in range(0, S, BLOCK_S):
        s = s0 + ss
        s_ok = s < S
        sq += tl.load(sq_ptr + s[None, :] * T + rows[:, None],
                      mask=row_ok[:, None] & s_ok[None, :], other=0.0)
        lin += tl.load(part_ptr + (s[:, None, None] * T + t3) * N + h[None, None, :],
                       mask=s_ok[:, None, None] & ok3, other=0.0)
    # the reference's order: rsqrt(mean square + eps) * scale, then base + projection * that
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.reduce(sq, 1, _ADD) * inv_k + norm_eps))  # [BLOCK_T]
    r_pre = r * tl.load(scale_ptr).to(tl.float32)
    base_pre = tl.load(base_ptr + h).to(tl.float32)
    z = base_pre[None, :] + tl.reduce(lin, 0, _ADD) * r_pre[:, None]  # [BLOCK_T, HC]
    pre = tl.div_rn(1.0, 1.0 + tl.exp(-z)) + hc_eps  # sigmoid + eps

    x_rows = x_ptr + rows[:, None, None] * stride_xt + h[None, :, None] * stride_xh
    pre3 = pre[:, :, None]  # [BLOCK_T, HC, 1]
    row_x = row_ok[:, None, None]
    d_lo = pid_d * BLOCK_D
    for d0 in range(d_lo, tl.minimum(d_lo + BLOCK_D, D), CHUNK_D):
        d = d0 + tl.arange(0, CHUNK_D)  # [CHUNK_D]
        d_ok = d < D
        xt = tl.load(x_rows + d[None, None, :] * stride_xd,
                     mask=row_x & d_ok[None, None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_T, HC, CHUNK_D]
        y = tl.reduce(pre3 * xt, 1, _ADD)  # [BLOCK_T, CHUNK_D]
        tl.store(y_ptr + rows[:, None] * D + d[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])

    if SINKHORN:
        if pid_d == 0:  # post and comb: once per row block
            i4 = h[None, None, :, None]  # [1, 1, HC, 1]: comb row
            j4 = h[None, None, None, :]  # [1, 1, 1, HC]: comb column
            lin_post = tl.full((BLOCK_S, BLOCK_T, HC), 0.0, tl.float32)
            lin_comb = tl.full((BLOCK_S, BLOCK_T, HC, HC), 0.0, tl.float32)
            for s0 in range(0, S, BLOCK_S):
                s = s0 + ss
                s_ok = s < S
                lin_post += tl.load(part_ptr + (s[:, None, None] * T + t3) * N + HC
                                    + h[None, None, :], mask=s_ok[:, None, None] & ok3,
                                    other=0.0)
                lin_comb += tl.load(part_ptr + (s[:, None, None, None] * T + t3[:, :, :, None])
                                    * N + 2 * HC + i4 * HC + j4,
                                    mask=s_ok[:, None, None, None] & ok3[:, :, :, None],
                                    other=0.0)
            r_post = r * tl.load(scale_ptr + 1).to(tl.float32)
            r_comb = r * tl.load(scale_ptr + 2).to(tl.float32)
            base_post = tl.load(base_ptr + HC + h).to(tl.float32)
            z = base_post[None, :] + tl.reduce(lin_post, 0, _ADD) * r_post[:, None]
            post = 2.0 * tl.div_rn(1.0, 1.0 + tl.exp(-z))  # [BLOCK_T, HC]
            tl.store(post_ptr + rows[:, None] * HC + h[None, :], post, mask=row_ok[:, None])

            i3 = h[None, :, None]  # [1, HC, 1]
            j3 = h[None, None, :]  # [1, 1, HC]
            base_comb = tl.load(base_ptr + 2 * HC + i3 * HC + j3).to(tl.float32)
            logits = base_comb + tl.reduce(lin_comb, 0, _ADD) * r_comb[:, None, None]
            e = tl.exp(logits - tl.reduce(logits, 2, _MAX, keep_dims=True))  # [BLOCK_T, HC, HC]
            c = tl.div_rn(e, tl.reduce(e, 2, _ADD, keep_dims=True)) + hc_eps  # row softmax + eps
            c = tl.div_rn(c, tl.reduce(c, 1, _ADD, keep_dims=True) + hc_eps)  # by columns
            for _ in range(iters - 1):
                c = tl.div_rn(c, tl.reduce(c, 2, _ADD, keep_dims=True) + hc_eps)  # by rows
                c = tl.div_rn(c, tl.reduce(c, 1, _ADD, keep_dims=True) + hc_eps)  # by columns
            tl.store(comb_ptr + rows[:, None, None] * (HC * HC) + i3 * HC + j3, c,
                     mask=row_ok[:, None, None])


@triton.jit
def hc_post_kernel(out_ptr, res_ptr, post_ptr, comb_ptr, new_ptr, T, D,
                   stride_ot, stride_od, stride_rt, stride_rh, stride_rd,
                   stride_pt, stride_ph, stride_ct, stride_ci, stride_cj,
                   HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """out [T, D], res [T, HC, D], post [T, HC], comb [T, HC, HC] (all strided) ->
    new [T, HC, D] contiguous in res's dtype. Grid (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)):
    [BLOCK_T, HC, BLOCK_D] tiles."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    j = tl.arange(0, HC)  # [HC]: output stream
    t3 = rows[:, None, None]  # [BLOCK_T, 1, 1]
    d3 = d[None, None, :]  # [1, 1, BLOCK_D]
    j3 = j[None, :, None]  # [1, HC, 1]
    row_ok = t3 < T
    ok = row_ok & (d3 < D)  # [BLOCK_T, 1, BLOCK_D]
    res_i = res_ptr + t3 * stride_rt + d3 * stride_rd  # [BLOCK_T, 1, BLOCK_D]: stream i
    comb_i = comb_ptr + t3 * stride_ct + j3 * stride_cj  # [BLOCK_T, HC, 1]: comb row i
    mixed = tl.full((BLOCK_T, HC, BLOCK_D), 0.0, tl.float32)
    for i in tl.static_range(HC):  # C^T @ X: new[j] += comb[i, j] * res[i]
        ri = tl.load(res_i, mask=ok, other=0.0).to(tl.float32)
        ci = tl.load(comb_i, mask=row_ok, other=0.0).to(tl.float32)
        mixed += ci * ri
        res_i += stride_rh
        comb_i += stride_ci
    o = tl.load(out_ptr + t3 * stride_ot + d3 * stride_od, mask=ok,
                other=0.0).to(tl.float32)  # [BLOCK_T, 1, BLOCK_D]
    p = tl.load(post_ptr + t3 * stride_pt + j3 * stride_ph, mask=row_ok,
                other=0.0).to(tl.float32)  # [BLOCK_T, HC, 1]
    new = mixed + p * o  # [BLOCK_T, HC, BLOCK_D]
    tl.store(new_ptr + (t3 * HC + j3) * D + d3, new.to(new_ptr.dtype.element_ty), mask=ok)


def _signature(kernel, ptrs: dict[str, str], fp32: tuple[str, ...] = ()) -> dict[str, str]:
    """Every parameter of ``kernel``, in order: the pointer types given, ``fp32`` for the
    float scalars named, ``constexpr`` for the ``tl.constexpr`` ones, ``i32`` otherwise."""
    notes = inspect.get_annotations(kernel.fn)
    return {a: ptrs[a] if a in ptrs else "fp32" if a in fp32 else
            "constexpr" if notes.get(a) is tl.constexpr else "i32" for a in kernel.arg_names}


def _builds() -> list[Build]:
    """One build per kernel and x dtype at DeepSeek-V4-Flash widths (hc 4, D 4096) with the
    GPU's launch constants (``mhc.py``; one row a mixing / hc_post program there); the
    mixing kernel for hc_pre (N 24, Sinkhorn) and for hc_head (N 4)."""
    out = []
    f32 = "*fp32"
    for x in ("*fp32", "*bf16"):
        out.append(Build(hc_project_kernel, _signature(hc_project_kernel, {
            "x_ptr": x, "fn_ptr": f32, "part_ptr": f32, "sq_ptr": f32}),
            {"HC": 4, "BLOCK_T": BLOCK_T, "BLOCK_N": 32, "BLOCK_K": BLOCK_K}))
        mix = _signature(hc_mix_kernel, {
            "x_ptr": x, "part_ptr": f32, "sq_ptr": f32, "scale_ptr": f32, "base_ptr": f32,
            "y_ptr": x, "post_ptr": f32, "comb_ptr": f32}, fp32=("inv_k", "hc_eps", "norm_eps"))
        post = _signature(hc_post_kernel, {
            "out_ptr": x, "res_ptr": x, "post_ptr": f32, "comb_ptr": f32, "new_ptr": x})
        for n, sinkhorn in ((24, True), (4, False)):
            out.append(Build(hc_mix_kernel, mix, {
                "HC": 4, "N": n, "SINKHORN": sinkhorn, "BLOCK_T": 1, "BLOCK_S": MAX_BLOCK_S,
                "BLOCK_D": BLOCK_D, "CHUNK_D": BLOCK_D}))
        out.append(Build(hc_post_kernel, post, {"HC": 4, "BLOCK_T": 1, "BLOCK_D": BLOCK_D}))
    return out


BUILDS: list[Build] = _builds()
