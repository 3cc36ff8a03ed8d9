"""Triton kernel of the compressor family (``compress.py`` launches it and holds the math).

- ``compress_pool_kernel``: one program per entry k over all d channels: the span
  candidates' raw rows in tiles of TILE_S (gathered from the ring or the chunk by
  ``cand_idx``; a missing candidate, at a position < 0, is never loaded), the per-channel
  softmax over the span in two passes (the max, then the exponentials' sum and the
  weighted sum of values), the RMS norm times its weight, the RoPE rotation.

Channels are held as [BLOCK_P, 2] (pair p, member j: channel 2p + j), so the rotation
is a two-term sum over j without a shuffle; a tile is [TILE_S, BLOCK_P, 2]. Math in fp32
(inputs fp32 or bf16, each pointer its own dtype), one rounding to the output dtype. The
norm's square root and divisions are correctly rounded (``sqrt_rn``, ``div_rn``).
(No ``from __future__ import annotations`` here: Triton reads ``tl.constexpr``.)
"""

import triton
import triton.language as tl

from .aot import Build


def warps(tile: int, block_p: int) -> int:
    """Warps of a launch: 8 for a [8, 256, 2] tile (V4's d = 512), else 4."""
    return 8 if tile * block_p * 2 >= 4096 else 4


@triton.jit
def _tile(idx_ptr, row, pos, s0, D, RATIO: tl.constexpr, COFF: tl.constexpr,
          TILE_S: tl.constexpr):
    """Candidates s0 .. s0 + TILE_S - 1 of entry ``row`` -> (offset [TS] of the value
    half in its raw row's source, from the ring? [TS], exists [TS], ape offset [TS])."""
    span = COFF * RATIO
    i = s0 + tl.arange(0, TILE_S)  # [TS]
    v = tl.load(idx_ptr + row * span + i).to(tl.int64)  # [TS]: >= 0 ring, < 0 chunk
    exists = pos - span + 1 + i >= 0  # [TS]: candidate i's position is >= 0
    from_ring = v >= 0
    half = i // RATIO  # coff 2: block -1 reads the first half-channels, the own block the second
    base = tl.where(from_ring, v, -1 - v) * (2 * COFF * D) + half * D  # [TS]
    ape_off = (i % RATIO) * (COFF * D) + half * D  # [TS]: ape[phase, half*d + c]
    return base, from_ring, exists, ape_off


@triton.jit
def _load(ring_ptr, chunk_ptr, off, from_ring, load_ok):
    """One [TS, BP, 2] tile of raw values at ``off`` from the ring or the chunk, 0 where
    not ``load_ok``; only the chosen source is read."""
    a = tl.load(ring_ptr + off, mask=load_ok & from_ring, other=0.0).to(tl.float32)
    b = tl.load(chunk_ptr + off, mask=load_ok & (from_ring == 0), other=0.0).to(tl.float32)
    return tl.where(from_ring, a, b)


@triton.jit
def _scores(ring_ptr, chunk_ptr, idx_ptr, ape_ptr, row, pos, s0, D, cols,
            RATIO: tl.constexpr, COFF: tl.constexpr, TILE_S: tl.constexpr):
    """-> (gate scores + ape [TS, BP, 2], -inf for missing candidates and 0 on padding
    channels, the tile's value offsets [TS, BP, 2], its from-ring [TS, 1, 1], its load
    mask [TS, BP, 2])."""
    base, from_ring, exists, ape_off = _tile(idx_ptr, row, pos, s0, D, RATIO, COFF, TILE_S)
    c3 = cols[None, :, :]  # [1, BP, 2]
    cmask = c3 < D
    off = base[:, None, None] + c3  # [TS, BP, 2]
    ring3 = from_ring[:, None, None]
    load_ok = exists[:, None, None] & cmask  # a missing candidate's index is never read
    s = _load(ring_ptr, chunk_ptr, off + COFF * D, ring3, load_ok)  # scores after values
    ape = tl.load(ape_ptr + ape_off[:, None, None] + c3, mask=cmask, other=0.0)
    s = tl.where(exists[:, None, None] | (c3 >= D), s + ape.to(tl.float32), float("-inf"))
    return s, off, ring3, load_ok


