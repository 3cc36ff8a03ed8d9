"""The JSON schemas of the request bodies, published in ``/openapi.json`` (FastAPI's own)
so a schema-driven client or fuzzer can drive the server.

Each body's schema is built from its route's field table (``fields.py``, ``tokens.py``):
every field the route takes is in it, and no other (``additionalProperties`` false, as
an unknown field is a 400). A field's schema by its policy:

- honoured: its JSON type and static bounds (``*_TYPES`` below; the bounds known only
  once the engine is built, the vocabulary, the context and ``--max-logprobs``, are
  checked by the server and not given here);
- metadata: its ``types``;
- refused: the values it takes, null and its neutral ones.

Every field but a body's required ones takes null (absent). The schemas only document:
each route still reads its body field by field (``protocol``, ``tokens``), with its own
400s; nothing here parses a request.
"""

from __future__ import annotations

from ...penalties import MAX_LOGIT_BIAS
from ...sampling import SEED_LIMIT
from .fields import HONOURED, METADATA, STREAM_OPTIONS, Field
from .prompts import MAX_PROMPTS
from .protocol import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS

NULL = {"type": "null"}
BOOL = {"type": "boolean"}
STRING = {"type": "string"}
_JSON_TYPES = {str: STRING, bool: BOOL, dict: {"type": "object"}}  # (a metadata field's)


def _int(low: int, high: int | None = None) -> dict:
    """An integer in [low, high] (high None: no bound here)."""
    return {"type": "integer", "minimum": low, **({} if high is None else {"maximum": high})}


def _number(low: float | None = None, high: float | None = None,
            above: float | None = None) -> dict:
    """A number in [low, high], or (above, high]."""
    bounds = {"minimum": low, "maximum": high, "exclusiveMinimum": above}
    return {"type": "number", **{k: v for k, v in bounds.items() if v is not None}}


TOKEN_IDS = {"type": "array", "items": _int(0)}  # (each in the vocabulary)
_TEXT = {"type": "string", "minLength": 1}
_ONE_PROMPT = {"anyOf": [_TEXT, {**TOKEN_IDS, "minItems": 1}]}
PROMPT = {"anyOf": [*_ONE_PROMPT["anyOf"], {"type": "array", "minItems": 1,
                                            "maxItems": MAX_PROMPTS, "items": _ONE_PROMPT}]}
MESSAGES = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": STRING, "content": STRING}}}
_STOP = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}

_SHARED = {
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "logit_bias": {"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                   "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": _number(-100, 100)},
    "max_tokens": _int(1),
    "n": _int(1, MAX_N),
    "seed": _int(0, SEED_LIMIT - 1),
    "stop": {"anyOf": [_STOP, {"type": "array", "maxItems": MAX_STOP_STRINGS,
                               "items": _STOP}]},
    "stream": BOOL,
    "temperature": _number(0),
    "top_p": _number(high=1, above=0),
    "top_k": _int(-1),  # (-1 and 0: off; k past the vocabulary keeps it whole)
    "stop_token_ids": TOKEN_IDS,
    "return_token_ids": BOOL,
    "ignore_eos": BOOL,
    "min_tokens": _int(0),
    "min_p": _number(0, 1),
    "repetition_penalty": _number(high=100, above=0),
    "prompt_logprobs": _int(0),
}
STREAM_OPTIONS_TYPES = {"include_usage": BOOL, "continuous_usage_stats": BOOL}


def object_schema(table: dict[str, Field], types: dict[str, dict],
                  required: tuple[str, ...] = ()) -> dict:
    """The schema of a JSON object whose keys are ``table``'s: ``types`` holds the
    honoured fields' schemas; ``required`` fields take no null."""
    properties = {name: _field(field, types.get(name), name in required)
                  for name, field in table.items()}
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


def _field(field: Field, honoured: dict | None, required: bool) -> dict:
    if field.policy == HONOURED:
        if honoured is None:
            raise ValueError(f"an honoured field has no schema: {field}")
        options = [honoured]
    elif field.policy == METADATA:
        options = [_JSON_TYPES[t] for t in field.types]
    else:
        return {"enum": [None, *field.neutral], "description": f"only null or its neutral "
                f"values: other values are not supported by this server (yet): {field.why}"}
    return {"anyOf": options if required else [*options, NULL], "description": field.why}


COMPLETION_TYPES = {**_SHARED, "prompt": PROMPT,
                    "max_tokens": _int(0),  # (0 only with echo: the prompt alone, scored)
                    "echo": BOOL, "logprobs": _int(0),
                    "stream_options": object_schema(STREAM_OPTIONS, STREAM_OPTIONS_TYPES)}
CHAT_TYPES = {**_SHARED, "messages": MESSAGES, "max_completion_tokens": _int(1),
              "logprobs": BOOL, "top_logprobs": _int(0),
              "stream_options": COMPLETION_TYPES["stream_options"]}
TOKENIZE_TYPES = {"prompt": _TEXT, "messages": MESSAGES}
DETOKENIZE_TYPES = {"tokens": TOKEN_IDS}

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": STRING, "type": STRING, "param": {"anyOf": [STRING, NULL]},
                   "code": {"anyOf": [STRING, NULL]}}}}}


def openapi_body(schema: dict) -> dict:
    """A route's ``openapi_extra``: its JSON request body, and its refusals' shape."""
    error = {"content": {"application/json": {"schema": ERROR}}}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}},
            "responses": {"4XX": {"description": "refused (OpenAI's error shape; param "
                                                 "names the field at fault)", **error},
                          "5XX": {"description": "the engine is starting, gone or failed",
                                  **error}}}


UNGUARDED = ("/health", "/metrics")  # the routes that take no API key


def with_bearer(spec: dict) -> dict:
    """``spec`` (an OpenAPI document) saying that every route but ``UNGUARDED`` takes the
    server's key as ``Authorization: Bearer <key>`` (a 401 without it)."""
    spec.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {
        "type": "http", "scheme": "bearer",
        "description": "the server's API key (--api-key, or the environment's)"}
    for path, methods in spec["paths"].items():
        if path not in UNGUARDED:
            for operation in methods.values():
                operation["security"] = [{"bearer": []}]
    return spec

