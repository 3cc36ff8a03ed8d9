"""The cached target forward equals the no-cache oracle ``target.reference``.

Every test compares logits [T, vocab] and ``hidden`` (pre_hc_head, [T, hc*H]) of
cached rows against the full recompute of the request's whole sequence, at the
same positions. The tiny preset has window 16, C4 layers 1 and 3 (index_topk 4)
and a C128 layer 2, so the sequences below cross every boundary that matters.
"""

from __future__ import annotations

import pytest
import torch

from nextn_graph.memory.batch import Chunk, ForwardBatch
from nextn_graph.checkpoint.presets import TINY

ATOL = 1e-4
N = 4  # verify width: the most rows one forward writes per request


def assert_rows_match(out, o: int, ref, a: int, b: int, what: str) -> None:
    """Rows o.. of a cached output equal reference rows a..b-1 (logits and hidden)."""
    torch.testing.assert_close(out.logits[o:o + b - a], ref.logits[a:b], atol=ATOL, rtol=0,
                               msg=lambda m: f"logits of {what}, positions {a}..{b - 1}: {m}")
    torch.testing.assert_close(out.hidden[o:o + b - a], ref.hidden[a:b], atol=ATOL, rtol=0,
                               msg=lambda m: f"hidden of {what}, positions {a}..{b - 1}: {m}")


def run_chunks(tiny, pool, seqs, spans, pad_to=None):
    """One forward over ``spans`` = [(req_row, seq_id, start, end)] -> (output, row offsets)."""
    chunks, offsets, o = [], [], 0
    for row, i, a, b in spans:
        chunks.append(Chunk(row, a, seqs[i][a:b].tolist()))
        offsets.append(o)
        o += b - a
    out = tiny.target(ForwardBatch.from_chunks(chunks, pad_to=pad_to), pool)
    return out, offsets


PROMPTS = (3, 17, 40, 140, 260)
DECODE = 130  # each request decodes across the window edge, C4 blocks and a C128 boundary


def test_mixed_batch_prefill_then_mixed_width_decode(tiny):
    """Five prompts of different lengths prefilled in ONE forward, then decoded with
    1..4 rows per request per forward (widths differ inside a forward, padding rows
    appended): every produced row equals the reference of the full sequence."""
    seqs = [tiny.tokens(n + DECODE, seed=i) for i, n in enumerate(PROMPTS)]  # [n+DECODE] each
    refs = [tiny.target.reference(s) for s in seqs]
    pool = tiny.target_pool(len(PROMPTS), max(PROMPTS) + DECODE, N)
    rows = [pool.alloc() for _ in PROMPTS]

    spans = [(rows[i], i, 0, n) for i, n in enumerate(PROMPTS)]
    out, offs = run_chunks(tiny, pool, seqs, spans, pad_to=sum(PROMPTS) + 5)
    for (_, i, a, b), o in zip(spans, offs):
        assert_rows_match(out, o, refs[i], a, b, f"prefill of request {i}")

    lengths = list(PROMPTS)
    decoded: set[int] = set()  # positions produced by decode forwards, any request
    mixed_forwards = 0
    step = 0
    while any(n < len(s) for n, s in zip(lengths, seqs)):
        spans = []
        for i, n in enumerate(lengths):
            w = min(1 + (step + i) % N, len(seqs[i]) - n)
            if w:
                spans.append((rows[i], i, n, n + w))
                lengths[i] += w
        out, offs = run_chunks(tiny, pool, seqs, spans, pad_to=len(PROMPTS) * N)
        for (_, i, a, b), o in zip(spans, offs):
            assert_rows_match(out, o, refs[i], a, b, f"decode step {step} of request {i}")
            decoded.update(range(a, b))
        mixed_forwards += len({b - a for _, _, a, b in spans}) > 1
        step += 1

    window = tiny.cfg.sliding_window
    # The decode forwards really crossed the edges this test is about.
    assert {window - 1, window, 127, 128, 255, 256} <= decoded
    assert mixed_forwards > 10


C4_LAYERS = [i for i, r in enumerate(TINY["compress_ratios"][: TINY["num_hidden_layers"]]) if r == 4]


@pytest.mark.parametrize("layer", C4_LAYERS)
def test_indexer_selects_a_strict_subset(tiny, layer):
    """On a C4 layer, rows with more finished blocks than index_topk attend to exactly
    index_topk of them, chosen by score (not simply the first k): the top-k path is
    really exercised by the equivalence tests, whose positions go far past 4*topk."""
    cfg = tiny.cfg
    ratio, k = cfg.compress_ratios[layer], cfg.index_topk
    assert ratio == 4 and len(C4_LAYERS) == 2
    assert max(PROMPTS) + DECODE > ratio * (k + 1)  # equivalence tests reach such positions

    block = tiny.target.layers[layer]
    captured = []  # the attention input x [S, D], taken from the real reference run
    handle = block.attn_norm.register_forward_hook(lambda m, i, o: captured.append(o))
    try:
        tiny.target.reference(tiny.tokens(96, seed=7))
    finally:
        handle.remove()
    x = captured[0]  # [S, D]
    attn = block.attn
    qr = attn.q_norm(attn.wq_a(x))  # [S, q_lora]
    idx, picked = attn.indexer.dense(x, qr, attn.rope)  # [S, k] each

    finished = (torch.arange(x.shape[0]) + 1) // ratio  # [S] finished blocks per row
    late = finished > k
    assert late.sum() > 50
    assert picked[late].all()  # k real entries ...
    assert (idx[late] < finished[late].unsqueeze(1)).all()  # ... all finished ...
    assert (idx[late].sort(dim=1).values.diff(dim=1) > 0).all()  # ... and distinct
    assert (idx[late].max(dim=1).values >= k).any()  # not always blocks 0..k-1


