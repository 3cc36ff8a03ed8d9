"""The KV compressor's pooling, norm and RoPE: the model's reference and ONE fused kernel.

An entry pools the ``span = coff * ratio`` raw rows (``Compressor.raw``: coff*d values,
then coff*d gate scores) ending at its block end ``positions[k]``: candidate i sits at
position ``positions[k] - span + 1 + i`` and its raw row is ``cand_idx[k, i]`` = v, read
from ``ring[v]`` for v >= 0 and from this forward's ``chunk[-1 - v]`` for v < 0. A
candidate at a position < 0 does not exist (C4's block -1): it is masked out of the
softmax and its index is never read (it may be garbage). Then, per channel c < d,

    s_i = score_i[h_i*d + c] + ape[i % ratio, h_i*d + c]     (h_i: i // ratio, the half;
    pooled = sum_i softmax_i(s) * value_i[h_i*d + c]           always 0 for coff == 1)
    entry = rope(rms_norm(pooled) * norm_weight, rot)

(for coff == 2 the earlier block's candidates use the first half-channels, the own
block's the second: ``Compressor._pool``), with ``rot`` [K, d/2, 2, 2] the rotation at the
block start (``RopeTable.rotation``).

- ``compress_reference``: that in torch, as the model computes it: the candidates
  gathered with one ``torch.where`` over the two sources (``Ring.gather_recent``), then
  ``Compressor._pool``, ``RMSNorm`` and ``apply_rope`` verbatim, in the model's dtype: for
  every entry whose candidates all exist, bitwise the model's ``Compressor.cached`` and
  ``dense`` entries (tested). Unlike the model's C128 path it masks missing candidates
  for coff == 1 too (a 0 bias elsewhere, which changes nothing).
- ``nextn_graph::compress_pool``: the same in one kernel, one program per entry over all
  d channels, fp32 inside, one rounding to ``ring.dtype`` at the end (the reference
  rounds after every op in bf16: the tests state the distance).

The op is static-shaped and reads nothing back to the host, so it captures.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from .attention import mask_bias
from .norm import apply_rope, rms_norm

CAND_TILE = 8  # candidates a program loads at once (a [8, d] tile of values and of scores)


# ---- reference: the model's math, verbatim ----------------------------------------------

def gather_candidates(ring: Tensor, chunk: Tensor, cand_idx: Tensor) -> Tensor:
    """ring [Rr, F], chunk [Tc, F], cand_idx [K, span] -> the raw rows [K, span, F]; the
    indices are clamped into both sources, so a missing candidate's garbage reads a row."""
    from_ring = (cand_idx >= 0).unsqueeze(-1)  # [K, span, 1]
    slot = cand_idx.clamp(0, ring.shape[0] - 1)  # [K, span]
    row = (-1 - cand_idx).clamp(0, chunk.shape[0] - 1)  # [K, span]
    return torch.where(from_ring, ring[slot], chunk[row])


def pool_bias(positions: Tensor, span: int, dtype: torch.dtype) -> Tensor:
    """positions [K] block ends -> [K, span]: 0 where the candidate's position is >= 0,
    -inf where it does not exist (``mask_bias`` of ``RingIndex.valid``)."""
    offsets = torch.arange(1 - span, 1, device=positions.device)  # [span]
    return mask_bias(positions.unsqueeze(1) + offsets >= 0, dtype)  # [K, span]


def pool(cand: Tensor, bias: Tensor | None, ape: Tensor, ratio: int, coff: int) -> Tensor:
    """The compressor's softmax-gated pooling (``Compressor._pool`` calls it): cand
    [K, span, 2*coff*d], bias [K, span] or None, ape [ratio, coff*d] -> [K, d] cand.dtype."""
    k, r = cand.shape[0], ratio
    d = ape.shape[1] // coff
    if coff == 2:  # earlier block: first half-channels; own block: second half
        # [K, block, r, value|score, half, d]: the half equal to the block, as a view
        sel = cand.view(k, 2, r, 2, 2, d).diagonal(dim1=1, dim2=4)  # [K, r, 2, d, block]
        sel = sel.permute(0, 4, 1, 2, 3)  # [K, block, r, value|score, d]
        ape = ape.view(r, 2, d).transpose(0, 1)  # [block (= half), r, d]
    else:
        sel = cand.view(k, 1, r, 2, d)
        ape = ape.view(1, r, d)
    kv, score = sel.unbind(dim=3)  # [K, coff, r, d] each
    score = score + ape.to(score.dtype)  # candidate j of a block has phase j
    if bias is not None:
        score = score + bias.view(k, coff, r, 1)
    weights = score.reshape(k, coff * r, d).softmax(dim=1).view(k, coff, r, d)
    return (kv * weights).sum(dim=(1, 2))  # softmax-gated pooling over the span, per channel


