"""The compressor's fused pooling, norm and RoPE (``nextn_graph.kernels.compress``).

- ``compress_reference`` is bitwise the model's ``Compressor.cached`` entries (and
  ``dense``'s) for a tiny Compressor, fp32 and bf16, C4 (coff 2) and C128-like (coff 1).
- The fused op against the reference under Triton's interpreter (CPU tensors,
  ``TRITON_INTERPRET=1``): V4-Flash widths (C128: ratio 128, d 512, span 128; C4: ratio 4,
  d 512 and the indexer's d 128, span 8), small widths for the tails (d not a power of two,
  span not a multiple of the tile), fp32 and bf16, rows whose candidates mix ring and chunk,
  rows at positions < span - 1 whose missing candidates carry garbage indices (NaN rows,
  indices far out of range: a read would show), K = 1..16.
- The sm_90a build of every kernel; the fake on the meta device.

Tolerances are ULPs of the output dtype at the magnitude of the terms (``_scale``): an
output is a rotation (two terms) of normed channels, each a softmax-weighted sum of
values of either sign, so its error is bounded relative to sum_i |w_i v_i| carried
through the norm and the rotation, not to the (possibly cancelled) result.
"""

from __future__ import annotations

import pytest
import torch

from nextn_graph.checkpoint.presets import preset_config
from nextn_graph.kernels import compress
from nextn_graph.kernels.norm import apply_rope
from nextn_graph.memory.batch import Chunk, ForwardBatch, ForwardPlan
from nextn_graph.memory.pool import CompressedCache, Ring
from nextn_graph.model.compressor import Compressor
from nextn_graph.model.ops import RopeTable
from ulp import max_ulps

