"""Logprobs in OpenAI's and vLLM's shapes, from the engine's ``TokenLogprob``s (each the
target's raw fp32 log-softmax at that position, with its k most likely alternatives):

- completions, OpenAI's legacy object: ``{"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}``; each top dict holds the k most likely tokens and the chosen one, by
  token string (as vLLM's: with ``logprobs: 1`` a token that is not the most likely gives
  two entries; ids that decode alike share an entry, the likelier's value kept, so
  lm-evaluation-harness's greedy check ``logprob == max(top.values())`` holds only for
  the most likely token);
- chat: ``[{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}]`` (``logprobs.content``), the k most likely, most likely first;
- vLLM's ``prompt_logprobs``: ``[None, {str(id): {"logprob", "rank", "decoded_token"}},
  ...]``: per prompt token after the first, that token and the k most likely.

Token strings (``TokenNames``): the tokenizer's decode of that one id, special tokens as
their content; ``token_id:N`` without a tokenizer (vLLM's spelling). ``bytes``: the UTF-8
of that string (as vLLM's; a byte-level token holding part of a character reads U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...checkpoint.tokenizer import CheckpointTokenizer
from ...runtime.request import TokenLogprob
from .detokenize import TextStream

FLOOR = -9999.0  # what -inf becomes (JSON has no infinity; OpenAI's and vLLM's value)


def _lp(logprob: float) -> float:
    return max(float(logprob), FLOOR)


class TokenNames:
    """Token id -> its string in logprobs, decoded once per id (per response)."""

    def __init__(self, tokenizer: CheckpointTokenizer | None):
        self._tokenizer = tokenizer
        self._names: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        name = self._names.get(token)
        if name is None:
            if self._tokenizer is None:
                name = f"token_id:{token}"
            else:  # (CheckpointTokenizer.decode leaves special tokens out: not here)
                name = self._tokenizer.tokenizer.decode([token], skip_special_tokens=False)
            self._names[token] = name
        return name


class Offsets:
    """``text_offset``: where each token's text starts in a choice's text, as the text is
    decoded (incrementally, one token at a time). A token holding the later bytes of a
    character, or a special token (no text), starts where that character's text does."""

    def __init__(self, tokenizer: CheckpointTokenizer | None, start: int = 0):
        self._stream = TextStream(tokenizer, ())
        self.at = start  # characters of text before the next token

    def of(self, tokens: Sequence[int]) -> list[int]:
        starts = []
        for token in tokens:
            starts.append(self.at)
            self.at += len(self._stream.push([token], final=False))
        return starts


def completion_logprobs(tokens: Sequence[int], entries: Sequence[TokenLogprob | None],
                        k: int, offsets: Sequence[int], names: TokenNames) -> dict:
    """The legacy object of ``tokens``; an entry None (a prompt's first token) gives
    None logprob and top."""
    top: list[dict | None] = []
    for token, entry in zip(tokens, entries, strict=True):
        if entry is None:
            top.append(None)
            continue
        alternatives: dict[str, float] = {}
        for t, lp in entry.top[:k]:  # most likely first: a name's first value is kept
            alternatives.setdefault(names(t), _lp(lp))
        alternatives.setdefault(names(token), _lp(entry.logprob))
        top.append(alternatives)
    return {"tokens": [names(t) for t in tokens],
            "token_logprobs": [None if e is None else _lp(e.logprob) for e in entries],
            "top_logprobs": top, "text_offset": list(offsets)}


def _chat_token(token: int, logprob: float, names: TokenNames) -> dict:
    name = names(token)
    return {"token": name, "logprob": _lp(logprob), "bytes": list(name.encode("utf-8"))}


def chat_logprobs(entries: Sequence[TokenLogprob], k: int, names: TokenNames) -> list[dict]:
    """``logprobs.content`` of a chat choice (or of one chunk's tokens)."""
    return [{**_chat_token(e.token, e.logprob, names),
             "top_logprobs": [_chat_token(t, lp, names) for t, lp in e.top[:k]]}
            for e in entries]


def prompt_logprobs(entries: Sequence[TokenLogprob | None], k: int,
                    names: TokenNames) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``. ``rank``: 1 for the most likely; the prompt token's
    rank is its place among the alternatives the engine returned, null past them (the
    engine reports no rank beyond its k)."""
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranks = {t: rank for rank, (t, _) in enumerate(entry.top, 1)}
        position = {str(entry.token): {"logprob": _lp(entry.logprob),
                                       "rank": ranks.get(entry.token),
                                       "decoded_token": names(entry.token)}}
        position.update((str(t), {"logprob": _lp(lp), "rank": rank, "decoded_token": names(t)})
                        for rank, (t, lp) in enumerate(entry.top[:k], 1))
        out.append(position)
    return out
