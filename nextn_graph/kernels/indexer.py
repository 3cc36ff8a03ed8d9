"""The lightning indexer's scores and top-k over the pool's paged keys: references and fused ops.

Where the model's ``Indexer`` gathers every entry slot of each row's request
(``[T, E, di]``) and sorts all E, these read the finished entries only. Entry j of row t's
request is key row ``pages[t, j // per_page] * per_page + j % per_page``: ``pages`` [T, P]
int32 are the request's page ids (its page-table row, ``memory/pool.py``), ``per_page`` the
entries of one page. A flat layout is one page per request (``pages[t, 0]`` the request,
``per_page`` its entry slots).

- ``index_scores(q, w, keys, pages, per_page, count, n)``: ``scores[t, j] = sum_h
  relu(q[t, h] . keys[row(t, j)]) * w[t, h]`` for ``j < count[t]`` (fp32 math); q carries
  RoPE and the score scale (``Indexer.rotation``). Slots ``j >= count[t]`` are neither
  computed nor written (undefined); pages past the count are not read. 1 kernel. Under
  tensor parallelism the caller all-reduces the scores between the two ops.
- ``index_topk(scores, count, pages, per_page, k)``: ``n[t] = min(k, count[t])``;
  ``rows[t, :n[t]]`` are the key rows of the top n of ``scores[t, :count[t]]`` (ties go to
  the lower entry, -0.0 equals 0.0: the set of ``model.compressor.stable_topk``'s first n
  with unfinished entries masked), in ascending entry order; ``rows[t, n[t]:]`` is the row
  of entry 0 (a safe row that attention masks by n). Reads ``scores[t, :count[t]]`` only.
  1 kernel: a radix select and a compaction per row (``triton_indexer.py``: 9 reads).

The references are the same math in torch (fp32; a stable sort); the fused ops are
static-shaped and read nothing back to the host, so they capture.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton


# ---- references ------------------------------------------------------------------------

def key_rows(pages: Tensor, per_page: int, entries: Tensor) -> Tensor:
    """The key row of entry ``entries`` [T, m] of each row's request through its page ids
    ``pages`` [T, P] -> [T, m] int64 (entries past the last page read the last page)."""
    page = pages.long().gather(1, (entries // per_page).clamp(max=pages.shape[1] - 1))
    return page * per_page + entries % per_page


def _slots(pages: Tensor, per_page: int, n: int) -> Tensor:
    """[T, n] int64: the key row of each slot j < n."""
    j = torch.arange(n, device=pages.device).expand(pages.shape[0], n)
    return key_rows(pages, per_page, j)


def index_scores_reference(q: Tensor, w: Tensor, keys: Tensor, pages: Tensor, per_page: int,
                           count: Tensor, n: int) -> Tensor:
    """q [T, Hi, di], w [T, Hi], keys [Re, di], pages [T, P] int32, count [T] int32 ->
    scores [T, n] fp32, NaN at j >= count[t] (the fused op leaves those undefined)."""
    k = keys.float()[_slots(pages, per_page, n)]  # [T, n, di]
    relu = torch.bmm(q.float(), k.transpose(1, 2)).relu()  # [T, Hi, n]
    scores = torch.bmm(w.float().unsqueeze(1), relu).squeeze(1)  # [T, n]
    finished = torch.arange(n, device=q.device) < count.unsqueeze(1)  # [T, n]
    return scores.masked_fill(~finished, float("nan"))


def index_topk_reference(scores: Tensor, count: Tensor, pages: Tensor, per_page: int,
                         k: int) -> tuple[Tensor, Tensor]:
    """scores [T, E] fp32, count [T] int32, pages [T, P] int32 -> (rows [T, k] int32,
    n [T] int32): a stable descending sort of the finished scores (-0.0 as 0.0,
    unfinished last), its first n entries sorted ascending as key rows, entry 0's row in
    the unused slots."""
    t, e = scores.shape
    j = torch.arange(e, device=scores.device)
    finished = j < count.unsqueeze(1)  # [T, E]
    s = torch.where(scores == 0, 0.0, scores)  # -0.0 == 0.0 for any sort
    s = torch.where(finished, s, float("-inf"))  # after every finished entry (stable)
    order = s.sort(dim=1, descending=True, stable=True).indices[:, :k]  # [T, min(k, E)]
    order = torch.nn.functional.pad(order, (0, k - order.shape[1]), value=e)  # [T, k]
    n = count.clamp(max=k).to(torch.int32)  # [T]
    used = torch.arange(k, device=scores.device) < n.unsqueeze(1)  # [T, k]
    chosen = torch.where(used, order, e).sort(dim=1).values  # ascending, unused last
    rows = key_rows(pages, per_page, torch.where(used, chosen, 0))
    return rows.to(torch.int32), n


# ---- fused ops -------------------------------------------------------------------------

def _pow2(n: int, least: int = 1) -> int:
    """The least power of two >= max(n, least) (tl.arange sizes; tl.dot needs >= 16)."""
    return max(1 << max(n - 1, 0).bit_length(), least)


def _cdiv(n: int, block: int) -> int:
    """The programs that cover n items in blocks (triton.cdiv, without importing Triton)."""
    return (n + block - 1) // block


@triton_op("nextn_graph::index_scores", mutates_args=())
def index_scores(q: Tensor, w: Tensor, keys: Tensor, pages: Tensor, per_page: int,
                 count: Tensor, n: int) -> Tensor:
    """``index_scores_reference`` at j < count[t] in one kernel, grid (T, entry blocks);
    blocks past a row's count exit at once. -> [T, n] fp32 (undefined at j >= count)."""
    from . import triton_indexer as tk  # Triton is optional: imported when a fused kernel runs

    t, hi, di = q.shape
    q, w = q.contiguous(), w.contiguous()  # [T, Hi, di], [T, Hi]
    if keys.stride(1) != 1:
        keys = keys.contiguous()  # [Re, di]
    pages, count = pages.contiguous(), count.contiguous()  # [T, P] int32, [T] int32
    scores = torch.empty(t, n, dtype=torch.float32, device=q.device)  # [T, n]
    if t == 0 or n == 0:  # no programs to launch
        return scores
    # CPU tensors run only under the interpreter, whose bf16 tl.dot is wrong: fp32 there
    upcast = not q.is_cuda or q.dtype != keys.dtype
    block = tk.SCORE_BLOCK_E if q.is_cuda else tk.SCORE_BLOCK_E_INTERPRETED
    block = min(block, _pow2(n, 16))
    wrap_triton(tk.index_scores_kernel)[(t, _cdiv(n, block))](
        q, w, keys, pages, count, scores, hi, di, n, keys.stride(0), pages.shape[1], per_page,
        BLOCK_H=_pow2(hi, 16), BLOCK_D=_pow2(di, 16), BLOCK_E=block, UPCAST=upcast)
    return scores


