"""V4's sparse attention over index lists: the exact reference and the fused Triton op.

DeepSeek-V4 attention is MQA with one shared head that is both key and value (K = V),
a per-head sink logit in the softmax's denominator and scores scaled by ``scale``. A row
t attends to the keys its lists name (``memory/lists.py``):

- the window: for j < swa_count[t], v = swa_idx[t, j]: ``ring[v]`` for v >= 0, else the
  forward's own row ``chunk[-1 - v]`` (not in the ring yet: the forward writes it after);
- the compressed entries: for j < cmp_count[t], ``entries[cmp_idx[t, j]]`` (C4: the
  indexer's top-k; C128: every finished entry of the request). None without (ratio 0).

``out[t, h] = sum_j p_j key_j``, p = softmax over the scores ``scale * q[t, h] . key_j``
and the sink logit ``sink[h]`` as one more column (its value contributes nothing: only the
denominator). List slots at or past a row's count are never read (they may hold anything);
swa_count >= 1 (the row's own position), cmp_count may be 0.

- ``sparse_attn_reference``: ``sink_attention`` (the model's gathered attention) on the listed
  keys, gathered into a dense [T, W + K, d] set with the slots past the counts masked
  (their keys zeroed: a garbage slot is never dereferenced, a NaN row never reaches a
  score). In the inputs' dtype, as the model's attention is today.
- ``sparse_attn`` (``nextn_graph::sparse_attn``): one kernel (``triton_attn.py``), grid
  (T, H / 16): fp32 online softmax over the row's keys, loops bounded by the counts on the
  device (a short request reads few keys whatever W and K are), one rounding to q.dtype.
  The sink is taken as given (fp32), where today's bf16 math rounds it (and the scores and
  probabilities) to bf16; for bf16 keys p is rounded to bf16 for the p.k product.
  Static shapes, no host read of a tensor's values: it captures in a CUDA graph.

``ratio`` (0, 4 or 128: what the compressed list holds) is not used by the math: it is in
the signature for the work profile's length model (how many keys a row reads).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

RATIOS = (0, 4, 128)  # none, the indexer's top-k (C4), every finished entry (C128)


# ---- reference: today's model math on the listed keys ---------------------------------

def mask_bias(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``valid``, -inf elsewhere: a key mask added to attention scores."""
    return valid.to(dtype).log()  # log 1 = 0, log 0 = -inf, both exact


