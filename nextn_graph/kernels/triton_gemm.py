"""Triton kernel of the GEMM family (``gemm.py`` launches it; see there for the design).

``qgemm_kernel`` computes ``out[rows] = x[rows] @ W_g^T`` for one N tile of one group g,
its rows in BLOCK_M tiles, K in BLOCK_K steps; W_g is decoded in registers from what is
stored (``WEIGHT``):

- ``"fp8"``: e4m3 bytes ``[N, K]``, one scale per 128 x 128 block ``[ceil(N/128), SI]``;
  BLOCK_K = 128, so a step has one scale per column (``s[n // 128, k0 // 128]``).
- ``"fp4"``: e2m1 nibbles ``[N, K/2]`` (low nibble: even k), a scale per 32 inputs
  ``[N, SI = K/32]``. A step loads BLOCK_K/2 bytes a column once; their low nibbles
  multiply x's even columns, their high nibbles x's odd ones (two dots, no interleave).
  A nibble's bits moved into fp16's fields give its value times 2^-14 (a shift and a
  mask; code 1 lands on an fp16 subnormal, which the fp16 -> fp32 conversion keeps
  exactly); the step's BLOCK_K/32 scales a column are loaded once and broadcast.
- ``"float"``: an fp32 or bf16 weight ``[N, K]``, no scale.

Scales are uint8 e8m0 (2^(b - 127); b = 0 is 2^-127, b = 255 NaN, as torch decodes them)
or int32 holding fp32 bits, told apart by the pointer's dtype. The decoded value times
its power-of-two scale is exact in fp32 and in bf16 (what the reference dequantizes to).

``DOT_LOW``: the dot takes x's 16-bit dtype (the weight cast to it, exactly) with fp32
accumulation, on a GPU; else fp32 operands with ``input_precision="ieee"`` (not TF32): fp32
activations, and every dot under the interpreter, whose bf16 ``tl.dot`` is wrong.
Everything is inline in the one kernel: an interpreted ``@triton.jit`` helper re-patches
triton.language on every call. (No ``from __future__ import annotations``: Triton reads
``tl.constexpr``.)
"""

import triton
import triton.language as tl

from .aot import Build

BLOCK_K = 128  # K per step: one fp8 scale block, four fp4 scales
FP8_BLOCK = tl.constexpr(128)  # inputs and outputs per fp8 scale (qgemm.FP8_BLOCK)