def compress_reference(ring: Tensor, chunk: Tensor, cand_idx: Tensor, positions: Tensor,
                       ape: Tensor, norm_weight: Tensor, eps: float, rot: Tensor,
                       ratio: int, coff: int, eps_tensor: Tensor | None = None) -> Tensor:
    """The entries [K, d] in ring.dtype (see the module doc). ``eps_tensor``: the
    ``RMSNorm.eps_tensor`` the model holds (else one is made from ``eps``, equal to it)."""
    if eps_tensor is None:
        eps_tensor = torch.full((1, 1, 1), eps, dtype=torch.float32, device=ring.device)
    cand = gather_candidates(ring, chunk, cand_idx)  # [K, span, 2*coff*d]
    bias = pool_bias(positions, coff * ratio, ring.dtype)  # [K, span]
    normed = rms_norm(pool(cand, bias, ape, ratio, coff), eps_tensor) * norm_weight
    return apply_rope(normed, rot).to(ring.dtype)  # [K, d]


# ---- the fused op ------------------------------------------------------------------------

def _pow2(n: int) -> int:
    """The least power of two >= n (>= 1): Triton's block sizes."""
    return 1 << max(n - 1, 0).bit_length()


def cand_tile(span: int) -> int:
    """Candidates per tile: the largest power of two dividing span, at most CAND_TILE."""
    return min(CAND_TILE, span & -span)


def _check(ring: Tensor, chunk: Tensor, cand_idx: Tensor, positions: Tensor, ape: Tensor,
           norm_weight: Tensor, rot: Tensor, ratio: int, coff: int) -> int:
    """The shapes the kernel assumes (static: no tensor value is read) -> d."""
    k, span = cand_idx.shape
    d = ape.shape[-1] // coff
    problems = [
        (coff in (1, 2), f"coff must be 1 or 2, got {coff}"),
        (span == coff * ratio, f"cand_idx has {span} candidates a row, not coff*ratio"),
        (tuple(ape.shape) == (ratio, coff * d) and d % 2 == 0, f"ape {tuple(ape.shape)}"),
        (ring.shape[-1] == chunk.shape[-1] == 2 * coff * d,
         f"raw rows of {ring.shape[-1]} / {chunk.shape[-1]} values, not 2*coff*d"),
        (ring.dtype == chunk.dtype, f"ring {ring.dtype}, chunk {chunk.dtype}"),
        (tuple(positions.shape) == (k,), f"positions {tuple(positions.shape)}"),
        (tuple(norm_weight.shape) == (d,), f"norm_weight {tuple(norm_weight.shape)}"),
        (tuple(rot.shape) == (k, d // 2, 2, 2), f"rot {tuple(rot.shape)}"),
    ]
    for ok, why in problems:
        if not ok:
            raise ValueError(f"compress_pool: {why}")
    return d


@triton_op("nextn_graph::compress_pool", mutates_args=())
def compress_pool(ring: Tensor, chunk: Tensor, cand_idx: Tensor, positions: Tensor,
                  ape: Tensor, norm_weight: Tensor, eps: float, rot: Tensor, ratio: int,
                  coff: int) -> Tensor:
    """ring [Rr, F], chunk [Tc, F], cand_idx [K, span] int32, positions [K] int64, ape
    [ratio, coff*d], norm_weight [d], rot [K, d/2, 2, 2] -> entry [K, d] in ring.dtype:
    ``compress_reference`` in one kernel, one program per entry."""
    from . import triton_compress as tk  # Triton is optional: imported when a fused kernel runs

    d = _check(ring, chunk, cand_idx, positions, ape, norm_weight, rot, ratio, coff)
    k, span = cand_idx.shape
    out = torch.empty(k, d, dtype=ring.dtype, device=ring.device)  # [K, d]
    if k == 0:
        return out
    ring, chunk = ring.contiguous(), chunk.contiguous()  # [Rr, F], [Tc, F]
    cand_idx, positions = cand_idx.contiguous(), positions.contiguous()  # [K, span], [K]
    ape, norm_weight, rot = ape.contiguous(), norm_weight.contiguous(), rot.contiguous()
    tile = cand_tile(span)
    block_p = _pow2(d // 2)
    wrap_triton(tk.compress_pool_kernel)[(k,)](
        ring, chunk, cand_idx, positions, ape, norm_weight, rot, out, float(eps), d,
        RATIO=ratio, COFF=coff, TILE_S=tile, BLOCK_P=block_p,
        num_warps=tk.warps(tile, block_p))
    return out


@compress_pool.register_fake
def _(ring, chunk, cand_idx, positions, ape, norm_weight, eps, rot, ratio, coff):
    d = _check(ring, chunk, cand_idx, positions, ape, norm_weight, rot, ratio, coff)
    return ring.new_empty(cand_idx.shape[0], d)