@index_scores.register_fake
def _(q, w, keys, pages, per_page, count, n):
    return q.new_empty(q.shape[0], n, dtype=torch.float32)


@triton_op("nextn_graph::index_topk", mutates_args=())
def index_topk(scores: Tensor, count: Tensor, pages: Tensor, per_page: int,
               k: int) -> tuple[Tensor, Tensor]:
    """``index_topk_reference`` in one kernel, one program per row: -> (rows [T, k] int32,
    n [T] int32)."""
    from . import triton_indexer as tk  # Triton is optional: imported when a fused kernel runs

    t, e = scores.shape
    scores = scores.contiguous()  # [T, E] fp32
    count, pages = count.contiguous(), pages.contiguous()  # [T] int32, [T, P] int32
    rows = torch.empty(t, k, dtype=torch.int32, device=scores.device)  # [T, k]
    n = torch.empty(t, dtype=torch.int32, device=scores.device)  # [T]
    if t == 0:
        return rows, n
    block = tk.TOPK_BLOCK if scores.is_cuda else tk.TOPK_BLOCK_INTERPRETED
    wrap_triton(tk.index_topk_kernel)[(t,)](
        scores, count, pages, rows, n, e, k, pages.shape[1], per_page, BLOCK=min(block, _pow2(e, 16)),
        BLOCK_K=min(_pow2(k), 1024), DIGITS=tk.DIGITS, DIGIT_BITS=tk.DIGIT_BITS,
        PASSES=tk.PASSES)
    return rows, n


@index_topk.register_fake
def _(scores, count, pages, per_page, k):
    t = scores.shape[0]
    return (scores.new_empty(t, k, dtype=torch.int32), scores.new_empty(t, dtype=torch.int32))
