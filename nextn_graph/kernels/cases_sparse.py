"""Representative calls of part 2's kernels, fused and reference side by side, for
``perf/kernel_bench.py`` (``cases.py`` holds part 1's):

- the quantized GEMMs on the stored bits at DeepSeek-V4-Flash widths: one FP4 routed
  projection (w1: [2048, 4096] per expert, the experts T rows x top-6 reach) and the FP8
  ``wq_b`` linear ([32768, 1024]); the reference is what a device runs without them
  (``qgemm``: dequantize the weights it needs, then the float GEMM);
- sparse attention of a C4 layer (window + the indexer's top-512) and of a C128 layer
  (window + every finished entry), and the indexer's scoring and top-k, each at requests of
  ``contexts`` cached positions (4,096 and 131,072 by default).

``nbytes`` is each fused kernel's unavoidable traffic: the stored bits it reads (never a
dequantized copy), the keys a row attends (once per row), its outputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import attention, gemm, indexer, qgemm
from .cases import Case, Widths, _bytes

SPARSE_CONTEXTS = (4096, 131072)
WINDOW, INDEX_TOPK, INDEX_HEADS, INDEX_DIM = 128, 512, 64, 128
PAGE_SIZE = 256  # positions of a KV page (the pools' default, SGLang's for V4)


def _bits(shape, gen: torch.Generator, fp8: bool) -> Tensor:
    """Random stored weight bytes: any FP4 nibble pair; an e4m3 byte but the NaNs."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    if fp8:
        b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.to(torch.uint8)


def _scales(shape, gen: torch.Generator) -> Tensor:
    """e8m0 scales 2^-10 .. 2^-4 (a trained model's magnitudes)."""
    return torch.randint(117, 124, shape, generator=gen, dtype=torch.int32).to(torch.uint8)


def gemm_cases(rows: int, w: Widths, dtype: torch.dtype, device: str,
               gen: torch.Generator) -> list[Case]:
    fp4 = torch.tensor((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0), device=device)
    d, inter, k = w.hidden, w.inter, w.topk
    experts = min(w.experts, rows * k)  # the groups rows can reach (the others unread)
    a = rows * k
    chosen = torch.randint(0, experts, (a,), generator=gen).sort().values
    offs = torch.searchsorted(chosen, torch.arange(experts), right=True).to(torch.int32)
    weight = _bits((experts, inter, d // 2), gen, fp8=False).to(device)
    scale = _scales((experts, inter, d // 32), gen).to(device)
    x = torch.randn(a, d, generator=gen).to(device=device, dtype=dtype)
    offs = offs.to(device)
    used = int((torch.diff(offs.cpu(), prepend=torch.zeros(1, dtype=torch.int32)) > 0).sum())
    out = [Case("fp4_grouped_w1",
                lambda: gemm.fused_quant_grouped_mm(x, weight, scale, fp4, offs, "fp4", d),
                lambda: qgemm.grouped_dequant_mm(x, weight, scale, fp4, offs, "fp4", d, True),
                _bytes(x) + used * (weight[0].numel() + scale[0].numel()) + a * inter * x.itemsize)]
    q_rank, n_out = 1024 if d > 64 else 32, w.heads * w.head_dim
    lw = _bits((n_out, q_rank), gen, fp8=True).to(device)
    ls = _scales(((n_out + 127) // 128, (q_rank + 127) // 128), gen).to(device)
    lx = torch.randn(rows, q_rank, generator=gen).to(device=device, dtype=dtype)
    out.append(Case("fp8_linear_wq_b",
                    lambda: gemm.fused_quant_linear(lx, lw, ls, fp4, "fp8", q_rank),
                    lambda: qgemm.dequant_linear(lx, lw, ls, fp4, "fp8", q_rank),
                    _bytes(lx, lw, ls) + rows * n_out * lx.itemsize))
    return out


def sparse_cases(rows: int, w: Widths, dtype: torch.dtype, device: str, gen: torch.Generator,
                 contexts: tuple[int, ...] = SPARSE_CONTEXTS) -> list[Case]:
    def randn(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    t, h, hd = rows, w.heads, w.head_dim
    out = []
    q = randn(t, h, hd, scale=hd ** -0.25)
    ring = randn(t * WINDOW, hd)  # each row's window, all cached
    chunk = randn(t, hd)
    swa_idx = torch.arange(t * WINDOW, device=device, dtype=torch.int32).view(t, WINDOW)
    swa_count = torch.full((t,), WINDOW, device=device, dtype=torch.int32)
    sink = randn(h, dt=torch.float32)
    scale = hd ** -0.5
    for ctx in contexts:
        for ratio, listed in ((4, min(INDEX_TOPK, ctx // 4)), (128, ctx // 128)):
            entries = randn(ctx // ratio, hd)
            cmp_idx = torch.stack([torch.randperm(ctx // ratio, generator=gen)[:listed]
                                   for _ in range(t)]).to(device=device, dtype=torch.int32)
            cmp_count = torch.full((t,), listed, device=device, dtype=torch.int32)
            args = (q, ring, chunk, swa_idx, swa_count, entries, cmp_idx, cmp_count, sink,
                    scale, ratio)
            keys = t * (WINDOW + listed) * (hd * entries.element_size() + 4)
            out.append(Case(f"sparse_attn_c{ratio}_ctx{ctx}",
                            lambda args=args: attention.sparse_attn(*args),
                            lambda args=args: attention.sparse_attn_reference(*args),
                            keys + 2 * _bytes(q) + _bytes(sink)))
        n = ctx // 4
        keys = randn(n, INDEX_DIM)
        iq = randn(t, INDEX_HEADS, INDEX_DIM, scale=INDEX_DIM ** -0.5)
        iw = randn(t, INDEX_HEADS, scale=INDEX_HEADS ** -0.5)
        per_page = PAGE_SIZE // 4  # the keys as consecutive pages of one request
        pages = torch.arange(-(-n // per_page), device=device, dtype=torch.int32).expand(t, -1)
        count = torch.full((t,), n, device=device, dtype=torch.int32)
        sa = (iq, iw, keys, pages, per_page, count, n)
        out.append(Case(f"index_scores_ctx{ctx}",
                        lambda a=sa: indexer.index_scores(*a),
                        lambda a=sa: indexer.index_scores_reference(*a),
                        _bytes(iq, iw) + t * n * (INDEX_DIM * keys.element_size() + 4)))
        scores = torch.randn(t, n, generator=gen).to(device)
        k = min(INDEX_TOPK, n)
        out.append(Case(f"index_topk_ctx{ctx}",
                        lambda a=(scores, count, pages, per_page, k): indexer.index_topk(*a),
                        lambda a=(scores, count, pages, per_page, k):
                            indexer.index_topk_reference(*a),
                        _bytes(scores) + t * k * 4))
    return out