def sink_attention(q: Tensor, keys: Tensor, bias: Tensor, sink: Tensor, scale: float) -> Tensor:
    """MQA over a per-row key set with a per-head attention sink in the denominator (the
    model's gathered attention, and this module's reference).

    q: [T, H, d]; keys: [T, N, d] (K = V, one shared head); bias: [T, N], 0 for a key the
    row attends, -inf for one it does not (``mask_bias``); sink: [H] -> [T, H, d]. The
    scale and the mask are one kernel with the scores (``baddbmm``)."""
    scores = torch.baddbmm(bias.unsqueeze(1), q, keys.transpose(1, 2), alpha=scale)  # [T, H, N]
    sink_col = sink.to(scores.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
    probs = torch.cat((scores, sink_col), dim=-1).softmax(dim=-1)[..., :-1]  # [T, H, N]
    return torch.bmm(probs, keys)


def _listed(idx: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """idx [T, n], count [T] -> (live [T, n] bool: j < count, idx with 0 where not live)."""
    live = torch.arange(idx.shape[1], device=idx.device) < count.unsqueeze(1)  # [T, n]
    return live, torch.where(live, idx, 0).long()


def gather_keys(ring: Tensor, chunk: Tensor, swa_idx: Tensor, swa_count: Tensor,
                entries: Tensor | None, cmp_idx: Tensor | None,
                cmp_count: Tensor | None) -> tuple[Tensor, Tensor]:
    """The lists' keys as a dense set: -> (keys [T, W + K, d], live [T, W + K] bool), the
    window's W slots then the K compressed ones; a slot past its count is a zero key."""
    live, v = _listed(swa_idx, swa_count)  # [T, W]
    own = v < 0
    keys = torch.where(own.unsqueeze(-1), chunk[(-1 - v).clamp(min=0)],
                       ring[v.clamp(min=0)])  # [T, W, d]
    if entries is not None:
        live_c, c = _listed(cmp_idx, cmp_count)  # [T, K]
        keys = torch.cat((keys, entries[c]), dim=1)  # [T, W + K, d]
        live = torch.cat((live, live_c), dim=1)
    return torch.where(live.unsqueeze(-1), keys, 0), live


def sparse_attn_reference(q: Tensor, ring: Tensor, chunk: Tensor, swa_idx: Tensor,
                          swa_count: Tensor, entries: Tensor | None, cmp_idx: Tensor | None,
                          cmp_count: Tensor | None, sink: Tensor, scale: float,
                          ratio: int) -> Tensor:
    """``sink_attention`` over the listed keys (the module docstring's semantics):
    q [T, H, d] -> [T, H, d] q.dtype. ``ratio`` is unused (the work profile's)."""
    keys, live = gather_keys(ring, chunk, swa_idx, swa_count, entries, cmp_idx, cmp_count)
    bias = mask_bias(live, q.dtype)  # [T, N]: 0 attended, -inf not
    return sink_attention(q, keys, bias, sink, scale)


# ---- the fused op ----------------------------------------------------------------------

def _pow2(n: int) -> int:
    """The least power of two >= n (tl.arange sizes)."""
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(n: int, block: int) -> int:
    return (n + block - 1) // block


def _rows(x: Tensor) -> Tensor:
    """x with unit stride in its last dim (the kernel takes row strides)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q: Tensor, ring: Tensor, chunk: Tensor, entries: Tensor | None,
           cmp_idx: Tensor | None, cmp_count: Tensor | None, ratio: int) -> None:
    """Shape-level checks only (no tensor values are read: the op captures)."""
    if ring.dtype != q.dtype or chunk.dtype != q.dtype or (
            entries is not None and entries.dtype != q.dtype):
        raise ValueError("sparse_attn: the keys (ring, chunk, entries) must be in q.dtype")
    if ratio not in RATIOS:
        raise ValueError(f"sparse_attn: ratio must be one of {RATIOS}, got {ratio}")
    given = [x is not None for x in (entries, cmp_idx, cmp_count)]
    if any(given) and not all(given):
        raise ValueError("sparse_attn: entries, cmp_idx and cmp_count come together")
    if all(given) != (ratio != 0):
        raise ValueError(f"sparse_attn: ratio {ratio} with entries "
                         f"{'given' if all(given) else 'None'} (ratio 0 iff no entries)")


@triton_op("nextn_graph::sparse_attn", mutates_args=())
def sparse_attn(q: Tensor, ring: Tensor, chunk: Tensor, swa_idx: Tensor, swa_count: Tensor,
                entries: Tensor | None, cmp_idx: Tensor | None, cmp_count: Tensor | None,
                sink: Tensor, scale: float, ratio: int) -> Tensor:
    """``sparse_attn_reference`` in one kernel: q [T, H, d], ring [Rr, d], chunk [Tc, d],
    swa_idx [T, W] int32, swa_count [T] int32, entries [Re, d] | None, cmp_idx [T, K]
    int32 | None, cmp_count [T] int32 | None, sink [H] (fp32 or q.dtype) -> [T, H, d]
    q.dtype, fp32 math. The keys are in q.dtype."""
    from . import triton_attn as tk  # Triton is optional: imported when a fused kernel runs

    _check(q, ring, chunk, entries, cmp_idx, cmp_count, ratio)
    t, h, d = q.shape
    q, ring, chunk = _rows(q), _rows(ring), _rows(chunk)  # [T, H, d], [Rr, d], [Tc, d]
    swa_idx, swa_count = swa_idx.contiguous(), swa_count.contiguous()  # [T, W], [T]
    has_cmp = entries is not None
    if has_cmp:
        entries = _rows(entries)  # [Re, d]
        cmp_idx, cmp_count = cmp_idx.contiguous(), cmp_count.contiguous()  # [T, K], [T]
    else:  # never read (HAS_CMP False): any pointers of the right types
        entries, cmp_idx, cmp_count = ring, swa_idx, swa_count
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)  # [T, H, d]
    block_h = tk.BLOCK_H
    wrap_triton(tk.sparse_attn_kernel)[(t, _cdiv(h, block_h))](
        q, ring, chunk, swa_idx, swa_count, entries, cmp_idx, cmp_count, sink.contiguous(),
        out, h, swa_idx.shape[1], cmp_idx.shape[1], float(scale), q.stride(0), q.stride(1),
        ring.stride(0), chunk.stride(0), entries.stride(0), HAS_CMP=has_cmp,
        UPCAST=not q.is_cuda, D=d, BLOCK_H=block_h, BLOCK_N=tk.BLOCK_N,
        BLOCK_D=max(16, _pow2(d)), num_warps=tk.NUM_WARPS)
    return out


@sparse_attn.register_fake
def _(q, ring, chunk, swa_idx, swa_count, entries, cmp_idx, cmp_count, sink, scale, ratio):
    _check(q, ring, chunk, entries, cmp_idx, cmp_count, ratio)
    return torch.empty_like(q, memory_format=torch.contiguous_format)
