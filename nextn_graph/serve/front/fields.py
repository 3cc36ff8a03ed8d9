"""Which request fields this server takes: every field of OpenAI's request schemas for
``/v1/completions`` and ``/v1/chat/completions``, plus the vLLM extensions it knows, each
with one policy. Nothing is silently ignored:

- ``honoured``: implemented (``protocol.parse_request`` reads and checks it);
- ``metadata``: accepted, with no effect on what is generated (``why`` says why that is
  harmless), when it is null or of its JSON type (``types``: a string, a flag, an
  object; anything else is a 400 naming the field);
- ``refused``: accepted only while it holds its default or a neutral value (null, or one
  of ``neutral``); any other value is a 400 naming the field, "not supported by this
  server (yet)".

A field in no table is a 400 naming it, as OpenAI answers ("Unrecognized request argument
supplied"). ``check_fields`` runs before anything else reads the body.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import show_value
from .errors import APIError

HONOURED, METADATA, REFUSED = "honoured", "metadata", "refused"


@dataclass(frozen=True)
class Field:
    policy: str  # honoured | metadata | refused
    why: str  # what the server does with it, or why it is harmless, or what is missing
    neutral: tuple = ()  # refused: the values accepted besides null (defaults, no-ops)
    types: tuple[type, ...] = ()  # metadata: the Python types of its JSON values (str,
    # bool, dict), besides null

    def __post_init__(self) -> None:
        if (self.policy == METADATA) != bool(self.types):
            raise ValueError(f"a metadata field, and only one, has its types: {self}")


def _h(why: str) -> Field:
    return Field(HONOURED, why)


def _m(why: str, *types: type) -> Field:
    return Field(METADATA, why, types=types)


def _r(why: str, *neutral) -> Field:
    return Field(REFUSED, why, neutral)


# Fields both endpoints share, with the same meaning and policy.
_COMMON = {
    "model": _m("one model is served; the name is checked to be a string, not matched",
                str),
    "frequency_penalty": _h("in [-2, 2]: count x penalty off each output token's logit, at "
                            "every verify row (an engine with graph.penalties)"),
    "presence_penalty": _h("in [-2, 2]: off the logit of each token the output holds"),
    "logit_bias": _h("token id -> bias in [-100, 100], added to the logits (up to 300)"),
    "max_tokens": _h("output length; with the prompt and lookahead within the context; 0 "
                     "only with completions' echo (the prompt alone, scored, as vLLM)"),
    "n": _h("choices per prompt (1..16); with a seed each samples its own stream"),
    "seed": _h("seeds the request's sampling stream"),
    "stop": _h("stop strings, matched on the decoded text"),
    "stream": _h("server-sent events"),
    "stream_options": _h("an object; its keys per STREAM_OPTIONS"),
    "temperature": _h("0 greedy; > 0 samples (an engine built with graph.sampling)"),
    "top_p": _h("nucleus sampling"),
    "user": _m("an end-user id for abuse tracking; nothing here is tracked or billed", str),
}

# vLLM's extensions (its spelling): the ones this server implements or refuses by name.
_EXTENSIONS = {
    "top_k": _h("top-k sampling (0 or vLLM's -1: off)"),
    "stop_token_ids": _h("token ids that end the request, besides EOS"),
    "return_token_ids": _h("each choice carries its token_ids"),
    "ignore_eos": _h("EOS is not a stop token for the request (it runs to max_tokens)"),
    "min_tokens": _h("EOS and the stop ids are held back until this many tokens"),
    "min_p": _h("sampling keeps tokens of at least min_p x the likeliest one's probability"),
    "repetition_penalty": _h("prompt and output tokens' logits divided (if > 0) or "
                             "multiplied by it (1: off)"),
    "include_stop_str_in_output": _r("the text always ends before the stop string", False),
    "skip_special_tokens": _r("special tokens are always left out of the text", True),
    "prompt_logprobs": _h("per prompt token after the first: its logprob and the k most "
                          "likely (vLLM's shape)"),
}

COMPLETIONS = {
    **_COMMON, **_EXTENSIONS,
    "prompt": _h("text (with the checkpoint's tokenizer), token ids, or a list of up to "
                 "64 of either (a batch)"),
    "best_of": _r("no server-side ranking of candidates (vLLM V1 dropped it); use n", 1),
    "echo": _h("the text, and with logprobs the logprobs, start with the prompt's (with "
               "max_tokens 0: are the prompt's alone)"),
    "logprobs": _h("k: each token's logprob with the k most likely (k <= --max-logprobs)"),
    "suffix": _r("no insertion (fill-in-the-middle) mode", ""),
}

CHAT = {
    **_COMMON, **_EXTENSIONS,
    "messages": _h("{role, content} strings, rendered with the chat template"),
    "max_completion_tokens": _h("as max_tokens (max_tokens wins when both are given)"),
    "audio": _r("text only"),
    "function_call": _r("no function calling", "none"),
    "functions": _r("no function calling", []),
    "logprobs": _h("true: each output token's logprob"),
    "top_logprobs": _h("k most likely alternatives per token (with logprobs: true)"),
    "metadata": _m("tags for stored completions; nothing is stored, nothing reads them",
                   dict),
    "modalities": _r("text only", ["text"]),
    "parallel_tool_calls": _m("only shapes tool calls, and tools are refused", bool),
    "prediction": _r("no predicted outputs"),
    "reasoning_effort": _r("not a reasoning model with an effort setting"),
    "response_format": _r("no structured output", {"type": "text"}),
    "service_tier": _m("a billing / latency tier; this server has one tier", str),
    "store": _m("stores the completion for OpenAI's evals; nothing is stored or read back",
                bool),
    "tool_choice": _r("no tool calling", "none"),
    "tools": _r("no tool calling", []),
    "web_search_options": _r("no web search"),
}

STREAM_OPTIONS = {
    "include_usage": _h("a last chunk with no choices carries the usage"),
    "continuous_usage_stats": _h("with include_usage, every chunk carries the usage so far "
                                 "(guidellm sends it)"),
    "include_obfuscation": _m("padding against length side channels; changes no content",
                              bool),
}


def _same(value: object, neutral: object) -> bool:
    # (True == 1 in Python: a bool matches only a bool)
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


# what a metadata field's types are called in its refusal
_TYPE_NAMES = {str: "a string", bool: "true or false", dict: "an object"}


def _of(value: object, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # (True is an int in Python: a bool is of bool alone)
        return bool in types
    return isinstance(value, types)


def check_table(body: dict, table: dict[str, Field], prefix: str) -> None:
    """Each key of ``body`` against ``table`` (``prefix`` names the object it sits in:
    ``stream_options.``)."""
    for key, value in body.items():
        name = prefix + str(key)
        field = table.get(key)
        if field is None:
            raise APIError(400, f"Unrecognized request argument supplied: {name} (this "
                                f"server does not know it)", param=name, code="unknown_field")
        if field.policy == REFUSED and value is not None and not any(
                _same(value, n) for n in field.neutral):
            allowed = " or ".join(["null", *(show_value(n) for n in field.neutral)])
            raise APIError(400, f"{name} {show_value(value)} is not supported by this server "
                                f"(yet): {field.why}; only {allowed} is accepted",
                           param=name, code="unsupported_field")
        if field.policy == METADATA and value is not None and not _of(value, field.types):
            kinds = " or ".join(_TYPE_NAMES[t] for t in field.types)
            raise APIError(400, f"{name} must be {kinds} or null, got {show_value(value)}",
                           param=name, code="invalid_value")


def check_fields(body: dict, chat: bool) -> None:
    """Refuse (400, ``param`` = the field) an unknown field, a refused one holding
    anything but null or a neutral value, or a metadata one of another JSON type."""
    check_table(body, CHAT if chat else COMPLETIONS, "")
    options = body.get("stream_options")
    if isinstance(options, dict):
        check_table(options, STREAM_OPTIONS, "stream_options.")
