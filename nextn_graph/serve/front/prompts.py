"""The prompts of a request, as token ids checked against the served model, or an
``APIError`` (400) naming the field:

- completions' ``prompt``: text (encoded with the checkpoint's tokenizer), a list of token
  ids, or a list of up to ``MAX_PROMPTS`` of either (a batch: lm-evaluation-harness sends
  its requests so, as lists of token-id lists);
- chat's ``messages``: rendered with the checkpoint's chat template, then encoded.
"""

from __future__ import annotations

from ...errors import InputError, show_value
from .errors import APIError
from .errors import bad_value as bad
from .model_info import ModelInfo

MAX_PROMPTS = 64  # prompts in one completions request (a batch)


def checked_ids(value: list, info: ModelInfo, param: str, where: str | None = None) -> list[int]:
    """``value``'s token ids, each in the vocabulary; ``where`` names it in the message
    (``prompt[2]``), ``param`` is the field."""
    bad_ids = [t for t in value if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < info.limits.vocab_size]
    if bad_ids:
        raise bad(f"{where or param}: token id {show_value(bad_ids[0])} is not an integer in "
                  f"[0, {info.limits.vocab_size})", param)
    return list(value)


def encode_text(text: str, info: ModelInfo, param: str, where: str | None = None) -> list[int]:
    where = where or param
    if info.tokenizer is None:
        raise bad(f"{where}: a text prompt needs the checkpoint's tokenizer.json, and this "
                  f"checkpoint has none; send token ids instead", param)
    try:
        return info.tokenizer.encode(text, where)
    except InputError as exc:
        raise bad(str(exc), param) from None


def _one(value: object, info: ModelInfo, where: str) -> list[int]:
    if isinstance(value, str):
        return encode_text(value, info, "prompt", where)
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return checked_ids(value, info, "prompt", where)
    raise bad(f"{where} must be a non-empty string or list of token ids, got "
              f"{show_value(value)}", "prompt")


def completion_prompts(body: dict, info: ModelInfo) -> list[list[int]]:
    """``prompt`` -> one token-id list per prompt (a batch when it is a list of prompts)."""
    value = body.get("prompt")
    batch = isinstance(value, list) and bool(value) and all(
        isinstance(p, (str, list)) for p in value)
    if not batch:
        return [_one(value, info, "prompt")]
    if len(value) > MAX_PROMPTS:
        raise bad(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(value)}",
                  "prompt")
    return [_one(p, info, f"prompt[{i}]") for i, p in enumerate(value)]


def chat_prompt(body: dict, info: ModelInfo) -> list[int]:
    if info.chat is None:
        raise APIError(400, "this model has no chat template (the checkpoint's "
                            "tokenizer_config.json has no 'chat_template'); use "
                            "/v1/completions", param="messages", code="no_chat_template")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise bad("messages must be a non-empty list of {role, content} objects with "
                  "string values", "messages")
    return encode_text(info.chat.render(messages), info, "messages")
