"""Triton kernels of the norm / RoPE family (``norm.py`` launches them).

- ``rms_norm_kernel``: one program per row: ``x * rsqrt(mean(x^2) + eps)`` (times a
  weight when ``HAS_WEIGHT``), the whole row in one block.
- ``q_kv_norm_rope_kernel``: one program per (token, block of heads) over the H+1 rows
  ``q[t, 0..H-1], kv[t]``: each row RMS-normed (kv's times its weight), then rotated
  pairwise by the token's ``rot``; the kv row is read and written in place of a cat.
- ``rope_kernel``: one program per (token, block of middle rows): pairwise rotation by
  the token's ``rot`` (or its transpose, ``INVERSE``).

Pairs are interleaved (``x[2p], x[2p+1]``) and read as two stride-2 loads; ``rot`` is
``[T, P, 2, 2]`` contiguous, ``rot[t, p, i, j]`` weighing input i into output j, read once
per program and broadcast over its rows. Math in fp32 (inputs fp32 or bf16), one
rounding to the output dtype. The norm's square root and division are correctly
rounded (``sqrt_rn``, ``div_rn``) as the host's ``rsqrt`` (``1 / sqrt``) is.
"""

import triton
import triton.language as tl

from .aot import Build


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, D, stride_x,
                    HAS_WEIGHT: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)  # [BD]
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BD]
    ms = tl.div_rn(tl.sum(x * x, axis=0), D.to(tl.float32)) + eps
    r = tl.div_rn(1.0, tl.sqrt_rn(ms))
    y = x * r
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def q_kv_norm_rope_kernel(q_ptr, kv_ptr, w_ptr, rot_ptr, q_out_ptr, kv_out_ptr, eps, H, P,
                          BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BH] in 0..H (H: kv)
    pairs = tl.arange(0, BLOCK_P)  # [BP]
    pmask = pairs < P
    D = 2 * P
    is_kv = (rows == H)[:, None]  # [BH, 1]
    q_mask = (rows < H)[:, None] & pmask[None, :]  # [BH, BP]
    q_off = (t * H + rows)[:, None] * D + 2 * pairs[None, :]  # [BH, BP]: even elements
    q0 = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)
    q1 = tl.load(q_ptr + q_off + 1, mask=q_mask, other=0.0).to(tl.float32)
    # the kv row (read only by the program holding row H), as if cat after q's heads; a
    # block compare: Triton 3.9's interpreter rejects a scalar bool in a mask
    kv_mask = pmask & (tl.full([BLOCK_P], H, tl.int32) < (tl.program_id(1) + 1) * BLOCK_H)
    kv_off = t * D + 2 * pairs  # [BP]
    k0 = tl.load(kv_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)[None, :]
    k1 = tl.load(kv_ptr + kv_off + 1, mask=kv_mask, other=0.0).to(tl.float32)[None, :]
    x0 = tl.where(is_kv, k0, q0)  # [BH, BP]
    x1 = tl.where(is_kv, k1, q1)
    ms = tl.div_rn(tl.sum(x0 * x0 + x1 * x1, axis=1), D.to(tl.float32)) + eps  # [BH]
    r = tl.div_rn(1.0, tl.sqrt_rn(ms))[:, None]  # [BH, 1]
    n0, n1 = x0 * r, x1 * r
    w0 = tl.load(w_ptr + 2 * pairs, mask=pmask, other=0.0).to(tl.float32)[None, :]
    w1 = tl.load(w_ptr + 2 * pairs + 1, mask=pmask, other=0.0).to(tl.float32)[None, :]
    n0 = tl.where(is_kv, n0 * w0, n0)  # kv_norm's weight on the kv row only
    n1 = tl.where(is_kv, n1 * w1, n1)
    rot = rot_ptr + (t * P + pairs) * 4  # [BP]: the token's rot[p, i, j] at 4p + 2i + j
    w00 = tl.load(rot, mask=pmask, other=0.0).to(tl.float32)[None, :]  # [1, BP]
    w01 = tl.load(rot + 1, mask=pmask, other=0.0).to(tl.float32)[None, :]
    w10 = tl.load(rot + 2, mask=pmask, other=0.0).to(tl.float32)[None, :]
    w11 = tl.load(rot + 3, mask=pmask, other=0.0).to(tl.float32)[None, :]
    y0 = n0 * w00 + n1 * w10
    y1 = n0 * w01 + n1 * w11
    out_ty = q_out_ptr.dtype.element_ty
    tl.store(q_out_ptr + q_off, y0.to(out_ty), mask=q_mask)
    tl.store(q_out_ptr + q_off + 1, y1.to(out_ty), mask=q_mask)
    kv_out = tl.broadcast_to(kv_off[None, :], (BLOCK_H, BLOCK_P))  # [BH, BP]
    kv_store = is_kv & pmask[None, :]
    tl.store(kv_out_ptr + kv_out, y0.to(out_ty), mask=kv_store)
    tl.store(kv_out_ptr + kv_out + 1, y1.to(out_ty), mask=kv_store)