@triton.jit
def compress_pool_kernel(ring_ptr, chunk_ptr, idx_ptr, pos_ptr, ape_ptr, w_ptr, rot_ptr,
                         out_ptr, eps, D, RATIO: tl.constexpr, COFF: tl.constexpr,
                         TILE_S: tl.constexpr, BLOCK_P: tl.constexpr):
    """Entry k: softmax-gated pooling over its span per channel, RMS norm times the weight,
    RoPE by rot[k] (rot[k, p, i, j] weighing a pair's input i into output j)."""
    span = COFF * RATIO
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    pairs = tl.arange(0, BLOCK_P)  # [BP]
    cols = 2 * pairs[:, None] + tl.arange(0, 2)[None, :]  # [BP, 2]: channel 2p + j
    cmask = cols < D
    if TILE_S == span:  # C4: the whole span in one tile, loaded once
        s, off, ring3, load_ok = _scores(ring_ptr, chunk_ptr, idx_ptr, ape_ptr, row, pos, 0,
                                         D, cols, RATIO, COFF, TILE_S)
        m = tl.max(s, axis=0)  # [BP, 2]: the last candidate (the row itself) always exists
        e = tl.exp(s - m[None, :, :])  # [TS, BP, 2]; 0 for missing candidates
        val = _load(ring_ptr, chunk_ptr, off, ring3, load_ok)
        total = tl.sum(e, axis=0)
        acc = tl.sum(e * val, axis=0)  # [BP, 2]
    else:  # C128: the max over all tiles, then the exponentials and the weighted values
        m = tl.full([BLOCK_P, 2], float("-inf"), tl.float32)
        for s0 in range(0, span, TILE_S):
            s, off, ring3, load_ok = _scores(ring_ptr, chunk_ptr, idx_ptr, ape_ptr, row, pos,
                                             s0, D, cols, RATIO, COFF, TILE_S)
            m = tl.maximum(m, tl.max(s, axis=0))
        total = tl.zeros([BLOCK_P, 2], tl.float32)
        acc = tl.zeros([BLOCK_P, 2], tl.float32)
        for s0 in range(0, span, TILE_S):
            s, off, ring3, load_ok = _scores(ring_ptr, chunk_ptr, idx_ptr, ape_ptr, row, pos,
                                             s0, D, cols, RATIO, COFF, TILE_S)
            e = tl.exp(s - m[None, :, :])
            val = _load(ring_ptr, chunk_ptr, off, ring3, load_ok)
            total += tl.sum(e, axis=0)
            acc += tl.sum(e * val, axis=0)
    pooled = tl.div_rn(acc, total)  # [BP, 2]; 0 on padding channels
    ms = tl.div_rn(tl.sum(tl.sum(pooled * pooled, axis=1), axis=0), D.to(tl.float32)) + eps
    r = tl.div_rn(1.0, tl.sqrt_rn(ms))
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = pooled * r * w  # [BP, 2]
    ri = tl.arange(0, 2)[None, :, None]  # [1, 2, 1]: a pair's input i
    rj = tl.arange(0, 2)[None, None, :]  # [1, 1, 2]: its output j
    p3 = pairs[:, None, None]  # [BP, 1, 1]
    rot = tl.load(rot_ptr + row * (2 * D) + 4 * p3 + 2 * ri + rj,
                  mask=(2 * p3 < D) & (ri < 2) & (rj < 2), other=0.0).to(tl.float32)
    out = tl.sum(y[:, :, None] * rot, axis=1)  # [BP, 2]: y0 * rot[p, 0, j] + y1 * rot[p, 1, j]
    tl.store(out_ptr + row * D + cols, out.to(out_ptr.dtype.element_ty), mask=cmask)


def _builds() -> list[Build]:
    """One build per input dtype and DeepSeek-V4-Flash compressor: C128 (ratio 128, d 512,
    coff 1: 16 tiles of 8), C4 (ratio 4, d 512, coff 2: one tile of 8) and the C4 indexer's
    (d 128); fp32 rot throughout (RopeTable's), plus a bf16 model whose tables were cast."""
    shapes = [(128, 1, 512), (4, 2, 512), (4, 2, 128)]  # ratio, coff, d
    cases = [("*fp32", "*fp32", s) for s in shapes] + [("*bf16", "*fp32", s) for s in shapes]
    cases.append(("*bf16", "*bf16", shapes[1]))
    builds = []
    for ty, rot_ty, (ratio, coff, d) in cases:
        tile = min(8, coff * ratio)
        builds.append(Build(compress_pool_kernel, signature={
            "ring_ptr": ty, "chunk_ptr": ty, "idx_ptr": "*i32", "pos_ptr": "*i64",
            "ape_ptr": ty, "w_ptr": ty, "rot_ptr": rot_ty, "out_ptr": ty, "eps": "fp32",
            "D": "i32", "RATIO": "constexpr", "COFF": "constexpr", "TILE_S": "constexpr",
            "BLOCK_P": "constexpr"},
            constexprs={"RATIO": ratio, "COFF": coff, "TILE_S": tile, "BLOCK_P": d // 2},
            num_warps=warps(tile, d // 2)))
    return builds


BUILDS: list[Build] = _builds()
