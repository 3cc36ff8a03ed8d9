"""Incremental detokenization (``serve.detokenize.TextStream``) with the tiny-trained
byte-level tokenizer: the text streamed over any split of the output into pushes is the
decode of the whole output (cut before the first stop string), multi-byte characters
split across tokens included, and the ids decoded per push stay bounded however long
the output grows."""

from __future__ import annotations

import random

import pytest

from nextn_graph.checkpoint.loader import resolve_checkpoint
from nextn_graph.checkpoint.tokenizer import load_tokenizer
from nextn_graph.serve.front.detokenize import TextStream

# 2- to 4-byte characters, ASCII, and the special ids 0 (<bos>) and 1 (<eos>)
TEXT = "héllo wörld, naïve €5 — 日本語 𝄞 ok. "
STOPS = ["wö", "€5", "本語", "𝄞 o", ". h", "zz", "l"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_checkpoint("builtin:tiny-trained"), 256)


def _stream(tok, ids: list[int], stops: tuple[str, ...], rng: random.Random):
    """Push ``ids`` in random chunks of 1..5; -> (the text given out, stopped, stream)."""
    stream, given, i = TextStream(tok, stops), [], 0
    while i < len(ids) and not stream.stopped:
        chunk = ids[i:i + rng.randint(1, 5)]
        i += len(chunk)
        given.append(stream.push(chunk, final=i >= len(ids)))
    assert "".join(given) == stream.text
    return stream.text, stream.stopped, stream


def _ids(rng: random.Random, n: int) -> list[int]:
    """Mostly the bytes of TEXT (valid UTF-8, cut anywhere), some random bytes (invalid
    sequences, stray continuation bytes) and special tokens."""
    text = list(TEXT.encode())
    return [rng.choice(text) if rng.random() < 0.85 else rng.randrange(256)
            for _ in range(n)]


def test_streamed_text_is_the_whole_decode(tok):
    rng = random.Random(0)
    for _ in range(400):
        ids = _ids(rng, rng.randint(1, 80))
        text, stopped, _ = _stream(tok, ids, (), rng)
        assert text == tok.decode(ids) and not stopped


def test_stop_strings_across_pushes(tok):
    """The text ends right before the first stop string in the whole decode, wherever the
    pushes split it (a stop of several characters, each of several bytes, spans several
    pushes). No stop here is U+FFFD, so a match never rests on a character still coming."""
    rng = random.Random(1)
    hits = 0
    for _ in range(400):
        ids = _ids(rng, rng.randint(1, 80))
        stops = tuple(rng.sample(STOPS, rng.randint(1, 3)))
        full = tok.decode(ids)
        at = [i for i in (full.find(s) for s in stops) if i >= 0]
        text, stopped, _ = _stream(tok, ids, stops, rng)
        assert stopped == bool(at)
        assert text == (full[:min(at)] if at else full)
        hits += stopped
    assert hits >= 50  # (measured 100 of 400 stop here: the cut is well exercised)


def test_decode_work_per_push_is_bounded(tok):
    """One token per push, 6,000 tokens: the ids decoded per push stay within the window
    (the last few characters), where decoding everything again would reach 6,000.
    Valid UTF-8: a window holds at most two characters (<= 4 bytes each) -> at most 16
    ids decoded per push (two decodes of <= 8; measured 9). Random bytes: the window also
    holds any run of text ending in U+FFFD; measured max 21 at this seed (bound 64)."""
    rng = random.Random(2)
    valid = list((TEXT * 200).encode())[:6000]
    for ids, bound in ((valid, 16), (_ids(rng, 6000), 64)):
        stream, most = TextStream(tok, ()), 0
        for i, t in enumerate(ids):
            before = stream.decoded
            stream.push([t], final=i == len(ids) - 1)
            most = max(most, stream.decoded - before)
        assert stream.text == tok.decode(ids)
        assert most <= bound, most


def test_special_tokens_do_not_widen_the_window(tok):
    """A long run of EOS (id 1, as under ignore_eos) adds no text and does not grow the
    window: each push decodes the same two-id window ("ab") twice, 4 ids."""
    stream = TextStream(tok, ())
    assert stream.push(list(b"ab"), final=False) == "ab"
    before = stream.decoded
    for _ in range(500):
        assert stream.push([1], final=False) == ""
    assert stream.decoded - before == 4 * 500
    assert stream.push(list("é".encode()), final=True) == "é"
    assert stream.text == "abé"
