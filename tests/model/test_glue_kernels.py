"""The model's glue rewritten for fewer kernels equals what it replaced.

Each rewrite is checked against the straightforward formula it replaced (kept here as
the reference): RoPE as a two-kernel pair rotation equals the slice / stack / cat
rotation bitwise; the top-k with a tie-broken key selects exactly what a stable sort
selects (ties, -0.0, masked entries); slots and masks planned once per forward equal
the per-layer arithmetic; Sinkhorn, the mHC mixes and the RMS norm stay within fp32
rounding of the old formulas. Kernel counts themselves are not pinned (brittle); the
issue's figures are measured with ``OpCounter`` and reported.
"""

from __future__ import annotations

import pytest
import torch

from nextn_graph.memory.batch import Chunk, ForwardBatch, ForwardPlan
from nextn_graph.memory.rings import Ring
from nextn_graph.model.compressor import stable_topk, stable_topk_terms
from nextn_graph.kernels.mhc import hc_head, hc_post, hc_pre, sinkhorn
from nextn_graph.kernels.norm import apply_rope, rms_norm
from nextn_graph.model.ops import RMSNorm, RopeTable
from nextn_graph.checkpoint.presets import preset_config


# -- references: the formulas the rewrite replaced -------------------------------------

def ref_apply_rope(x, cos, sin, inverse=False):
    rd = 2 * cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rot = x[..., :-rd], x[..., -rd:]
    x0, x1 = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated), dim=-1)


def ref_sinkhorn(logits, iters, eps):
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def ref_rms_norm(x, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def ref_mixes(x, fn, norm_eps):
    return torch.nn.functional.linear(ref_rms_norm(x.flatten(1).float(), norm_eps), fn.float())


def ref_hc_pre(x, fn, scale, base, iters, hc_eps, norm_eps):
    hc = x.shape[1]
    mixes = ref_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    return (pre.unsqueeze(-1) * x).sum(dim=1), post, ref_sinkhorn(logits, iters, hc_eps)


def ref_gather_recent(ring, chunk, batch, span, row_ids=None):
    t = chunk.shape[0]
    if row_ids is None:
        row_ids = torch.arange(t)
    offsets = torch.arange(span) - (span - 1)
    key_pos = batch.positions.unsqueeze(1) + offsets
    slot = batch.req_index.unsqueeze(1) * ring.size + key_pos.clamp(min=0) % ring.size
    rows = row_ids.unsqueeze(1) + offsets
    from_ring = (key_pos < batch.cache_start.unsqueeze(1)).unsqueeze(-1)
    return torch.where(from_ring, ring.data[slot], chunk[rows.clamp(0, t - 1)]), key_pos


def ref_write_slot(batch, size):
    keep = batch.positions >= batch.seq_end - size
    slot = batch.req_index * size + batch.positions % size
    return torch.where(keep, slot, torch.zeros_like(slot))


def ref_select(scores, finished, k):
    masked = scores.masked_fill(~finished, float("-inf"))
    return masked.sort(dim=-1, descending=True, stable=True).indices[:, :k]


# -- RoPE ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compressed", [False, True])
def test_apply_rope_equals_the_slice_and_stack_rotation(dtype, compressed):
    """Forward and inverse, heads and a single vector, with and without no-RoPE dims:
    the pair rotation equals the old slice / stack / cat bitwise."""
    cfg = preset_config("tiny")
    table = RopeTable(cfg, compressed=compressed).to(dtype)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, cfg.max_position_embeddings, (37,), generator=gen)
    cos, sin = table.cos[positions], table.sin[positions]
    rd = cfg.qk_rope_head_dim
    for shape in [(37, 4, 32), (37, 32), (37, 3, rd)]:
        x = torch.randn(shape, generator=gen).to(dtype)
        rot = table.rotation(positions, shape[-1])  # [T, d/2, 2, 2]
        for inverse in (False, True):
            got = apply_rope(x, rot, inverse=inverse)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got, ref_apply_rope(x, cos, sin, inverse)), (shape, inverse)
        if dtype == torch.float32:  # inverse undoes the rotation
            torch.testing.assert_close(apply_rope(apply_rope(x, rot), rot, inverse=True), x)


