"""V4's sparse attention over index lists (``nextn_graph.kernels.attention``).

Interpreter tests (CPU tensors, ``TRITON_INTERPRET=1``) of the fused op against its
reference, from the tiny preset's widths (H 4, d 32) and a tail shape (H 5, d 40) to
DeepSeek-V4-Flash's (H 64, d 512, window 128 + slack, C4 top-k 512, C128 1024 entries; few
rows at full width), fp32 and bf16, with and without compressed entries; the list
semantics against ``model/ops.py``'s ``sink_attention`` on the equivalent dense key set
with masks (today's math); list slots past the counts never read (huge and negative
garbage, NaN rows behind them); one op, one launch; the fakes on meta; the sm_90a builds.

Tolerances are in ULPs of the output dtype (``ulp.py``) at the magnitude of
``sum_j p_j |key_j|`` per output element (float64 p): an attention output is a weighted
sum whose terms may cancel, and every error here (scores summed in another order, exp,
the online rescaling, the one division) is relative to that sum, not to the result.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from nextn_graph.kernels import attention, triton_attn
from nextn_graph.model.ops import mask_bias, sink_attention
from oplog import OpLog
from ulp import max_ulps

DTYPES = [torch.float32, torch.bfloat16]
GARBAGE = (2 ** 31 - 1, -2 ** 31, 10 ** 9, -10 ** 9)  # list slots past the counts


@dataclass(frozen=True)
class Shape:
    """T rows of H heads of width d; lists of W window and K compressed slots (K 0: none)
    with each row's counts; ring, chunk and entry rows (the last of each a NaN row that
    only garbage slots name)."""

    name: str
    h: int
    d: int
    w: int
    k: int
    ratio: int  # what the compressed list holds (0: none, 4: top-k, 128: every entry)
    swa: tuple[int, ...]
    cmp: tuple[int, ...]
    rows: tuple[int, int, int]  # ring, chunk, entries


SHAPES = [
    # tiny preset; counts 1..W, cmp 0 rows, a full list (W 10, K 16)
    Shape("tiny", 4, 32, 10, 16, 4, (1, 5, 10, 3, 8, 10), (0, 3, 16, 0, 9, 1), (24, 7, 20)),
    Shape("tiny-window", 4, 32, 10, 0, 0, (1, 6, 10), (), (24, 4, 0)),  # ratio 0
    Shape("tail", 5, 40, 9, 7, 128, (9, 1, 4), (7, 0, 2), (12, 5, 9)),  # head and width masks
    # V4-Flash: C4 (top-k 512), window-only, C128 at 131072 context (1024 entries)
    Shape("v4-c4", 64, 512, 136, 512, 4, (1, 5, 128), (0, 37, 512), (300, 6, 700)),
    Shape("v4-window", 64, 512, 136, 0, 0, (1, 128), (), (300, 3, 0)),
    Shape("v4-c128", 64, 512, 136, 1024, 128, (128,), (1024,), (200, 2, 1100)),
]


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _case(s: Shape, dtype: torch.dtype, seed: int = 0, garbage: bool = True) -> dict:
    """The op's arguments. Window slots mix ring rows and the forward's own (negative)
    rows, interleaved; compressed slots name distinct entries. Past the counts: GARBAGE
    and the NaN rows' indices (or, ``garbage=False``, zeros and no NaN row)."""
    g = torch.Generator().manual_seed(seed)
    t = len(s.swa)
    n_ring, n_chunk, n_entries = s.rows
    swa_idx = torch.zeros(t, s.w, dtype=torch.int32)
    cmp_idx = torch.zeros(t, max(s.k, 1), dtype=torch.int32)
    for r, n in enumerate(s.swa):
        ring_rows = torch.randint(0, n_ring - 1, (n,), generator=g)
        own_rows = -1 - torch.randint(0, n_chunk - 1, (n,), generator=g)
        own = torch.rand(n, generator=g) < 0.3
        own[-1] = True  # the row's own position is the forward's
        swa_idx[r, :n] = torch.where(own, own_rows, ring_rows).int()
        if garbage:
            junk = torch.tensor(GARBAGE + (n_ring - 1, -n_chunk), dtype=torch.int32)
            swa_idx[r, n:] = junk.repeat(s.w)[:s.w - n]
    for r, n in enumerate(s.cmp):
        cmp_idx[r, :n] = torch.randperm(n_entries - 1, generator=g)[:n].int()
        if garbage:
            junk = torch.tensor(GARBAGE + (n_entries - 1,), dtype=torch.int32)
            cmp_idx[r, n:] = junk.repeat(s.k)[:s.k - n]
    ring = _randn(n_ring, s.d, gen=g)
    chunk = _randn(n_chunk, s.d, gen=g)
    entries = _randn(n_entries, s.d, gen=g)
    if garbage:
        ring[-1], chunk[-1] = float("nan"), float("nan")
        if n_entries:
            entries[-1] = float("nan")
    has_cmp = s.k > 0
    return dict(q=_randn(t, s.h, s.d, gen=g, scale=2.0).to(dtype), ring=ring.to(dtype),
                chunk=chunk.to(dtype), swa_idx=swa_idx,
                swa_count=torch.tensor(s.swa, dtype=torch.int32),
                entries=entries.to(dtype) if has_cmp else None,
                cmp_idx=cmp_idx if has_cmp else None,
                cmp_count=torch.tensor(s.cmp, dtype=torch.int32) if has_cmp else None,
                sink=_randn(s.h, gen=g).float(), scale=s.d ** -0.5, ratio=s.ratio)


