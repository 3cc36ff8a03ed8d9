"""Triton kernels of the lightning indexer (see ``indexer.py`` for the ops and references).

- ``index_scores_kernel``: program (t, b) scores the entry block b of row t's request,
  ``scores[t, j] = sum_h relu(q[t, h] . keys[row(t, j)]) * w[t, h]``, ``row(t, j) =
  pages[t, j // PER_PAGE] * PER_PAGE + j % PER_PAGE`` (the page table): one ``tl.dot`` of
  q[t] [Hi, di] by the key block [di, BLOCK_E], relu, the head-weighted sum. A block at or
  past the row's ``count`` exits at once: the work follows the request's length, not E.
- ``index_topk_kernel``: one program per row, a radix select of the n-th largest score
  then a compaction of the chosen entries in ascending order (the passes below).

The select works on an order-preserving uint32 key of the fp32 score: -0.0 made 0.0,
then the bits with the sign bit set for s >= 0 and all bits flipped for s < 0 (a larger
key is a larger score; NaN is not expected). Eight passes of 4-bit digits, most
significant first: pass p histograms the digit of the entries whose higher digits equal
the prefix found so far, and keeps the digit where the count of entries at or above it
first reaches ``remaining`` (the entries still to choose). After eight the prefix is the
n-th largest key ``kth`` and ``remaining`` the ties at kth to take. The compaction then
writes, in entry order, every entry above kth and the first ``remaining`` entries equal
to it (ties go to the lower entry); ``tl.cumsum`` gives each its place. Reads per row:
9 x count (8 passes + the compaction); 1 x count when count <= k (every entry is chosen:
the passes are skipped). Chosen entries are written as key rows through the page table;
the rest of rows[t] is then filled with entry 0's row.

Under the interpreter (CPU tensors) ``UPCAST`` makes the dot fp32 (its bf16 ``tl.dot``
is wrong); fp32 dots are ``input_precision="ieee"`` (the GPU's default would be TF32).
A bf16 dot on the GPU has exact products and fp32 accumulation: fp32 math.
(No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr``.)
"""

import triton
import triton.language as tl

from .aot import Build

SCORE_BLOCK_E = 64  # entries of a scoring program on the GPU (the dot's N)
SCORE_BLOCK_E_INTERPRETED = 512  # interpreted: fewer, larger programs (cost is per op)
TOPK_BLOCK = 1024  # entries of a select / compaction step on the GPU
TOPK_BLOCK_INTERPRETED = 8192
DIGIT_BITS = 4
DIGITS = 16  # 2**DIGIT_BITS bins of a pass's histogram
PASSES = 8  # 32 / DIGIT_BITS