def test_rope_tables_are_one_per_kind_and_owned_by_the_target(tiny):
    """Every layer of a kind reads the same table object; the draft reads the target's
    base-theta table; the tables are buffers of the target alone and not checkpoint keys."""
    target, draft = tiny.target, tiny.draft
    tables = {id(layer.attn.rope) for layer in target.layers}
    assert len(tables) == 2
    for layer in target.layers:
        assert layer.attn.rope is target.rope_tables.for_ratio(layer.attn.ratio)
    assert draft.layer.attn.rope is target.rope_tables.swa
    own = {id(b) for b in draft.buffers()}
    assert id(target.rope_tables.swa.cos) not in own
    assert not [k for k in {**target.state_dict(), **draft.state_dict()} if "cos" in k]


# -- indexer and compressor selection --------------------------------------------------

def _tied_scores(gen, t, e):
    """Scores full of exact ties: 0.0 and -0.0 (relu), repeated values of both signs,
    subnormals and values near the float32 range."""
    pool = torch.tensor([0.0, -0.0, 0.5, -0.5, 1.0, 1.0 + 2 ** -23, 1.0 - 2 ** -24, -1.0,
                         -(1.0 + 2 ** -23), 1e-45, -1e-45, 2e-45, 3e38, -3e38, 1e-38])
    return pool[torch.randint(0, len(pool), (t, e), generator=gen)]


@pytest.mark.parametrize("e, k", [(7, 4), (64, 4), (64, 64), (300, 37), (1, 1)])
def test_stable_topk_selects_what_a_stable_sort_selects(e, k):
    """The exact indices and order of a stable descending sort's first k, with masked
    (unfinished) entries ranked last in entry order, whatever the ties."""
    gen = torch.Generator().manual_seed(e * 131 + k)
    for trial in range(20):
        t = 9
        scores = _tied_scores(gen, t, e) if trial % 2 else torch.randn(t, e, generator=gen)
        finished = torch.arange(e) < torch.randint(0, e + 1, (t, 1), generator=gen)
        finished[0] = False  # a row with nothing finished
        finished[1] = True
        got = stable_topk(scores, k, *stable_topk_terms(finished))
        assert torch.equal(got, ref_select(scores, finished, k)), trial