def _as(args: dict, dtype: torch.dtype) -> dict:
    """The arguments with every float tensor but the sink in ``dtype``."""
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
            and k != "sink" else v for k, v in args.items()}


def _terms(args: dict) -> torch.Tensor:
    """sum_j p_j |key_j| [T, H, d] in float64: the magnitude the tolerances are taken at."""
    a = _as(args, torch.float64)
    keys, live = attention.gather_keys(a["ring"], a["chunk"], a["swa_idx"], a["swa_count"],
                                       a["entries"], a["cmp_idx"], a["cmp_count"])
    scores = a["scale"] * torch.einsum("thd,tnd->thn", a["q"], keys)
    scores = scores.masked_fill(~live.unsqueeze(1), float("-inf"))
    sink = a["sink"].double().view(1, -1, 1).expand(scores.shape[0], -1, 1)
    p = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]  # [T, H, N]
    return torch.einsum("thn,tnd->thd", p, keys.abs())


# fp32 against the float64 math (the reference on float64 copies, ``_truth``): the scores
# sum d fp32 products (|ds| ~ sqrt(d) u sum|q_i k_i| scale: ~2e-6 at V4 widths, far under the
# worst case d u), then exp (~1 ULP), the online rescaling (a few roundings a step), p.k
# summed over the keys and the one division; a score error ds moves the output by at most
# 2 max|ds| sum_j p_j |k_j|. Measured: fused 14 at V4 widths (6 tiny), the fp32 reference
# itself 33 (MKL's blocked sums); bound 64: ~4x the fused op's, ~2x the reference's.
TRUTH_ULPS = 64
# fused vs the fp32 reference: the two errors against the truth add up.
FP32_ULPS = 2 * TRUTH_ULPS
# bf16, fused vs the fp32 reference on the same (bf16) values, rounded to bf16: p is
# rounded to bf16 for the p.k product (the tensor cores' operand: relative 2^-8 a weight on
# the GPU, which rounds; 2^-7 under the interpreter, which truncates: <= 2 ULPs of
# sum p|k|, an ULP at m being >= 2^-8 m), the output rounded once (truncated here: < 1 ULP),
# the reference's own rounding (0.5): 3.5, bound 4.
BF16_ULPS = 4
# bf16, fused vs today's bf16 math (the reference in bf16): that one rounds each score to
# bf16, moving its weight by up to 2^-8 |s| relative (|s| up to ~8 here: up to ~8 ULPs of
# sum p|k| where one such key dominates), then the probabilities and the output (~2 more).
# Measured 7 (3 seeds); bound 16.
BF16_TODAY_ULPS = 16


def _interleaved(args: dict) -> bool:
    """Some row's listed window slots go ring, own, ring, ... (two changes of source)."""
    for idx, n in zip(args["swa_idx"], args["swa_count"]):
        own = idx[:n] < 0
        if (own[1:] != own[:-1]).sum() >= 2:
            return True
    return False


def _truth(args: dict) -> torch.Tensor:
    """The reference's math in float64 on the same values -> float64 [T, H, d]."""
    return attention.sparse_attn_reference(**_as(args, torch.float64))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(shape, dtype):
    """Rows of different counts (1, 5, W...), cmp_count 0 rows, ring and own rows
    interleaved, garbage and NaN rows past the counts. Measured (3 seeds): fp32 vs the
    float64 math <= 14 ULPs (tiny 6), vs the fp32 reference <= 42 (tiny 11); bf16 vs the
    fp32 reference <= 3, vs today's bf16 math <= 7."""
    args = _case(shape, dtype, seed=shape.d + shape.k)
    assert _interleaved(args)
    out = attention.sparse_attn(**args)
    assert out.dtype == dtype and out.shape == args["q"].shape
    assert not out.isnan().any()
    terms = _terms(args)
    if dtype == torch.float32:
        assert max_ulps(out, _truth(args).float(), scale=terms) <= TRUTH_ULPS
        assert max_ulps(out, attention.sparse_attn_reference(**args), scale=terms) <= FP32_ULPS
        return
    ref32 = attention.sparse_attn_reference(**_as(args, torch.float32)).to(dtype)
    assert max_ulps(out, ref32, scale=terms) <= BF16_ULPS
    today = attention.sparse_attn_reference(**args)
    assert max_ulps(out, today, scale=terms) <= BF16_TODAY_ULPS