@triton.jit
def index_scores_kernel(q_ptr, w_ptr, keys_ptr, pages_ptr, count_ptr, scores_ptr,
                        HI, DI, E, stride_key, P, PER_PAGE,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                        UPCAST: tl.constexpr):
    """q [T, HI, DI], w [T, HI], keys [*, DI] (rows stride_key apart), pages [T, P]
    int32, count [T] int32 -> scores [T, E] fp32 at j < count[t]; grid (T, cdiv(E,
    BLOCK_E))."""
    t = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * BLOCK_E
    count = tl.load(count_ptr + t)
    if j0 >= count:  # past the request's finished entries: nothing to score
        return
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H] heads
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    j = j0 + tl.arange(0, BLOCK_E)  # [BLOCK_E] entries
    h_ok, d_ok, j_ok = h < HI, d < DI, j < count
    q = tl.load(q_ptr + (t * HI + h[:, None]) * DI + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    page = tl.load(pages_ptr + t * P + j // PER_PAGE, mask=j_ok, other=0).to(tl.int64)
    key_row = page * PER_PAGE + j % PER_PAGE  # [BLOCK_E]
    k = tl.load(keys_ptr + key_row[None, :] * stride_key + d[:, None],
                mask=d_ok[:, None] & j_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_E]
    if UPCAST:
        q, k = q.to(tl.float32), k.to(tl.float32)
    if q.dtype == tl.float32:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee")  # [BLOCK_H, BLOCK_E]
    else:
        s = tl.dot(q, k.to(q.dtype))  # bf16 products are exact in the fp32 accumulator
    w = tl.load(w_ptr + t * HI + h, mask=h_ok, other=0.0).to(tl.float32)  # [BLOCK_H]
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)  # [BLOCK_E]
    tl.store(scores_ptr + t * E + j, score, mask=j_ok)


@triton.jit
def _key(scores_ptr, row, j, ok):
    """The order-preserving uint32 key of scores[row + j] (-0.0 as 0.0); 0 where not ok."""
    s = tl.load(scores_ptr + row + j, mask=ok, other=0.0)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 == 0.0
    bits = s.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
    return tl.where(ok, key, 0)


@triton.jit
def index_topk_kernel(scores_ptr, count_ptr, pages_ptr, rows_ptr, n_ptr, E, K, P, PER_PAGE,
                      BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, DIGITS: tl.constexpr,
                      DIGIT_BITS: tl.constexpr, PASSES: tl.constexpr):
    """Row t: n = min(K, count); rows[t, :n] = the key rows (through pages [T, P]) of the
    top-n entries of scores[t, :count] (ties to the lower entry) ascending, rows[t, n:] =
    entry 0's row. One program per row."""
    t = tl.program_id(0).to(tl.int64)
    row = t * E
    count = tl.load(count_ptr + t)
    base = tl.load(pages_ptr + t * P) * PER_PAGE  # entry 0's row: the unused slots'
    n = tl.minimum(count, K)
    offs = tl.arange(0, BLOCK)  # [BLOCK]
    bins = tl.arange(0, DIGITS)  # [DIGITS]
    scan_end = tl.where(count > K, count, 0)  # count <= K: all chosen, no select
    prefix = (base * 0).to(tl.uint32)  # the digits of kth found so far
    remaining = n
    for p in tl.static_range(PASSES):
        shift = 32 - DIGIT_BITS * (p + 1)
        hist = tl.zeros([DIGITS], dtype=tl.int32)
        outside = count * 0  # entries of the blocks not in the histogram's subset
        for e0 in range(0, scan_end, BLOCK):
            j = e0 + offs
            ok = j < count
            key = _key(scores_ptr, row, j, ok)
            if p > 0:  # the entries whose higher digits are the prefix's
                ok = ok & ((key >> (shift + DIGIT_BITS)) == (prefix >> (shift + DIGIT_BITS)))
            digit = ((key >> shift) & (DIGITS - 1)).to(tl.int32)
            # the entries outside the subset land in bin 0 and are taken out after the loop
            # (histogram's mask argument is not in every Triton release)
            hist += tl.histogram(tl.where(ok, digit, 0), DIGITS)
            outside += BLOCK - tl.sum(ok.to(tl.int32), axis=0)
        hist -= tl.where(bins == 0, outside, 0)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # [DIGITS]
        digit_n = tl.max(tl.where(at_or_above >= remaining, bins, 0), axis=0)
        remaining -= tl.sum(tl.where(bins > digit_n, hist, 0), axis=0)
        prefix = prefix | (digit_n.to(tl.uint32) << shift)
    kth = tl.where(count > K, prefix, 0)  # all chosen: every key is above 0
    remaining = tl.where(count > K, remaining, count)
    written = count * 0  # chosen entries written so far
    ties = count * 0  # entries equal to kth seen so far
    for e0 in range(0, count, BLOCK):
        j = e0 + offs
        ok = j < count
        key = _key(scores_ptr, row, j, ok)
        tie = ok & (key == kth)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        chosen = (ok & (key > kth)) | (tie & (tie_rank < remaining))
        place = written + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        page = tl.load(pages_ptr + t * P + j // PER_PAGE, mask=chosen, other=0)
        tl.store(rows_ptr + t * K + place, page * PER_PAGE + j % PER_PAGE, mask=chosen)
        written += tl.sum(chosen.to(tl.int32), axis=0)
        ties += tl.sum(tie.to(tl.int32), axis=0)
    for s0 in range(0, K, BLOCK_K):  # the unused slots: a safe row
        slot = s0 + tl.arange(0, BLOCK_K)
        tl.store(rows_ptr + t * K + slot, base.to(tl.int32) + slot * 0,
                 mask=(slot >= n) & (slot < K))
    tl.store(n_ptr + t, n)


# ---- representative builds at DeepSeek-V4-Flash widths: Hi 64, di 128, k 512 -----------

BUILDS: list[Build] = [
    *(Build(index_scores_kernel,
            signature={"q_ptr": dt, "w_ptr": dt, "keys_ptr": dt, "pages_ptr": "*i32",
                       "count_ptr": "*i32", "scores_ptr": "*fp32", "HI": "i32", "DI": "i32",
                       "E": "i32", "stride_key": "i32", "P": "i32", "PER_PAGE": "i32",
                       "BLOCK_H": "constexpr",
                       "BLOCK_D": "constexpr", "BLOCK_E": "constexpr", "UPCAST": "constexpr"},
            constexprs={"BLOCK_H": 64, "BLOCK_D": 128, "BLOCK_E": SCORE_BLOCK_E,
                        "UPCAST": False})
      for dt in ("*bf16", "*fp32")),
    Build(index_topk_kernel,
          signature={"scores_ptr": "*fp32", "count_ptr": "*i32", "pages_ptr": "*i32",
                     "rows_ptr": "*i32", "n_ptr": "*i32", "E": "i32", "K": "i32",
                     "P": "i32", "PER_PAGE": "i32",
                     "BLOCK": "constexpr", "BLOCK_K": "constexpr", "DIGITS": "constexpr",
                     "DIGIT_BITS": "constexpr", "PASSES": "constexpr"},
          constexprs={"BLOCK": TOPK_BLOCK, "BLOCK_K": 512, "DIGITS": DIGITS,
                      "DIGIT_BITS": DIGIT_BITS, "PASSES": PASSES}),
]
