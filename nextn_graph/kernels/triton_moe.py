"""Triton kernels of the MoE family (see ``moe.py`` for the ops and their references).

fp32 math throughout; inputs fp32 or bf16, loaded then upcast. No ``tl.dot``: the
router's [E, D] projection is one row per program, a reduction over D in blocks (a
decode step has few rows; the weight stays in L2 across the programs of a prefill).
(No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr``.)
"""

import triton
import triton.language as tl

from .aot import Build

GATE_BLOCK_D = 32  # [BLOCK_E = 256, 32] weight tile per step at V4 widths
ROUTE_BLOCK_G = 64  # experts per program counting group ends
ROUTE_BLOCK_A = 128  # assignments per program (and per comparison tile)
SWIGLU_BLOCK = 1024
COMBINE_BLOCK_D = 1024


@triton.jit
def moe_gate_kernel(x_ptr, w_ptr, bias_ptr, given_ptr, chosen_ptr, weights_ptr, D, E,
                    route_scale, TOPK: tl.constexpr, HASHED: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row t: scores [E] = sqrt(softplus(W x_t)); the top-k of scores + bias (or the
    given experts); their scores normalised to sum 1, times route_scale."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)  # [BLOCK_E] experts
    e_ok = e < E
    z = tl.zeros([BLOCK_E], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)  # [BLOCK_D]
        d_ok = d < D
        xv = tl.load(x_ptr + t * D + d, mask=d_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
        wv = tl.load(w_ptr + e[:, None] * D + d[None, :], mask=e_ok[:, None] & d_ok[None, :],
                     other=0.0).to(tl.float32)  # [BLOCK_E, BLOCK_D]
        z += tl.sum(wv * xv[None, :], axis=1)
    # sqrt(softplus(z)) as torch takes it (threshold 20: z itself above), with
    # log1p(u) = log(1 + u) * u / ((1 + u) - 1) so small softplus keep their precision
    u = tl.exp(tl.minimum(z, 20.0))
    v = 1.0 + u
    softplus = tl.where(z > 20.0, z, tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0))))
    scores = tl.sqrt(softplus)  # [BLOCK_E]

    kk = tl.arange(0, BLOCK_K)  # [BLOCK_K] top-k slots
    k_ok = kk < TOPK
    if HASHED:
        ch = tl.load(given_ptr + t * TOPK + kk, mask=k_ok, other=0).to(tl.int32)
    else:  # k rounds of argmax; a tie goes to the lower expert index
        bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
        biased = tl.where(e_ok, scores + bias, float("-inf"))  # [BLOCK_E]
        ch = tl.zeros([BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(TOPK):
            best = tl.max(biased, axis=0)
            idx = tl.min(tl.where(biased == best, e, BLOCK_E), axis=0)
            ch = tl.where(kk == j, idx, ch)
            biased = tl.where(e == idx, float("-inf"), biased)
    hit = ch[:, None] == e[None, :]  # [BLOCK_K, BLOCK_E]
    w = tl.sum(tl.where(hit, scores[None, :], 0.0), axis=1)  # [BLOCK_K] gathered scores
    w = tl.where(k_ok, w, 0.0)
    total = tl.sum(w, axis=0)
    tl.store(chosen_ptr + t * TOPK + kk, ch.to(tl.int64), mask=k_ok)
    tl.store(weights_ptr + t * TOPK + kk, w / (total + 1e-20) * route_scale, mask=k_ok)


@triton.jit
def moe_route_offs_kernel(chosen_ptr, offs_ptr, A, n_local, local_start,
                          BLOCK_G: tl.constexpr, BLOCK_A: tl.constexpr):
    """offs[g] = #{i: key_i <= g} for a block of groups g (searchsorted right on the
    sorted keys), over all A assignments in blocks. The key of an assignment: its local
    expert, n_local for another rank's, n_local + 1 past the end (above every group)."""
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    count = tl.zeros([BLOCK_G], dtype=tl.int32)
    for a0 in range(0, A, BLOCK_A):
        i = a0 + tl.arange(0, BLOCK_A)  # [BLOCK_A]
        e = tl.load(chosen_ptr + i, mask=i < A, other=0).to(tl.int32) - local_start
        key = tl.where((e >= 0) & (e < n_local), e, n_local)
        key = tl.where(i < A, key, n_local + 1)
        count += tl.sum((key[None, :] <= g[:, None]).to(tl.int32), axis=1)
    tl.store(offs_ptr + g, count, mask=g < n_local)


@triton.jit
def moe_route_pos_kernel(chosen_ptr, offs_ptr, order_ptr, pos_ptr, A, n_local, local_start,
                         BLOCK: tl.constexpr):
    """The stable sorted place of assignments i: pos_i = #{j: key_j < key_i} (= the end of
    group key_i - 1) + #{j < i: key_j = key_i}; then order[pos_i] = i. Keys as in
    moe_route_offs_kernel (a past-the-end j: n_local + 1, equal to no real key)."""
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    i_ok = i < A
    e = tl.load(chosen_ptr + i, mask=i_ok, other=0).to(tl.int32) - local_start
    key = tl.where((e >= 0) & (e < n_local), e, n_local)  # [BLOCK]
    below = tl.load(offs_ptr + key - 1, mask=i_ok & (key > 0), other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, (pid + 1) * BLOCK, BLOCK):  # the earlier assignments only
        j = j0 + tl.arange(0, BLOCK)
        e_j = tl.load(chosen_ptr + j, mask=j < A, other=0).to(tl.int32) - local_start
        key_j = tl.where((e_j >= 0) & (e_j < n_local), e_j, n_local)
        key_j = tl.where(j < A, key_j, n_local + 1)
        same = (key_j[None, :] == key[:, None]) & (j[None, :] < i[:, None])  # [BLOCK, BLOCK]
        rank += tl.sum(same.to(tl.int32), axis=1)
    p = below + rank
    tl.store(pos_ptr + i, p.to(tl.int64), mask=i_ok)
    tl.store(order_ptr + p, i.to(tl.int64), mask=i_ok)


@triton.jit
def swiglu_kernel(gate_ptr, up_ptr, out_ptr, n, limit, BLOCK: tl.constexpr):
    """out = silu(min(gate, limit)) * clamp(up, -limit, limit) (no clamp if limit <= 0),
    silu(g) = g / (1 + exp(-g)) as torch's CPU kernel takes it."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = o < n
    g = tl.load(gate_ptr + o, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + o, mask=ok, other=0.0).to(tl.float32)
    clamp = limit > 0
    g = tl.where(clamp, tl.minimum(g, limit), g)
    u = tl.where(clamp, tl.minimum(tl.maximum(u, -limit), limit), u)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + o, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def moe_combine_kernel(ys_ptr, pos_ptr, weights_ptr, offs_ptr, out_ptr, D, K, n_local,
                       BLOCK_D: tl.constexpr):
    """out[t, d-block] = sum over j < K, in order, of weights[t, j] * ys[pos[t*K + j]];
    a row at or past offs[-1] (another rank's, undefined) is never read and adds 0."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    end = tl.load(offs_ptr + n_local - 1).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(K):
        p = tl.load(pos_ptr + t * K + j)
        w = tl.load(weights_ptr + t * K + j)
        valid = p < end
        d_end = tl.where(valid, D, 0)  # (a bool block & a bool scalar is int in the interpreter)
        y = tl.load(ys_ptr + p * D + d, mask=d < d_end, other=0.0).to(tl.float32)
        acc += tl.where(valid, y * w, 0.0)
    tl.store(out_ptr + t * D + d, acc, mask=d < D)


# ---- representative builds at DeepSeek-V4-Flash widths: E 256, k 6, D 4096, I 2048 ----

BUILDS: list[Build] = [
    Build(moe_gate_kernel,
          signature={"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*fp32",
                     "given_ptr": "*i64", "chosen_ptr": "*i64", "weights_ptr": "*fp32",
                     "D": "i32", "E": "i32", "route_scale": "fp32", "TOPK": "constexpr",
                     "HASHED": "constexpr", "BLOCK_E": "constexpr", "BLOCK_D": "constexpr",
                     "BLOCK_K": "constexpr"},
          constexprs={"TOPK": 6, "HASHED": False, "BLOCK_E": 256, "BLOCK_D": GATE_BLOCK_D,
                      "BLOCK_K": 8}),
    Build(moe_route_offs_kernel,
          signature={"chosen_ptr": "*i64", "offs_ptr": "*i32", "A": "i32", "n_local": "i32",
                     "local_start": "i32", "BLOCK_G": "constexpr", "BLOCK_A": "constexpr"},
          constexprs={"BLOCK_G": ROUTE_BLOCK_G, "BLOCK_A": ROUTE_BLOCK_A}),
    Build(moe_route_pos_kernel,
          signature={"chosen_ptr": "*i64", "offs_ptr": "*i32", "order_ptr": "*i64",
                     "pos_ptr": "*i64", "A": "i32", "n_local": "i32", "local_start": "i32",
                     "BLOCK": "constexpr"},
          constexprs={"BLOCK": ROUTE_BLOCK_A}),
    Build(swiglu_kernel,
          signature={"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32",
                     "limit": "fp32", "BLOCK": "constexpr"},
          constexprs={"BLOCK": SWIGLU_BLOCK}),
    Build(moe_combine_kernel,
          signature={"ys_ptr": "*bf16", "pos_ptr": "*i64", "weights_ptr": "*fp32",
                     "offs_ptr": "*i32", "out_ptr": "*fp32", "D": "i32", "K": "i32",
                     "n_local": "i32", "BLOCK_D": "constexpr"},
          constexprs={"BLOCK_D": COMBINE_BLOCK_D}),
]
