"""Probe kernels that call the Triton modules' private ``@triton.jit`` helpers alone and
store what they return, so a test can check each helper against its reference under the
interpreter (the helpers' sm_90a builds are their callers': ``index_topk_kernel``,
``compress_pool_kernel``, in ``test_kernel_builds.py``).
(No ``from __future__ import annotations``: Triton reads ``tl.constexpr``.)"""

import triton
import triton.language as tl

from nextn_graph.kernels.triton_compress import _tile
from nextn_graph.kernels.triton_indexer import _key


@triton.jit
def key_probe(scores_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out[j] = _key(scores, 0, j, j < n) as int64, for j < BLOCK."""
    j = tl.arange(0, BLOCK)
    key = _key(scores_ptr, 0, j, j < n)
    tl.store(out_ptr + j, key.to(tl.int64))


@triton.jit
def tile_probe(idx_ptr, out_ptr, row, pos, s0, D, RATIO: tl.constexpr, COFF: tl.constexpr,
               TILE_S: tl.constexpr):
    """out [4, TILE_S] int64: _tile's (base, from_ring, exists, ape_off)."""
    base, from_ring, exists, ape_off = _tile(idx_ptr, row, pos, s0, D, RATIO, COFF, TILE_S)
    i = tl.arange(0, TILE_S)
    tl.store(out_ptr + i, base)
    tl.store(out_ptr + TILE_S + i, from_ring.to(tl.int64))
    tl.store(out_ptr + 2 * TILE_S + i, exists.to(tl.int64))
    tl.store(out_ptr + 3 * TILE_S + i, ape_off.to(tl.int64))
