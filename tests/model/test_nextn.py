"""The NextN draft: cached path equals its no-cache oracle, SWA-only pool, checkpoint
keys, shared embedding and LM head, ratio-0 attention with the base RoPE."""

from __future__ import annotations

import pytest
import torch

from nextn_graph.memory.batch import Chunk, ForwardBatch

ATOL = 1e-4
N = 4


def test_draft_pool_is_swa_only(tiny):
    """The draft pool has one layer holding a sliding-window ring and nothing else."""
    pool = tiny.draft_pool(3, 64, N)
    assert len(pool.layers) == 1
    layer = pool.layers[0]
    assert layer.compressed is None and layer.index is None
    assert layer.swa.size >= tiny.cfg.sliding_window + N - 1
    assert pool.nbytes() == layer.swa.data.nbytes


def test_draft_cached_matches_reference(tiny):
    """Three requests prefilled in one draft forward, then decoded with 1..4 rows each
    per forward (padding rows appended), past the window edge and the ring wrap: every
    row equals ``draft.reference`` of the whole sequence with its row-aligned hidden."""
    lens, decode = (5, 18, 33), 40
    seqs = [tiny.tokens(n + decode, seed=60 + i) for i, n in enumerate(lens)]  # [n+decode]
    hiddens = [tiny.target.reference(s).hidden for s in seqs]  # [n+decode, hc*H] each
    refs = [tiny.draft.reference(s, h) for s, h in zip(seqs, hiddens)]
    pool = tiny.draft_pool(len(lens), max(lens) + decode, N)
    rows = [pool.alloc() for _ in lens]

    def forward(spans, pad_to):
        """spans: [(i, start, end)]; checks every real row against the reference."""
        chunks = [Chunk(rows[i], a, seqs[i][a:b].tolist()) for i, a, b in spans]
        batch = ForwardBatch.from_chunks(chunks, pad_to=pad_to)
        hidden = torch.zeros(batch.num_rows, tiny.cfg.hc_dim)  # [T, hc*H]; padding rows 0
        o = 0
        for i, a, b in spans:
            hidden[o:o + b - a] = hiddens[i][a:b]
            o += b - a
        out = tiny.draft(batch, hidden, pool)
        o = 0
        for i, a, b in spans:
            for name in ("logits", "hidden"):
                torch.testing.assert_close(
                    getattr(out, name)[o:o + b - a], getattr(refs[i], name)[a:b],
                    atol=ATOL, rtol=0, msg=lambda m: f"{name} of request {i} at {a}..{b - 1}: {m}")
            o += b - a

    forward([(i, 0, n) for i, n in enumerate(lens)], pad_to=sum(lens) + 3)
    lengths, step = list(lens), 0
    while any(n < len(s) for n, s in zip(lengths, seqs)):
        spans = []
        for i, n in enumerate(lengths):
            w = min(1 + (step + i) % N, len(seqs[i]) - n)
            if w:
                spans.append((i, n, n + w))
                lengths[i] += w
        forward(spans, pad_to=len(lens) * N)
        step += 1
    assert min(lens) < tiny.cfg.sliding_window and max(lengths) > 2 * pool.layers[0].swa.size


def test_draft_output_depends_on_hidden(tiny):
    """The hidden input is really used: a different pre_hc_head changes the logits."""
    ids = tiny.tokens(10, seed=70)
    hidden = tiny.target.reference(ids).hidden  # [T, hc*H]
    a = tiny.draft.reference(ids, hidden).logits
    b = tiny.draft.reference(ids, hidden.roll(1, dims=0)).logits
    assert (a - b).abs().max() > 1e-2


def test_wrong_hidden_shape_raises(tiny):
    """A [T, hidden_size] hidden (one stream instead of all) is a ValueError naming hc_mult,
    on the cached path and the reference path."""
    ids = tiny.tokens(3, seed=71)
    bad = torch.zeros(3, tiny.cfg.hidden_size)  # [T, H], missing the streams
    with pytest.raises(ValueError, match="hc_mult"):
        tiny.draft.reference(ids, bad)
    pool = tiny.draft_pool(1, 16, N)
    batch = ForwardBatch.from_chunks([Chunk(pool.alloc(), 0, ids.tolist())])
    with pytest.raises(ValueError, match="hc_mult"):
        tiny.draft(batch, bad, pool)


def test_draft_checkpoint_keys(tiny):
    """Every draft key is ``mtp.0.*``; the fusion and head params are present; there is no
    embedding or LM head of its own."""
    keys = set(tiny.draft.state_dict())
    assert keys and all(k.startswith("mtp.0.") for k in keys)
    for name in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight",
                 "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
                 "hc_attn_fn", "hc_ffn_fn", "attn.wq_a.weight", "ffn.gate.bias"):
        assert f"mtp.0.{name}" in keys
    assert not any(k.endswith(("embed.weight", ".head.weight")) for k in keys)
    assert not any(".compressor." in k or ".indexer." in k for k in keys)


def test_draft_shares_target_embedding_and_head(tiny):
    """Embedding and LM head are the target's modules, not copies, and not draft params."""
    embed, head = tiny.draft._shared
    assert embed is tiny.target.embed and head is tiny.target.head
    own = {id(p) for p in tiny.draft.parameters()}
    assert id(tiny.target.embed.weight) not in own and id(tiny.target.head.weight) not in own


def test_draft_attention_is_swa_with_base_rope(tiny):
    """The NextN layer has ratio 0 and the base-theta RoPE of a ratio-0 target layer, not
    the compressed layers' theta (which differs)."""
    cfg = tiny.cfg
    attn = tiny.draft.layer.attn
    assert attn.ratio == 0 and cfg.compress_ratios[-1] == 0
    assert not hasattr(attn, "compressor") and not hasattr(attn, "indexer")
    swa = cfg.compress_ratios.index(0)
    compressed = next(i for i, r in enumerate(cfg.compress_ratios[: cfg.num_hidden_layers]) if r)
    base_rope = tiny.target.layers[swa].attn.rope
    assert torch.equal(attn.rope.cos, base_rope.cos) and torch.equal(attn.rope.sin, base_rope.sin)
    other = tiny.target.layers[compressed].attn.rope
    assert (attn.rope.cos - other.cos).abs().max() > 1e-2