@triton.jit
def qgemm_kernel(x_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, M, N, K, T, SI, G,
                 stride_wg, stride_sg,
                 WEIGHT: tl.constexpr, GROUPED: tl.constexpr, DOT_LOW: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [M, K] (contiguous) by weight [G, N, K | K/2] with scale [G, ...] -> out [M, N].
    Grid (cdiv(N, BLOCK_N), row tiles, G). GROUPED: group g owns rows offs[g-1]..offs[g]
    (its program loops over them, none if empty) and the last group's programs zero the
    rows past offs[G-1]; else group g owns rows g*T..(g+1)*T, one BLOCK_M tile a program."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    g = tl.program_id(2)
    if GROUPED:
        start = tl.where(g > 0, tl.load(offs_ptr + tl.maximum(g - 1, 0)), 0)
        end = tl.load(offs_ptr + g)
    else:
        start = g * T + pid_m * BLOCK_M
        end = tl.minimum(start + BLOCK_M, g * T + T)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    n_ok = n < N
    w_g = w_ptr + g.to(tl.int64) * stride_wg
    s_g = s_ptr + g.to(tl.int64) * stride_sg
    if WEIGHT == "fp8":
        tl.static_assert(BLOCK_K == FP8_BLOCK)  # one scale per column a step
    if WEIGHT == "fp4":
        tl.static_assert(BLOCK_K % 32 == 0)  # whole fp4 scale blocks a step
        j = tl.arange(0, BLOCK_K // 2)  # [BLOCK_K/2] bytes of a step
        kb_n = K // 2
        w_tile = w_g + n[None, :] * kb_n + j[:, None]  # [BLOCK_K/2, BLOCK_N] at k0 = 0
        js = tl.arange(0, BLOCK_K // 32)  # [BLOCK_K/32] scales of a step
        s_tile = s_g + n[None, :] * SI + js[:, None]  # [BLOCK_K/32, BLOCK_N] at k0 = 0
    else:
        kk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        w_tile = w_g + n[None, :] * K + kk[:, None]  # [BLOCK_K, BLOCK_N] at k0 = 0 (W^T)
        s_row = s_g + (n // FP8_BLOCK) * SI  # [BLOCK_N] the columns' scale rows
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        r_ok = (rows < end)[:, None]  # [BLOCK_M, 1]
        x_rows = x_ptr + rows[:, None].to(tl.int64) * K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if WEIGHT == "fp4":
                kb = k0 // 2 + j  # [BLOCK_K/2] byte columns
                kb_ok = kb < kb_n
                w_ok = kb_ok[:, None] & n_ok[None, :]
                s_ok = (k0 // 32 + js < SI)[:, None] & n_ok[None, :]
                byte = tl.load(w_tile + k0 // 2, mask=w_ok, other=0).to(tl.int32)
                sb = tl.load(s_tile + k0 // 32, mask=s_ok, other=0)  # [BLOCK_K/32, BLOCK_N]
                if s_ptr.dtype.element_ty == tl.int32:
                    sv = sb.to(tl.float32, bitcast=True)
                else:  # e8m0: the exponent byte placed in fp32's exponent field
                    b = sb.to(tl.int32)
                    bits = tl.where(b == 0, 0x400000, tl.where(b == 255, 0x7FC00000, b << 23))
                    sv = bits.to(tl.float32, bitcast=True)
                # each scale over its 16 bytes (32 inputs): [BLOCK_K/2, BLOCK_N]
                sv = tl.reshape(tl.broadcast_to(sv[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)),
                                (BLOCK_K // 2, BLOCK_N))
                # e2m1 (sign bit 3, exponent 2..1, mantissa 0) moved into fp16's sign, exponent
                # and mantissa fields is the value times 2^-14 (code 1, 0.5, lands on fp16's
                # subnormal 2^-15, which the exact fp16 -> fp32 conversion keeps)
                f16 = ((byte & 0x7) << 9) | ((byte & 0x8) << 12)
                w_lo = f16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                w_lo = w_lo * 16384.0 * sv
                f16 = ((byte & 0x70) << 5) | ((byte & 0x80) << 8)
                w_hi = f16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                w_hi = w_hi * 16384.0 * sv
                x_ok = r_ok & kb_ok[None, :]
                x_even = tl.load(x_rows + 2 * kb[None, :], mask=x_ok, other=0.0)
                x_odd = tl.load(x_rows + 2 * kb[None, :] + 1, mask=x_ok, other=0.0)
                if DOT_LOW:
                    acc = tl.dot(x_even, w_lo.to(x_ptr.dtype.element_ty), acc)
                    acc = tl.dot(x_odd, w_hi.to(x_ptr.dtype.element_ty), acc)
                else:
                    acc = tl.dot(x_even.to(tl.float32), w_lo, acc, input_precision="ieee")
                    acc = tl.dot(x_odd.to(tl.float32), w_hi, acc, input_precision="ieee")
            else:
                k = k0 + kk
                k_ok = k < K
                w_ok = k_ok[:, None] & n_ok[None, :]
                raw = tl.load(w_tile + k0, mask=w_ok, other=0)  # [BLOCK_K, BLOCK_N]
                if WEIGHT == "fp8":
                    sb = tl.load(s_row + k0 // FP8_BLOCK, mask=n_ok, other=0)  # [BLOCK_N]
                    if s_ptr.dtype.element_ty == tl.int32:
                        sv = sb.to(tl.float32, bitcast=True)
                    else:
                        b = sb.to(tl.int32)
                        bits = tl.where(b == 0, 0x400000,
                                        tl.where(b == 255, 0x7FC00000, b << 23))
                        sv = bits.to(tl.float32, bitcast=True)
                    w = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sv[None, :]
                else:
                    w = raw.to(tl.float32)
                xt = tl.load(x_rows + k[None, :], mask=r_ok & k_ok[None, :], other=0.0)
                if DOT_LOW:
                    acc = tl.dot(xt, w.to(x_ptr.dtype.element_ty), acc)
                else:
                    acc = tl.dot(xt.to(tl.float32), w, acc, input_precision="ieee")
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=r_ok & n_ok[None, :])
    if GROUPED:  # rows past the last group: zeros, from the last group's programs
        tail = tl.where(g == G - 1, tl.load(offs_ptr + G - 1), M)
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        for m0 in range(tail, M, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * N + n[None, :], zero,
                     mask=(rows < M)[:, None] & n_ok[None, :])


# ---- representative builds at DeepSeek-V4-Flash widths ----------------------------------
# The GPU tiles of gemm.py: BLOCK_N 64 (32 / 16 for narrow outputs), BLOCK_M 16 at decode,
# up to 64 for prefill. fp32 activations dot in fp32 (input_precision ieee).

def _build(weight: str, scale: str, act: str, grouped: bool, block_m: int,
           block_n: int = 64) -> Build:
    w = {"fp8": "*u8", "fp4": "*u8", "float": f"*{act}"}[weight]
    return Build(qgemm_kernel,
                 signature={"x_ptr": f"*{act}", "w_ptr": w, "s_ptr": scale, "offs_ptr": "*i32",
                            "out_ptr": f"*{act}", "M": "i32", "N": "i32", "K": "i32",
                            "T": "i32", "SI": "i32", "G": "i32", "stride_wg": "i32",
                            "stride_sg": "i32", "WEIGHT": "constexpr", "GROUPED": "constexpr",
                            "DOT_LOW": "constexpr", "BLOCK_M": "constexpr",
                            "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
                 constexprs={"WEIGHT": weight, "GROUPED": grouped, "DOT_LOW": act == "bf16",
                             "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": BLOCK_K})


BUILDS: list[Build] = [
    # FP8 linears (wq_a, wkv, wq_b, wo_b, shared experts) and wo_a's quant_bmm, decode
    _build("fp8", "*u8", "bf16", False, 16),
    _build("fp8", "*u8", "bf16", False, 16, block_n=16),  # wkv [512, 4096]: narrow output
    _build("fp8", "*i32", "fp32", False, 16),
    _build("fp8", "*u8", "bf16", False, 64),  # prefill
    _build("fp8", "*i32", "fp32", False, 64),
    # FP4 routed experts (w1/w3 [2048, 4096], w2 [4096, 2048], G 256), decode and prefill
    _build("fp4", "*u8", "bf16", True, 16),
    _build("fp4", "*i32", "fp32", True, 16),
    _build("fp4", "*u8", "bf16", True, 64),
    _build("fp4", "*u8", "fp32", True, 64),
    # FP8 experts (expert_dtype fp8)
    _build("fp8", "*u8", "bf16", True, 16),
    # the float grouped GEMM (CUDA fp32, or bf16 where torch._grouped_mm does not run)
    _build("float", "*fp32", "fp32", True, 16),
    _build("float", "*bf16", "bf16", True, 16),
    _build("float", "*fp32", "fp32", True, 64),
]