def _dense(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Today's key set of the same rows, as the model gathers it: the W window slots
    (slots past the count masked; their keys finite, the ring's row 0), then EVERY entry
    row with a mask of the listed ones -> (keys [T, W + Re, d], bias [T, W + Re])."""
    ring, chunk = args["ring"], args["chunk"]
    t, w = args["swa_idx"].shape
    live = torch.arange(w) < args["swa_count"].unsqueeze(1)  # [T, W]
    v = torch.where(live, args["swa_idx"], 0).long()
    keys = torch.where((v < 0).unsqueeze(-1), chunk[(-1 - v).clamp(min=0)], ring[v.clamp(min=0)])
    valid = live
    if args["entries"] is not None:
        entries = args["entries"].nan_to_num(0.0)  # unlisted rows: masked, finite
        listed = torch.zeros(t, entries.shape[0], dtype=torch.bool)
        for r in range(t):
            listed[r, args["cmp_idx"][r, :args["cmp_count"][r]].long()] = True
        keys = torch.cat((keys, entries.expand(t, -1, -1)), dim=1)
        valid = torch.cat((valid, listed), dim=1)
    return keys, mask_bias(valid, keys.dtype)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s.h < 64] + [SHAPES[3]],
                         ids=lambda s: s.name)
def test_list_semantics_equal_todays_dense_attention(shape):
    """The lists' keys are today's masked dense set: ``sink_attention`` over it equals the
    reference (other columns, so MKL sums in other blocks: both within the reference's
    error of the truth, measured <= 18 ULPs apart; 0 where the sets' columns are the same,
    the window-only shapes) and the fused op (measured <= 42)."""
    args = _case(shape, torch.float32, seed=shape.w)
    keys, bias = _dense(args)
    today = sink_attention(args["q"], keys, bias, args["sink"], args["scale"])
    terms = _terms(args)
    assert max_ulps(attention.sparse_attn_reference(**args), today, scale=terms) <= TRUTH_ULPS
    assert max_ulps(attention.sparse_attn(**args), today, scale=terms) <= FP32_ULPS


@pytest.mark.parametrize("shape", SHAPES[:3], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_slots_past_the_counts_are_never_read(shape, dtype):
    """Huge, negative and NaN-row garbage past the counts changes no bit of the output
    (the same lists with zeros there and no NaN rows) of the fused op or the reference."""
    dirty = _case(shape, dtype, seed=3)
    clean = _case(shape, dtype, seed=3, garbage=False)
    for live, rows in (("swa_count", "swa_idx"), ("cmp_count", "cmp_idx")):
        if dirty[live] is not None:  # the listed part is the same in both
            n = torch.arange(dirty[rows].shape[1]) < dirty[live].unsqueeze(1)
            assert torch.equal(dirty[rows][n], clean[rows][n])
            assert (dirty[rows][~n] != clean[rows][~n]).all()
    for op in (attention.sparse_attn, attention.sparse_attn_reference):
        assert torch.equal(op(**dirty), op(**clean))


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: s.name)
def test_one_op_one_launch(shape):
    """The dispatcher sees one op (no casts, no copies of contiguous inputs) and it
    launches sparse_attn_kernel once (Triton's pre-run hook), through torch.ops too."""
    args = _case(shape, torch.float32, seed=5)
    launched: Counter = Counter()
    kernel = triton_attn.sparse_attn_kernel

    def hook(*a, **kw):
        launched.update(["sparse_attn_kernel"])
    kernel.add_pre_run_hook(hook)
    try:
        with OpLog() as log:
            out = torch.ops.nextn_graph.sparse_attn(*args.values())
    finally:
        kernel.pre_run_hooks.remove(hook)
    assert log.ops == [torch.ops.nextn_graph.sparse_attn.default]
    assert launched == Counter(sparse_attn_kernel=1)
    assert torch.equal(out, attention.sparse_attn(**args))


def test_entries_and_ratio_must_agree():
    """The compressed list comes whole or not at all, with a ratio of 4 or 128 (0 without)."""
    args = _case(SHAPES[0], torch.float32)
    with pytest.raises(ValueError, match="ratio 0 iff"):
        attention.sparse_attn(**{**args, "ratio": 0})
    with pytest.raises(ValueError, match="come together"):
        attention.sparse_attn(**{**args, "cmp_count": None})
    with pytest.raises(ValueError, match="one of"):
        attention.sparse_attn(**{**args, "ratio": 8})


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[1]], ids=lambda s: s.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fake_gives_the_references_shape_and_dtype(shape, dtype):
    """On the meta device (the work profile) the fake returns what the reference does."""
    args = _case(shape, dtype)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out = attention.sparse_attn(**meta)
    ref = attention.sparse_attn_reference(**args)
    assert out.device.type == "meta"
    assert (out.shape, out.dtype) == (ref.shape, ref.dtype)
