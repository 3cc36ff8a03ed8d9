"""OpenAI request parsing: a JSON body -> one checked ``GenRequest``, or an ``APIError``
(400) naming the field, checked against what the served model can hold.

``fields.check_fields`` runs first: an unknown field is refused by name, and so is one
not implemented unless it holds its default (every field's policy: ``fields.py``). Read
here: ``prompt`` or ``messages``, ``max_tokens`` (chat: or ``max_completion_tokens``),
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, and vLLM's ``stop_token_ids``, ``ignore_eos``,
``return_token_ids``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint.tokenizer import CheckpointTokenizer
from ..errors import InputError, show_value
from ..sampling import SamplingParams
from .chat import ChatTemplate
from .errors import APIError
from .fields import check_fields

MAX_STOP_STRINGS = 4  # OpenAI's bound
MAX_STOP_CHARS = 256  # one stop string; the stream holds back this much text at most
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass(frozen=True)
class ModelInfo:
    """What the server knows of the served model once the engine is built."""

    name: str  # the model id clients pass and /v1/models lists
    vocab_size: int
    eos_token_id: int
    max_context: int  # positions per request: min(pool.max_context, max_position_embeddings)
    lookahead: int  # positions a request's verify windows write past its output
    samples: bool  # the engine takes temperature > 0 (graph.sampling)
    tokenizer: CheckpointTokenizer | None
    chat: ChatTemplate | None


@dataclass(frozen=True)
class GenRequest:
    """One checked request, ready for the engine."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]  # stop strings, matched on the decoded output
    stop_ids: frozenset[int]  # stop token ids (EOS unless ignore_eos, and stop_token_ids)
    stream: bool
    include_usage: bool
    continuous_usage: bool  # every chunk carries the usage so far (with include_usage)
    return_token_ids: bool
    chat: bool


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _int(body: dict, key: str, default, low: int, high: int | None = None):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise _bad(f"{key} must be an integer {bound}, got {show_value(value)}", key)
    return value


def _flag(body: dict, key: str, where: str = "") -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool) and value is not None:
        raise _bad(f"{where}{key} must be true or false, got {show_value(value)}", where + key)
    return value is True


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(f"{key} must be a number, got {show_value(value)}", key)
    return float(value)


def checked_ids(value: list, info: ModelInfo, param: str) -> list[int]:
    bad = [t for t in value if isinstance(t, bool) or not isinstance(t, int)
           or not 0 <= t < info.vocab_size]
    if bad:
        raise _bad(f"{param}: token id {show_value(bad[0])} is not an integer in "
                   f"[0, {info.vocab_size})", param)
    return list(value)


def encode_text(text: str, info: ModelInfo, param: str) -> list[int]:
    if info.tokenizer is None:
        raise _bad(f"{param}: a text prompt needs the checkpoint's tokenizer.json, and this "
                   f"checkpoint has none; send token ids instead", param)
    try:
        return info.tokenizer.encode(text, param)
    except InputError as exc:
        raise _bad(str(exc), param) from None


def _prompt(body: dict, info: ModelInfo) -> list[int]:
    value = body.get("prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return encode_text(value, info, "prompt")
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return checked_ids(value, info, "prompt")
    if isinstance(value, list) and len(value) > 1:
        raise _bad("prompt: this server takes one prompt per request", "prompt")
    raise _bad(f"prompt must be a non-empty string or list of token ids, got "
               f"{show_value(value)}", "prompt")


def chat_prompt(body: dict, info: ModelInfo) -> list[int]:
    if info.chat is None:
        raise APIError(400, "this model has no chat template (the checkpoint's "
                            "tokenizer_config.json has no 'chat_template'); use "
                            "/v1/completions", param="messages", code="no_chat_template")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise _bad("messages must be a non-empty list of {role, content} objects with "
                   "string values", "messages")
    return encode_text(info.chat.render(messages), info, "messages")


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise _bad(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty "
                   f"strings of at most {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _sampling(body: dict, info: ModelInfo) -> SamplingParams:
    # OpenAI's default temperature is 1; an engine built greedy-only decodes greedily
    default_t = 1.0 if info.samples else 0.0
    params = SamplingParams(_number(body, "temperature", default_t),
                            _number(body, "top_p", 1.0), _int(body, "top_k", 0, 0),
                            _int(body, "seed", None, 0, 2**63))
    try:
        params = params.checked("sampling")
    except InputError as exc:
        param = next((k for k in ("temperature", "top_p", "top_k", "seed")
                      if f": {k} " in str(exc)), None)
        raise _bad(str(exc).removeprefix("sampling: "), param) from None
    if not params.greedy and not info.samples:
        raise _bad("temperature > 0 samples, but this server's engine is greedy-only "
                   "(graph.sampling: false)", "temperature")
    return params


def parse_request(body: object, info: ModelInfo, chat: bool) -> GenRequest:
    """A JSON body of /v1/completions (``chat`` False) or /v1/chat/completions."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    check_fields(body, chat)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model must be a string", "model")
    prompt = chat_prompt(body, info) if chat else _prompt(body, info)
    room = info.max_context - info.lookahead - len(prompt)
    if room < 1:
        raise _bad(f"the prompt has {len(prompt)} tokens; with {info.lookahead} positions of "
                   f"verify lookahead the context of {info.max_context} leaves no room for "
                   f"output", "messages" if chat else "prompt")
    key = "max_completion_tokens" if chat and body.get("max_tokens") is None else "max_tokens"
    default = room if chat else DEFAULT_MAX_TOKENS
    max_tokens = _int(body, key, min(default, room), 1)
    if max_tokens > room:
        raise _bad(f"{key} {max_tokens} + the prompt's {len(prompt)} tokens + {info.lookahead} "
                   f"positions of verify lookahead exceed the context of {info.max_context} "
                   f"(at most {room} here)", key)
    extra = body.get("stop_token_ids") or []
    if not isinstance(extra, list):
        raise _bad("stop_token_ids must be a list of token ids", "stop_token_ids")
    eos = [] if _flag(body, "ignore_eos") else [info.eos_token_id]
    stop_ids = frozenset([*eos, *checked_ids(extra, info, "stop_token_ids")])
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    usage = _flag(options, "include_usage", "stream_options.")
    return GenRequest(prompt, max_tokens, _sampling(body, info), _stop(body), stop_ids,
                      _flag(body, "stream"), usage, usage and _flag(
                          options, "continuous_usage_stats", "stream_options."),
                      _flag(body, "return_token_ids"), chat)