EPS = 1e-6  # the presets' rms_norm_eps
DTYPES = [torch.float32, torch.bfloat16]
INT32 = torch.iinfo(torch.int32)


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _rotation(k: int, d: int, seed: int) -> torch.Tensor:
    """[K, d/2, 2, 2] fp32 like ``RopeTable.rotation``: identity on the first half of the
    pairs (the no-RoPE dims), random angles on the rest."""
    angle = torch.rand(k, d // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    angle[:, : d // 4] = 0
    c, s = angle.cos(), angle.sin()
    return torch.stack((c, s, -s, c), dim=-1).unflatten(-1, (2, 2))


def _case(ratio: int, coff: int, d: int, positions: list[int], dtype: torch.dtype, seed: int):
    """Inputs of K = len(positions) entries: a ring of 2*span rows and a chunk of span rows
    (values ~ N(0, 1), scores ~ N(0, 1), ape ~ N(0, 0.5)), each with one NaN row that only
    garbage indices name. Rows alternate: a prefix of candidates from the ring and the rest
    from the chunk (the model's layout), or each candidate's source at random; row 0 reads
    the chunk only, row 1 the ring only. -> (args with the garbage indices, the same with
    every missing candidate's index 0: the reference reads it, harmlessly)."""
    span, f = coff * ratio, 2 * coff * d
    n_ring, n_chunk = 2 * span, span
    g = torch.Generator().manual_seed(seed)
    ring = _randn(n_ring + 1, f, seed=seed + 1).to(dtype)  # [Rr, F]
    chunk = _randn(n_chunk + 1, f, seed=seed + 2).to(dtype)  # [Tc, F]
    ring[-1], chunk[-1] = float("nan"), float("nan")  # rows only garbage names
    k = len(positions)
    slot = torch.randint(0, n_ring, (k, span), generator=g)
    row = torch.randint(0, n_chunk, (k, span), generator=g)
    split = torch.randint(0, span + 1, (k, 1), generator=g)
    prefix = torch.arange(span) < split  # [K, span]
    coin = torch.rand(k, span, generator=g) < 0.5
    from_ring = torch.where(torch.arange(k).unsqueeze(1) % 2 == 0, prefix, coin)
    from_ring[0] = False  # row 0: the chunk only
    if k > 1:
        from_ring[1] = True  # row 1: the ring only
    idx = torch.where(from_ring, slot, -1 - row).to(torch.int32)  # [K, span]
    pos = torch.tensor(positions, dtype=torch.int64)  # [K]
    missing = (pos.unsqueeze(1) - span + 1 + torch.arange(span)) < 0  # [K, span]
    garbage = torch.tensor([n_ring, -1 - n_chunk, INT32.max, INT32.min, 10 ** 9, -10 ** 9])
    junk = garbage[torch.arange(k * span).view(k, span) % len(garbage)].to(torch.int32)
    ape = _randn(ratio, coff * d, seed=seed + 3, scale=0.5).to(dtype)
    weight = (_randn(d, seed=seed + 4, scale=0.2) + 1).to(dtype)
    rot = _rotation(k, d, seed + 5)
    tail = (pos, ape, weight, EPS, rot, ratio, coff)
    return ((ring, chunk, torch.where(missing, junk, idx), *tail),
            (ring, chunk, torch.where(missing, 0, idx), *tail))


def _scale(ring, chunk, idx, pos, ape, weight, eps, rot, ratio, coff) -> torch.Tensor:
    """[K, d] float64: the rotation's sum_i |y_i rot_ij| of the normed channels y, each
    channel taken at sum_i w_i |v_i| (the softmax-weighted sum of its terms' magnitudes)."""
    d = ape.shape[1] // coff
    cand = compress.gather_candidates(ring.double(), chunk.double(), idx)
    bias = compress.pool_bias(pos, coff * ratio, torch.float64)
    pooled = compress.pool(cand, bias, ape.double(), ratio, coff)  # [K, d]
    cand[..., : coff * d] = cand[..., : coff * d].abs()
    terms = compress.pool(cand, bias, ape.double(), ratio, coff)  # [K, d]
    r = (pooled.square().mean(dim=-1, keepdim=True) + eps).rsqrt()
    return apply_rope(terms * r * weight.double().abs(), rot.double().abs())


# -- the fused op against the reference ------------------------------------------------

# ratio, coff, d, positions (K of them): V4's three compressors (C128, C4 and the C4
# indexer's width), then small widths: d 24 pads 12 pairs to 16, span 16 is two tiles,
# span 6 three tiles of 2 (d 8), K = 1 and K = 16. Positions below span - 1 miss
# candidates (C4's block -1; for C128 only padding rows do).
CASES = {
    "c128-d512": (128, 1, 512, [5, 127, 5119]),
    "c4-d512": (4, 2, 512, [0, 2, 3, 6, 7, 4095]),
    "c4-d128-k16": (4, 2, 128, [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 15, 19, 63, 99, 511, 4095]),
    "c4-d24-k1": (4, 2, 24, [3]),
    "ratio16-d40": (16, 1, 40, [0, 9, 15, 31, 47]),
    "ratio6-d8": (6, 1, 8, [4, 5]),
}
# Bounds, ULPs of the output dtype at ``_scale``. fp32: both sides compute in fp32 and
# differ in the softmax's order and roundings: the reference rounds each weight
# exp(s_i - m) / sum and each product w_i v_i, the kernel sums exp(s_i - m) v_i and
# divides once; exp itself may differ by an ULP or two (numpy's, torch's, the GPU's). A
# weighted sum of n terms in another order differs by up to ~n u of its terms in the worst
# case, ~sqrt(n) u in practice; the norm (8 ULP, test_kernel_norm) and the two-term rotation
# (1.5 ULP) add to it. Measured over 3 seeds: 6 (span 8, d 128), 3 (span 128, d 512), 5 at
# the small widths: bound 32.
# bf16: the reference rounds score + ape to bf16 (|ds| <= u|s|, |s| up to ~5 here: each
# weight off by up to 2u*5 relative, 10 ULP of a dominant term if every error aligned),
# then the weights, the products and the pooled sum (1 ULP each), the norm's steps (4.5)
# and the rotation (1.5) to bf16; the kernel computes in fp32 and truncates once (1 ULP):
# ~20 ULP with every error aligned, the score errors' random signs keep it far lower.
# Measured over 3 seeds: 3 (span 8 and span 128), 2.5 at the small widths: bound 16.
ULPS = {torch.float32: 32.0, torch.bfloat16: 16.0}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_compress_pool_matches_the_reference(name, dtype):
    """Measured max (at the terms' scale): see ULPS."""
    ratio, coff, d, positions = CASES[name]
    args, clean = _case(ratio, coff, d, positions, dtype, seed=len(name) + d)
    ref = compress.compress_reference(*clean)
    out = compress.compress_pool(*args)  # the garbage indices: never read
    assert out.shape == ref.shape == (len(positions), d)
    assert out.dtype == ref.dtype == dtype
    assert out.isfinite().all() and ref.isfinite().all()
    assert max_ulps(out, ref, _scale(*clean)) <= ULPS[dtype]
    assert out.abs().amax() > 0.5  # not vacuous


def test_missing_candidates_do_not_count():
    """A C4 row at position 3 (block -1 missing, its indices garbage) pools block 0
    alone: the fused entry equals that pooling written out in torch."""
    ratio, coff, d = 4, 2, 128
    args, clean = _case(ratio, coff, d, [3], torch.float32, seed=11)
    ring, chunk, idx, pos, ape, weight, eps, rot, _, _ = clean
    cand = compress.gather_candidates(ring, chunk, idx)[:, ratio:]  # [1, 4, F]: block 0
    own = cand.view(1, ratio, 2, 2, d)[:, :, :, 1]  # the second half-channels
    s = own[:, :, 1] + ape.view(ratio, 2, d)[:, 1]  # [1, 4, d]
    pooled = (own[:, :, 0] * s.softmax(dim=1)).sum(dim=1)  # [1, d]
    r = (pooled.square().mean(dim=-1, keepdim=True) + eps).rsqrt()
    want = apply_rope(pooled * r * weight, rot)
    out = compress.compress_pool(*args)
    assert max_ulps(out, want, _scale(*clean)) <= ULPS[torch.float32]


# -- the reference is the model --------------------------------------------------------

def _compressor(ratio: int, d: int, dtype: torch.dtype):
    cfg = preset_config("tiny")
    torch.manual_seed(ratio + d)
    comp = Compressor(cfg, ratio, d)
    with torch.no_grad():
        comp.ape.normal_(0, 0.5)
        comp.norm.weight.normal_(1, 0.2)
    return cfg, comp.to(dtype), RopeTable(cfg, compressed=True).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ratio, d", [(4, 32), (16, 32)], ids=["c4", "ratio16-coff1"])
def test_reference_is_bitwise_the_models_cached_entries(ratio, d, dtype):
    """Two requests (one resuming from the ring at position 9, one starting at 0) and
    padding: every entry ``cached`` writes equals ``compress_reference`` on the ring as it
    was, the forward's raw rows and RingIndex's candidates, bitwise."""
    cfg, comp, rope = _compressor(ratio, d, dtype)
    span, n = comp.span, 24
    chunks = [Chunk(1, 9, list(range(n))), Chunk(2, 0, list(range(n)))]
    batch = ForwardBatch.from_chunks(chunks, pad_to=2 * n + 3)
    plan = ForwardPlan(batch)
    size, per_request = span + n - 1, 64
    ring = Ring(_randn(3 * size, 2 * comp.coff * d, seed=ratio).to(dtype), size)
    table = torch.arange(3, dtype=torch.int32).unsqueeze(1)  # one page a request: row r
    cache = CompressedCache(ring, torch.zeros(3 * per_request, d, dtype=dtype), per_request,
                            per_request, table)
    x = _randn(batch.num_rows, cfg.hidden_size, seed=d).to(dtype)
    before = ring.data.clone()
    comp.cached(x, plan, cache, rope)

    rows = plan.block_closers(ratio)
    index = ring.index(rows, span)
    idx = torch.where(index.from_ring.squeeze(-1), index.slot, -1 - index.chunk_row)
    p = rows.batch.positions
    rot = rope.rotation((p + 1 - ratio).clamp(min=0), d)
    ref = compress.compress_reference(
        before, comp.raw(x), idx.to(torch.int32), p, comp.ape, comp.norm.weight,
        comp.norm.eps, rot, ratio, comp.coff, eps_tensor=comp.norm.eps_tensor)
    closes = ((p + 1) % ratio == 0) & (rows.batch.req_index > 0)
    slot = rows.batch.req_index * per_request + (p + 1) // ratio - 1
    assert closes.sum() == sum((c.start + n) // ratio - c.start // ratio for c in chunks)
    assert torch.equal(cache.entries[slot[closes]], ref[closes])
    # without the model's eps tensor: the one made from eps is the same
    again = compress.compress_reference(
        before, comp.raw(x), idx.to(torch.int32), p, comp.ape, comp.norm.weight,
        comp.norm.eps, rot, ratio, comp.coff)
    assert torch.equal(again[closes], ref[closes])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ratio, d", [(4, 32), (16, 32)], ids=["c4", "ratio16-coff1"])
def test_reference_is_bitwise_the_models_dense_entries(ratio, d, dtype):
    """``dense`` over one sequence equals the reference with the sequence as the chunk
    (candidate positions as chunk rows, block -1 at garbage row 0), bitwise."""
    cfg, comp, rope = _compressor(ratio, d, dtype)
    s = 5 * ratio + 3
    x = _randn(s, cfg.hidden_size, seed=ratio).to(dtype)
    want = comp.dense(x, rope)  # [nb, d]
    nb = s // ratio
    ends = torch.arange(nb) * ratio + ratio - 1  # [nb]
    pos = ends.unsqueeze(1) + torch.arange(1 - comp.span, 1)  # [nb, span]
    raw = comp.raw(x)
    got = compress.compress_reference(
        raw, raw, (-1 - pos.clamp(min=0)).to(torch.int32), ends, comp.ape, comp.norm.weight,
        comp.norm.eps, rope.rotation(ends + 1 - ratio, d), ratio, comp.coff,
        eps_tensor=comp.norm.eps_tensor)
    assert torch.equal(got, want)


# -- meta, checks, builds --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fake_gives_the_references_shape_and_dtype(dtype):
    meta = {"device": "meta", "dtype": dtype}
    k, ratio, coff, d = 5, 4, 2, 512
    args = (torch.empty(40, 2 * coff * d, **meta), torch.empty(9, 2 * coff * d, **meta),
            torch.empty(k, coff * ratio, device="meta", dtype=torch.int32),
            torch.empty(k, device="meta", dtype=torch.int64), torch.empty(ratio, coff * d, **meta),
            torch.empty(d, **meta), EPS, torch.empty(k, d // 2, 2, 2, device="meta"), ratio, coff)
    fused, ref = compress.compress_pool(*args), compress.compress_reference(*args)
    assert fused.device.type == "meta"
    assert (fused.shape, fused.dtype) == (ref.shape, ref.dtype) == ((k, d), dtype)


def test_wrong_shapes_are_refused():
    args, _ = _case(4, 2, 24, [3, 7], torch.float32, seed=1)
    with pytest.raises(ValueError, match="coff\\*ratio"):
        compress.compress_pool(*args[:-2], 8, 2)
    with pytest.raises(ValueError, match="rot"):
        compress.compress_pool(*args[:7], args[7][:1], *args[8:])


@pytest.mark.parametrize("ratio,coff", [(4, 2), (8, 1)])
def test__tile_addresses_each_candidate_as_the_reference_gathers_it(ratio, coff):
    """``triton_compress._tile`` under the interpreter: for every candidate of a row, the
    value half's offset in its source (ring row v, or chunk row -1 - v), the source, whether
    its position exists, and its ape offset, as ``gather_candidates`` / ``pool`` take them."""
    from jit_probes import tile_probe

    d, span = 6, coff * ratio
    idx = torch.tensor([[5, -1, 2, -3, 0, -2, 7, 1][:span]] * 2, dtype=torch.int32)  # [2, span]
    for row, pos in ((1, span - 3), (0, 40)):
        out = torch.empty(4, span, dtype=torch.int64)
        tile_probe[(1,)](idx, out, row, pos, 0, d, RATIO=ratio, COFF=coff, TILE_S=span)
        i = torch.arange(span)
        v = idx[row].long()
        half = i // ratio
        assert torch.equal(out[0], torch.where(v >= 0, v, -1 - v) * (2 * coff * d) + half * d)
        assert torch.equal(out[1], (v >= 0).long())
        assert torch.equal(out[2], (pos - span + 1 + i >= 0).long())
        assert torch.equal(out[3], (i % ratio) * (coff * d) + half * d)