@triton.jit
def rope_kernel(x_ptr, rot_ptr, out_ptr, M, P,
                INVERSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] middle rows of token t
    pairs = tl.arange(0, BLOCK_P)  # [BP]
    pmask = pairs < P
    mask = (rows < M)[:, None] & pmask[None, :]  # [BM, BP]
    off = (t * M + rows)[:, None] * (2 * P) + 2 * pairs[None, :]  # [BM, BP]: even elements
    x0 = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + off + 1, mask=mask, other=0.0).to(tl.float32)
    rot = rot_ptr + (t * P + pairs) * 4  # [BP]: the token's rot[p, i, j] at 4p + 2i + j
    w00 = tl.load(rot, mask=pmask, other=0.0).to(tl.float32)[None, :]  # [1, BP]
    if INVERSE:  # the transposed rotation: weights w_ij = rot[j, i]
        w01 = tl.load(rot + 2, mask=pmask, other=0.0).to(tl.float32)[None, :]
        w10 = tl.load(rot + 1, mask=pmask, other=0.0).to(tl.float32)[None, :]
    else:
        w01 = tl.load(rot + 1, mask=pmask, other=0.0).to(tl.float32)[None, :]
        w10 = tl.load(rot + 2, mask=pmask, other=0.0).to(tl.float32)[None, :]
    w11 = tl.load(rot + 3, mask=pmask, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + off, (x0 * w00 + x1 * w10).to(out_ty), mask=mask)
    tl.store(out_ptr + off + 1, (x0 * w01 + x1 * w11).to(out_ty), mask=mask)


def _builds() -> list[Build]:
    """One build per kernel and input dtype at DeepSeek-V4-Flash widths: rms_norm at the
    hidden width 4096 (weighted), q/kv at 64 heads of 512 (256 pairs, 16 heads a
    program), rope at 64 heads of 512 (the inverse, on attention's output)."""
    builds = []
    for ty in ("*fp32", "*bf16"):
        builds.append(Build(rms_norm_kernel, signature={
            "x_ptr": ty, "w_ptr": ty, "out_ptr": ty, "eps": "fp32", "D": "i32",
            "stride_x": "i32", "HAS_WEIGHT": "constexpr", "BLOCK_D": "constexpr"},
            constexprs={"HAS_WEIGHT": True, "BLOCK_D": 4096}))
        builds.append(Build(q_kv_norm_rope_kernel, signature={
            "q_ptr": ty, "kv_ptr": ty, "w_ptr": ty, "rot_ptr": ty, "q_out_ptr": ty,
            "kv_out_ptr": ty, "eps": "fp32", "H": "i32", "P": "i32",
            "BLOCK_H": "constexpr", "BLOCK_P": "constexpr"},
            constexprs={"BLOCK_H": 16, "BLOCK_P": 256}))
        builds.append(Build(rope_kernel, signature={
            "x_ptr": ty, "rot_ptr": ty, "out_ptr": ty, "M": "i32", "P": "i32",
            "INVERSE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_P": "constexpr"},
            constexprs={"INVERSE": True, "BLOCK_M": 16, "BLOCK_P": 256}))
    return builds


BUILDS: list[Build] = _builds()
