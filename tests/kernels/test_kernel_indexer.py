"""The lightning indexer's fused ops (``nextn_graph.kernels.indexer``) against their references.

Interpreter tests (CPU tensors, ``TRITON_INTERPRET=1``) from small widths with tails
(Hi 5, di 40, E 100) to DeepSeek-V4-Flash's (Hi 64, di 128, k 512, E 2048 at an 8192
context; a few rows), fp32 and bf16 inputs; the scores also against the model's own
``Indexer._scores`` at bf16; the top-k exactly against the reference and against
``stable_topk``'s choice (ties, zeros, -0.0, all-equal rows, count 0, < k, = E, and one
row of 2**18 entries: a 1M context); the sm_90a builds; the fakes on the meta device.
Each tolerance is justified where it is set, the measured maxima in the docstrings.
"""

from __future__ import annotations

import pytest
import torch

from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.kernels import indexer
from nextn_graph.model.compressor import Indexer, stable_topk, stable_topk_terms
from nextn_graph.model.ops import RopeTable
from nextn_graph.parallel.group import TPGroup
from ulp import max_ulps

V4_K = 512  # V4-Flash's index_topk


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _requests(counts: list[int], e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows of 3 requests (row t in request (t + seed) % 3), each one page of E entries ->
    (pages [T, 1] int32, count [T] int32, pool rows Re = 3 E)."""
    req = (torch.arange(len(counts)) + seed) % 3
    return req.to(torch.int32).unsqueeze(1), torch.tensor(counts, dtype=torch.int32), 3 * e


def _base(pages: torch.Tensor, e: int) -> torch.Tensor:
    """[T] the key row of entry 0 of each row's one page of E entries."""
    return pages[:, 0].long() * e


def _finished(count: torch.Tensor, e: int) -> torch.Tensor:
    return torch.arange(e) < count.unsqueeze(1)  # [T, E]


# -- the scores --------------------------------------------------------------------------

# Hi, di, E, counts per row: small widths (tl.dot's 16 padded), tails, V4-Flash (E 2048)
SCORE_CASES = [(2, 32, 64, [64, 17]), (5, 40, 100, [100, 1, 0, 63]),
               (64, 128, 2048, [2048, 1500, 0, 300])]
# fp32 ULPs at the magnitude of the terms, sum_h |w_h| sum_i |q_hi k_i| (the dot's terms
# can cancel, so its error is relative to them, not to relu(q.k)). Both sides sum di
# products per head and Hi weighted heads in other orders: at worst (di + Hi) u each, 2 *
# (di + Hi) ULPs apart (384 at V4 widths); in practice ~sqrt of it. Measured over 4
# seeds: 0.5 fp32, 0.25 bf16 inputs (0.19 both at V4 widths); bound 4 (8x: the GPU's
# FMA contraction and dot order are not the interpreter's).
SCORE_ULPS = 4


def _score_inputs(hi, di, e, counts, dtype, seed):
    pages, count, re = _requests(counts, e, seed)
    base = _base(pages, e)
    q = _randn(len(counts), hi, di, seed=seed, dtype=dtype) * di ** -0.5  # [T, Hi, di]
    w = _randn(len(counts), hi, seed=seed + 1, dtype=dtype)  # [T, Hi]
    keys = _randn(re, di, seed=seed + 2, dtype=dtype)  # [Re, di]
    # entries no row has finished are NaN: the kernel must not read them
    slot = torch.arange(re)
    req_of, j = slot // e, slot % e
    last = torch.zeros(3, dtype=torch.long)
    last.scatter_reduce_(0, base // e, count.long(), "amax")
    keys[j >= last[req_of]] = float("nan")
    return q, w, keys, pages, count


@pytest.mark.parametrize("case", SCORE_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_match_reference(case, dtype):
    """At j < count within SCORE_ULPS of the fp32 reference (measured: see SCORE_ULPS);
    keys past every row's count are NaN and never reach a score."""
    hi, di, e, counts = case
    q, w, keys, pages, count = _score_inputs(hi, di, e, counts, dtype, seed=hi + di)
    out = indexer.index_scores(q, w, keys, pages, e, count, e)
    ref = indexer.index_scores_reference(q, w, keys, pages, e, count, e)
    terms = indexer.index_scores_reference(q.abs(), w.abs(), keys.abs(), pages, e, count, e)
    assert out.shape == (len(counts), e) and out.dtype == torch.float32
    done = _finished(count, e)
    assert not out[done].isnan().any()
    assert max_ulps(out[done], ref[done], scale=terms[done]) <= SCORE_ULPS


# bf16 ULPs at sum_h |w_h| relu(q_h . k), the op's fp32 scores against the model's bf16 bmms:
# those round each q_h . k to bf16 (<= u = 2**-8 relative: <= 1 ULP of the terms' sum,
# summed over heads) and the result once (<= half an ULP): 1.5 ULPs apart at most, plus
# the fp32 orders' error (~2**-16 of it). Measured 1.17 (tiny, over 3 seeds), 0.65 (V4
# widths); bound 2.
MODEL_ULPS = 2


@pytest.mark.parametrize("preset,e,positions", [
    ("tiny", 128, [511, 3, 64, 200]), ("flash-slice", 1024, [4095, 2000, 2, 700])])
def test_scores_match_the_models_indexer_at_bf16(preset, e, positions):
    """``Indexer._scores`` on the gathered [T, E, di] keys (bf16 weights, its RoPE'd and
    scaled q) against the op on the flat keys, at the finished entries: MODEL_ULPS."""
    cfg = preset_config(preset)
    torch.manual_seed(0)
    ix = Indexer(cfg, 4, TPGroup.single()).to(torch.bfloat16)
    rope = RopeTable(cfg, compressed=True).to(torch.bfloat16)  # as in a bf16 model
    t = len(positions)
    pos = torch.tensor(positions)
    x = _randn(t, cfg.hidden_size, seed=1, dtype=torch.bfloat16)
    qr = _randn(t, cfg.q_lora_rank, seed=2, dtype=torch.bfloat16)
    pages, _, re = _requests([0] * t, e, seed=1)
    base = _base(pages, e)
    count = ((pos + 1) // 4).clamp(max=e).to(torch.int32)
    keys = _randn(re, ix.head_dim, seed=3, dtype=torch.bfloat16)  # [Re, di] normed-like
    rot = ix.rotation(rope, pos)
    model = ix._scores(x, qr, rot, keys.view(3, e, -1)[base // e])  # [T, E] bf16

    q = ix.kernels.rope(ix.wq_b(qr).view(t, ix.n_heads, ix.head_dim), rot, False)
    w = ix.weights_proj(x)  # [T, Hi]
    out = indexer.index_scores(q, w, keys, pages, e, count, e)
    k = keys.float()[indexer._slots(pages, e, e)]  # [T, E, di]
    relu = torch.bmm(q.float(), k.transpose(1, 2)).relu()
    scale = torch.bmm(w.float().abs().unsqueeze(1), relu).squeeze(1)  # sum_h |w| relu
    done = _finished(count, e)
    assert max_ulps(out[done], model[done], scale=scale[done]) <= MODEL_ULPS


# -- the top-k ---------------------------------------------------------------------------

def _check_topk(scores, count, pages, per_page, k):
    """Exactly the reference; the set is stable_topk's first n on the same scores with
    unfinished entries masked. Unfinished slots hold NaN for the op (it must not read
    them) and +1e30 for stable_topk (its mask must win)."""
    t, e = scores.shape
    done = _finished(count, e)
    rows, n = indexer.index_topk(scores.masked_fill(~done, float("nan")), count, pages,
                                 per_page, k)
    ref_rows, ref_n = indexer.index_topk_reference(scores, count, pages, per_page, k)
    assert (rows.dtype, n.dtype) == (torch.int32, torch.int32)
    assert torch.equal(n, ref_n) and torch.equal(rows, ref_rows)
    entry0 = pages[:, 0].long() * per_page
    for i in range(t):
        assert (rows[i, n[i]:] == entry0[i]).all()
    if scores.isinf().any():  # stable_topk's key is inf - inf = NaN there (real scores
        return rows, n  # are finite sums): the reference alone
    picked = stable_topk(scores.masked_fill(~done, 1e30).double(), min(k, e),
                         *stable_topk_terms(done))
    for i in range(t):
        want = indexer.key_rows(pages[i:i + 1], per_page, picked[i:i + 1, : n[i]].sort().values)
        assert torch.equal(rows[i, : n[i]].long(), want[0])
    return rows, n


def _tie_scores(kind: str, t: int, e: int, seed: int) -> torch.Tensor:
    """[T, E] fp32 score patterns built to tie."""
    g = torch.Generator().manual_seed(seed)
    if kind == "few_values":  # many equal scores, negatives too
        return torch.randint(-2, 3, (t, e), generator=g).float() * 0.75
    if kind == "signed_zeros":  # 0.0 and -0.0 (equal) around a few positives / negatives
        s = torch.where(torch.rand(t, e, generator=g) < 0.5, 0.0, -0.0)
        pick = torch.rand(t, e, generator=g)
        return torch.where(pick < 0.05, 1.0, torch.where(pick > 0.95, -1.0, s))
    if kind == "all_equal":
        return torch.full((t, e), 2.5)
    if kind in ("extremes", "infinities"):  # subnormals, +-max (+-inf): the key's range
        vals = [1e-40, -1e-40, 3.4e38, -3.4e38, 0.0, -0.0, 1.0, -1.0]
        vals = torch.tensor(vals + ([float("inf"), -float("inf")] if kind == "infinities"
                                    else []))
        return vals[torch.randint(0, len(vals), (t, e), generator=g)]
    return torch.randn(t, e, generator=g)  # distinct


@pytest.mark.parametrize("kind", ["few_values", "signed_zeros", "all_equal", "extremes",
                                  "infinities", "distinct"])
@pytest.mark.parametrize("k", [1, 16, 64])
def test_topk_ties_counts_and_the_stable_order(kind, k):
    """E 300, rows with count E, 0, 1, < k, k, > k (tails of the 16-wide tiles): exact."""
    e = 300
    counts = [e, 0, 1, 10, k, 77, 299, e]
    pages, count, _ = _requests(counts, e, seed=k)
    _check_topk(_tie_scores(kind, len(counts), e, seed=k), count, pages, e, k)


def test_topk_at_v4_widths_on_the_kernels_own_scores():
    """index_scores then index_topk at V4-Flash widths, k 512: exact on those scores."""
    hi, di, e, counts = SCORE_CASES[-1]
    q, w, keys, pages, count = _score_inputs(hi, di, e, counts, torch.bfloat16, seed=5)
    scores = indexer.index_scores(q, w, keys, pages, e, count, e)
    done = _finished(count, e)
    rows, n = _check_topk(scores.masked_fill(~done, 0.0), count, pages, e, V4_K)
    assert n.tolist() == [min(c, V4_K) for c in counts]


def test_topk_over_a_million_token_context():
    """Rows of 2**18 entries (1M context / 4), k 512, scores on bf16's grid (ties at the
    threshold among 262144 values) and distinct ones: exact."""
    e = 2 ** 18
    pages, count, _ = _requests([e, e - 5], e, seed=0)
    ties = _randn(1, e, seed=7).to(torch.bfloat16).float()
    _check_topk(torch.cat((ties, _randn(1, e, seed=8))), count, pages, e, V4_K)


def test_no_entries_yet():
    """A sequence shorter than one C4 block: E = 0 slots, k = 0 (no program to launch)."""
    q, w, keys, pages, count = _score_inputs(4, 32, 16, [0, 0], torch.float32, seed=3)
    assert indexer.index_scores(q, w, keys[:0], pages * 0, 16, count, 0).shape == (2, 0)
    rows, n = indexer.index_topk(torch.empty(2, 0), count, pages * 0, 16, 0)
    assert rows.shape == (2, 0) and n.tolist() == [0, 0]


# -- pages -------------------------------------------------------------------------------

@pytest.mark.parametrize("per_page", [16, 7, 64])
def test_paged_keys_score_and_pick_as_the_flat_ones(per_page):
    """3 requests' keys scattered over shuffled pages (page 0 and pages no row reaches
    NaN): the scores equal the flat layout's bitwise, the top-k rows are the flat picks
    through the page table, and both ops equal their references."""
    hi, di, e, counts = 5, 40, 100, [100, 1, 0, 63, 99]
    q, w, flat, flat_pages, count = _score_inputs(hi, di, e, counts, torch.float32, seed=11)
    p = -(-e // per_page)  # pages per request
    order = torch.randperm(3 * p, generator=torch.Generator().manual_seed(per_page)) + 1
    table = order.view(3, p).to(torch.int32)  # [3, P] request -> page ids (1..3P)
    keys = torch.full(((3 * p + 2) * per_page, di), float("nan"))  # pages 0..3P+1
    for r in range(3):
        for j in range(e):
            keys[table[r, j // per_page] * per_page + j % per_page] = flat[r * e + j]
    pages = table[flat_pages[:, 0].long()]  # [T, P] each row's request's pages
    out = indexer.index_scores(q, w, keys, pages, per_page, count, e)
    want = indexer.index_scores(q, w, flat, flat_pages, e, count, e)
    done = _finished(count, e)
    assert torch.equal(out[done], want[done])
    ref = indexer.index_scores_reference(q, w, keys, pages, per_page, count, e)
    assert max_ulps(out[done], ref[done], scale=indexer.index_scores_reference(
        q.abs(), w.abs(), keys.abs(), pages, per_page, count, e)[done]) <= SCORE_ULPS
    scores = out.masked_fill(~done, 0.0)
    rows, n = _check_topk(scores, count, pages, per_page, 16)
    flat_rows, _ = indexer.index_topk(scores, count, flat_pages, e, 16)
    entries = flat_rows.long() - _base(flat_pages, e).unsqueeze(1)  # [T, k] entry ids
    assert torch.equal(rows.long(), indexer.key_rows(pages, per_page, entries))


# -- builds and fakes --------------------------------------------------------------------


def test_fakes_give_the_references_shapes_and_dtypes():
    q, w, keys, pages, count = _score_inputs(4, 32, 64, [64, 3, 0], torch.bfloat16, seed=9)
    meta = lambda v: v.to("meta")  # noqa: E731
    scores = indexer.index_scores_reference(q, w, keys, pages, 64, count, 64)
    fused = indexer.index_scores(meta(q), meta(w), meta(keys), meta(pages), 64, meta(count), 64)
    pairs = [(fused, scores)]
    pairs += zip(indexer.index_topk(meta(scores), meta(count), meta(pages), 64, 16),
                 indexer.index_topk_reference(scores, count, pages, 64, 16))
    for got, ref in pairs:
        assert got.device.type == "meta"
        assert (got.shape, got.dtype) == (ref.shape, ref.dtype)


def test__key_orders_scores_as_floats_and_zeros_masked_slots():
    """``triton_indexer._key`` (the radix select's key) under the interpreter: keys of
    finite scores order exactly as the scores (ties equal, -0.0 = 0.0), the uint32 key is
    the reference's bit transform, and masked slots read 0 without a load."""
    from jit_probes import key_probe

    scores = torch.tensor([3.5, -0.0, 0.0, -2.0, 1e-40, -1e-40, 3.5, float("inf"),
                           -float("inf"), 7.25, -7.25, 2.0 ** -126], dtype=torch.float32)
    n, block = scores.numel(), 16
    out = torch.full((block,), -1, dtype=torch.int64)
    key_probe[(1,)](scores, out, n, BLOCK=block)
    s = torch.where(scores == 0, torch.zeros_like(scores), scores)
    bits = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    want = torch.where(bits >> 31 != 0, ~bits & 0xFFFFFFFF, bits | 0x80000000)
    assert torch.equal(out[:n], want)
    assert bool((out[n:] == 0).all())
    a, b = scores.unsqueeze(1), scores.unsqueeze(0)
    ka, kb = out[:n].unsqueeze(1), out[:n].unsqueeze(0)
    assert torch.equal(ka < kb, a < b) and torch.equal(ka == kb, a == b)
