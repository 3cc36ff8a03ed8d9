"""OpenAI response shapes: completions and chat completions, whole or as stream chunks
(server-sent events), and the usage-only last chunk.

A whole response lists its choices by index; a stream chunk carries one choice's piece
(its ``index``), so the chunks of several choices interleave as their tokens come. With
``echo`` a choice's text (and, with logprobs, its logprobs) starts with its prompt's;
``prompt_logprobs`` rides with a choice's first tokens: in the choice for completions, at
the top level for chat (where vLLM puts them; a chat request has one prompt).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from ...checkpoint.tokenizer import CheckpointTokenizer
from .logprobs import Offsets, TokenNames, chat_logprobs, completion_logprobs, prompt_logprobs
from .protocol import GenRequest
from .session import Piece


@dataclass
class _Said:
    """What the response has given out of one choice so far."""

    offsets: Offsets  # where its next token's text starts
    chars: int = 0  # characters of its text
    started: bool = False


class Shaper:
    """The bodies of one request's response (one id and creation time for all)."""

    def __init__(self, req: GenRequest, model: str, tokenizer: CheckpointTokenizer | None):
        self.req, self.model, self.tokenizer = req, model, tokenizer
        self.chat = req.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.names = TokenNames(tokenizer)
        echo = req.logprobs.echo and not self.chat
        self._echo = [tokenizer.decode(p) if tokenizer is not None else "" for p in
                      req.prompts] if echo else None  # each prompt's text
        self._said = [_Said(Offsets(tokenizer, len(self._echo[c.prompt]) if echo else 0))
                      for c in req.choices()]

    def _wrap(self, obj: str, choices: list[dict], usage: dict | None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _choice(self, piece: Piece, whole: bool) -> dict:
        said = self._said[piece.index]
        echo = self._echo is not None and not said.started
        said.started = True
        text = self._echo[piece.index // self.req.n] + piece.text if echo else piece.text
        said.chars += len(text)
        if self.chat:
            key = "message" if whole else "delta"
            choice = {"index": piece.index, key: {"role": "assistant", "content": text} if whole
                      else {"content": text}}
        else:
            choice = {"index": piece.index, "text": text}
        choice.update(logprobs=self._logprobs(piece, said, echo),
                      finish_reason=piece.finish_reason)
        ask = self.req.logprobs
        if not self.chat and ask.prompt is not None and piece.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(piece.prompt_logprobs, ask.prompt,
                                                        self.names)
        if self.req.return_token_ids:
            choice["token_ids"] = piece.token_ids
        return choice

    def _logprobs(self, piece: Piece, said: _Said, echo: bool) -> dict | None:
        k = self.req.logprobs.output
        if k is None:
            return None
        if self.chat:
            return {"content": chat_logprobs(piece.logprobs, k, self.names)}
        tokens, entries, offsets = list(piece.token_ids), list(piece.logprobs), said.offsets.of(
            piece.token_ids)
        if echo:  # the prompt's tokens first (its first has no logprob)
            prompt = self.req.prompts[piece.index // self.req.n]
            tokens, entries = [*prompt, *tokens], [*piece.prompt_logprobs, *entries]
            offsets = [*Offsets(self.tokenizer).of(prompt), *offsets]
        if piece.finish_reason is not None:  # tokens past a stop string: at the text's end
            offsets = [min(o, said.chars) for o in offsets]
        return completion_logprobs(tokens, entries, k, offsets, self.names)

    def _top_prompt_logprobs(self, body: dict, piece: Piece) -> dict:
        """Chat: a request's prompt_logprobs at the top level, as vLLM's."""
        if self.chat and self.req.logprobs.prompt is not None and (
                piece.prompt_logprobs is not None):
            body["prompt_logprobs"] = prompt_logprobs(piece.prompt_logprobs,
                                                      self.req.logprobs.prompt, self.names)
        return body

    def whole(self, pieces: list[Piece], usage: dict) -> dict:
        """Every choice's pieces (in any order) -> the response."""
        joined = [Piece.join([p for p in pieces if p.index == i])
                  for i in sorted({p.index for p in pieces})]
        obj = "chat.completion" if self.chat else "text_completion"
        body = self._wrap(obj, [self._choice(p, True) for p in joined], usage)
        return self._top_prompt_logprobs(body, joined[0])

    def chunk(self, piece: Piece, usage: dict | None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._wrap(obj, [self._choice(piece, False)], usage)
        return sse(self._top_prompt_logprobs(body, piece))

    def role_chunks(self) -> list[str]:
        """A chat stream's first chunks: the assistant's role, no content yet, one per
        choice."""
        return [sse(self._wrap("chat.completion.chunk", [
            {"index": c.index, "delta": {"role": "assistant", "content": ""},
             "logprobs": None, "finish_reason": None}], None)) for c in self.req.choices()]

    def usage_chunk(self, usage: dict) -> str:
        """``stream_options.include_usage``: a last chunk with no choices carries the
        usage (of every choice)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._wrap(obj, [], usage))


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