@pytest.mark.parametrize("length", [14, 27, 29, 30, 125, 126, 127, 254])
def test_rewritten_window_matches_reference(tiny, length):
    """Positions L..L+3 written, then L..L+1 rewritten with other tokens (a rejected
    speculation), then decoding continues: every row from the rewrite on equals the
    reference of the sequence holding only the rewrite's tokens. L is chosen so the
    stale or rewritten rows cross the window edge (14), a C4 block end (29, 30) and
    the C128 block ends 127 (125, 126) and 255 (254); at 27 and 127 the rewrite's first
    row closes a block, so it reads the oldest raw position the ring slack protects."""
    tail = 24
    prompt = tiny.tokens(length, seed=length)  # [L]
    first = tiny.tokens(N, seed=1000 + length)  # [N], later rejected
    second = (first[:2] + 1 + tiny.tokens(2, seed=2000 + length)) % tiny.cfg.vocab_size
    assert (second != first[:2]).all()
    seq = torch.cat((prompt, second, tiny.tokens(tail, seed=3000 + length)))  # [L+2+tail]
    ref = tiny.target.reference(seq)

    pool = tiny.target_pool(2, len(seq) + N, N)  # < 128 for small L: no C128 entry
    row = pool.alloc()

    def forward(start: int, tokens: torch.Tensor):
        return tiny.target(ForwardBatch.from_chunks([Chunk(row, start, tokens.tolist())]), pool)

    forward(0, prompt)
    forward(length, first)
    assert_rows_match(forward(length, second), 0, ref, length, length + 2, "rewrite")
    pos, widths = length + 2, (3, 1, 4, 2)
    for step in range(tail):
        w = min(widths[step % len(widths)], len(seq) - pos)
        if not w:
            break
        assert_rows_match(forward(pos, seq[pos:pos + w]), 0, ref, pos, pos + w, "continuation")
        pos += w
    assert pos == len(seq)


def test_padding_rows_never_change_real_rows(tiny):
    """The same real rows run with and without many padding rows (row 0, position 0)
    give the same outputs, in prefill and in every later decode forward."""
    lens = (20, 37)
    seqs = [tiny.tokens(n + 12, seed=40 + i) for i, n in enumerate(lens)]
    pools = [tiny.target_pool(2, 64, N) for _ in range(2)]
    rows = [[p.alloc() for _ in lens] for p in pools]

    def both(spans):
        plain, _ = run_chunks(tiny, pools[0], seqs, [(rows[0][i], i, a, b) for i, a, b in spans])
        padded, _ = run_chunks(tiny, pools[1], seqs, [(rows[1][i], i, a, b) for i, a, b in spans],
                               pad_to=plain.logits.shape[0] + 29)
        t = plain.logits.shape[0]
        torch.testing.assert_close(padded.logits[:t], plain.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(padded.hidden[:t], plain.hidden, atol=1e-5, rtol=0)

    both([(i, 0, n) for i, n in enumerate(lens)])
    lengths = list(lens)
    for step in range(6):
        spans = []
        for i in range(len(lens)):
            w = 1 + (step + i) % 3
            spans.append((i, lengths[i], lengths[i] + w))
            lengths[i] += w
        both(spans)


def test_requests_are_isolated(tiny):
    """Request B (prefill past a C128 boundary, then verify-width decodes) sharing the
    pool with A never changes A's later outputs: A decoded alongside B equals A alone."""
    a_seq = tiny.tokens(70, seed=50)  # [70]: prompt 50, then 20 single-row decodes
    b_seq = tiny.tokens(150, seed=51)  # [150]: prompt 130, then 5 forwards of 4 rows
    seqs = [a_seq, b_seq]

    alone = tiny.target_pool(2, 160, N)
    a_alone = alone.alloc()
    shared = tiny.target_pool(2, 160, N)
    b_row, a_row = shared.alloc(), shared.alloc()  # A on another row than when alone
    assert a_row != a_alone

    run_chunks(tiny, alone, seqs, [(a_alone, 0, 0, 50)])
    run_chunks(tiny, shared, seqs, [(a_row, 0, 0, 50)])
    run_chunks(tiny, shared, seqs, [(b_row, 1, 0, 130)])
    for step, p in enumerate(range(50, 70)):
        if step % 4 == 0:
            b = 130 + step
            run_chunks(tiny, shared, seqs, [(b_row, 1, b, b + N)])
        expect, _ = run_chunks(tiny, alone, seqs, [(a_alone, 0, p, p + 1)])
        got, _ = run_chunks(tiny, shared, seqs, [(a_row, 0, p, p + 1)])
        torch.testing.assert_close(got.logits, expect.logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.hidden, expect.hidden, atol=1e-6, rtol=0)
