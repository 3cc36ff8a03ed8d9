"""OpenAI response shapes: completions and chat completions, whole or as stream chunks
(server-sent events), and the usage-only last chunk."""

from __future__ import annotations

import json
import secrets
import time

from .protocol import GenRequest
from .session import Piece


class Shaper:
    """The bodies of one request's response (one id and creation time for all)."""

    def __init__(self, req: GenRequest, model: str):
        self.req, self.model = req, model
        self.chat = req.chat
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _wrap(self, obj: str, choices: list[dict], usage: dict | None) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _choice(self, text: str, token_ids: list[int], finish: str | None,
                whole: bool) -> dict:
        if self.chat:
            key = "message" if whole else "delta"
            choice = {"index": 0, key: {"role": "assistant", "content": text} if whole
                      else {"content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=None, finish_reason=finish)
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return choice

    def whole(self, text: str, token_ids: list[int], finish: str, usage: dict) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        return self._wrap(obj, [self._choice(text, token_ids, finish, True)], usage)

    def chunk(self, piece: Piece, usage: dict | None) -> str:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        body = self._wrap(obj, [self._choice(piece.text, piece.token_ids,
                                             piece.finish_reason, False)], usage)
        return sse(body)

    def role_chunk(self) -> str:
        """A chat stream's first chunk: the assistant's role, no content yet."""
        return sse(self._wrap("chat.completion.chunk", [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}], None))

    def usage_chunk(self, usage: dict) -> str:
        """``stream_options.include_usage``: a last chunk with no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return sse(self._wrap(obj, [], usage))


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