def test_stable_topk_at_a_long_context():
    """2**18 entries (V4-Flash's C4 entries at 1M positions), ties everywhere."""
    gen = torch.Generator().manual_seed(5)
    e = 2 ** 18
    scores = torch.randint(-2, 3, (2, e), generator=gen).float() * 0.25
    finished = torch.arange(e) < torch.tensor([[e], [e // 3]])
    got = stable_topk(scores, 512, *stable_topk_terms(finished))
    assert torch.equal(got, ref_select(scores, finished, 512))


def test_block_closers_are_the_stable_sort_of_closing_rows():
    """The plan's closer rows: closers first in row order, then the others, exactly as
    the stable sort of ~closes did."""
    gen = torch.Generator().manual_seed(3)
    for ratio in (4, 128):
        for _ in range(10):
            chunks = [Chunk(r + 1, int(torch.randint(0, 400, (), generator=gen)),
                            [5] * int(torch.randint(1, 9, (), generator=gen))) for r in range(5)]
            batch = ForwardBatch.from_chunks(chunks, pad_to=40)
            closes = (batch.positions + 1) % ratio == 0
            k = batch.max_block_closers(ratio)
            want = torch.sort((~closes).to(torch.uint8), stable=True).indices[:k]
            rows = ForwardPlan(batch).block_closers(ratio)
            assert torch.equal(rows.row_ids, want)
            assert torch.equal(rows.batch.positions, batch.positions[want])


# -- slots planned once per forward ------------------------------------------------------

def _batch(gen, pad_to):
    chunks = [Chunk(r, int(torch.randint(0, 60, (), generator=gen)),
                    [3] * int(torch.randint(1, 30, (), generator=gen))) for r in (1, 2, 3)]
    return ForwardBatch.from_chunks(chunks, pad_to=pad_to)


@pytest.mark.parametrize("size, span", [(19, 16), (11, 8), (131, 128)])
def test_planned_ring_slots_equal_the_per_row_arithmetic(size, span):
    """Gathered keys and written slots from the plan equal the old per-call formulas,
    for all rows and for a block-closer subset, bitwise."""
    gen = torch.Generator().manual_seed(size)
    for _ in range(5):
        batch = _batch(gen, pad_to=100)
        ring = Ring(torch.randn(4 * size, 6, generator=gen), size)
        chunk = torch.randn(batch.num_rows, 6, generator=gen)
        plan = ForwardPlan(batch)
        values, idx = ring.gather_recent(chunk, plan, span)
        want, key_pos = ref_gather_recent(ring, chunk, batch, span)
        assert torch.equal(values, want) and torch.equal(idx.valid, key_pos >= 0)
        assert ring.index(plan, span) is idx  # planned once, reused by every layer
        rows = plan.block_closers(4)
        values, idx = ring.gather_recent(chunk, rows, span)
        want, key_pos = ref_gather_recent(ring, chunk, rows.batch, span, rows.row_ids)
        assert torch.equal(values, want) and torch.equal(idx.valid, key_pos >= 0)

        new, old = Ring(ring.data.clone(), size), Ring(ring.data.clone(), size)
        new.write(chunk, plan)
        old.data.index_copy_(0, ref_write_slot(batch, size), chunk)
        assert torch.equal(new.data, old.data)


# -- mHC and norms: the same functions within fp32 rounding ------------------------------

def test_sinkhorn_matches_the_reference_iteration():
    gen = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 3.0, 8.0):
        logits = scale * torch.randn(512, 4, 4, generator=gen)
        got, want = sinkhorn(logits, 20, 1e-6), ref_sinkhorn(logits, 20, 1e-6)
        assert ((got - want).abs() / want.abs()).max() < 1e-5, scale


def test_mhc_matches_the_reference_formulas(tiny):
    """hc_pre, hc_post and hc_head of real layer weights against the old formulas."""
    cfg, block = tiny.cfg, tiny.target.layers[1]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(33, cfg.hc_mult, cfg.hidden_size, generator=gen)  # [T, hc, D]
    args = (block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base)
    got = hc_pre(x, *args, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    want = ref_hc_pre(x, *args, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    y, post, comb = got
    mixed = torch.einsum("tij,tid->tjd", comb, x)
    torch.testing.assert_close(hc_post(y, x, post, comb),
                               post.unsqueeze(-1) * y.unsqueeze(1) + mixed, rtol=1e-6, atol=1e-6)
    head = tiny.target
    pre = torch.sigmoid(ref_mixes(x, head.hc_head_fn, cfg.rms_norm_eps) * head.hc_head_scale
                        + head.hc_head_base) + cfg.hc_eps
    torch.testing.assert_close(
        hc_head(x, head.hc_head_fn, head.hc_head_scale, head.hc_head_base, cfg.hc_eps,
                cfg.rms_norm_eps), (pre.unsqueeze(-1) * x).sum(dim=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(7, 48), (5, 3, 32), (2, 16384)])
def test_rms_norm_matches_the_reference(shape):
    gen = torch.Generator().manual_seed(2)
    x = 3 * torch.randn(shape, generator=gen)
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1], generator=gen)
    torch.testing.assert_close(norm(x), ref_rms_norm(x, 1e-6) * norm.weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rms_norm(x, norm.eps_tensor), ref_rms_norm(x, 1e-6),
                               rtol=1e-5, atol=1e-6)
