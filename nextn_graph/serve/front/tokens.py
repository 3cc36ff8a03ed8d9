"""vLLM's ``/tokenize`` and ``/detokenize``, with the checkpoint's tokenizer (and chat
template), so a client counts tokens exactly as the server will:

- ``POST /tokenize {"prompt": str}`` or ``{"messages": [...]}`` (rendered with the chat
  template, as ``/v1/chat/completions`` does) -> ``{"tokens", "count", "max_model_len",
  "token_strs": null}``;
- ``POST /detokenize {"tokens": [ids]}`` -> ``{"prompt": text}`` (special tokens left out).

Unknown fields and bad values are a 400 naming the field; a checkpoint without a
``tokenizer.json`` answers 400 saying so. Both need the API key, as ``/v1/*`` does.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from ...errors import show_value
from .errors import APIError
from .fields import HONOURED, METADATA, REFUSED, Field, check_table
from .limits import check_api_key, read_json
from .prompts import chat_prompt, checked_ids, encode_text
from .model_info import ModelInfo
from .schema import DETOKENIZE_TYPES, TOKENIZE_TYPES, object_schema, openapi_body

_MODEL = Field(METADATA, "one model is served; the name is checked to be a string, not "
               "matched", types=(str,))
TOKENIZE = {
    "model": _MODEL,
    "prompt": Field(HONOURED, "a string, encoded as /v1/completions encodes it"),
    "messages": Field(HONOURED, "rendered with the chat template, as chat completions do"),
    "add_generation_prompt": Field(REFUSED, "the template always renders it", (True,)),
    "return_token_strs": Field(REFUSED, "token strings are not returned", (False,)),
}
DETOKENIZE = {"model": _MODEL, "tokens": Field(HONOURED, "token ids of the vocabulary")}
# (either prompt or messages)
TOKENIZE_SCHEMA = {**object_schema(TOKENIZE, TOKENIZE_TYPES),
                   "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
DETOKENIZE_SCHEMA = object_schema(DETOKENIZE, DETOKENIZE_TYPES, ("tokens",))


def _object(body: object, table: dict) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_value")
    check_table(body, table, "")
    return body


def _no_tokenizer(info: ModelInfo, param: str) -> None:
    if info.tokenizer is None:
        raise APIError(400, "this checkpoint has no tokenizer.json, so the server cannot "
                            "tokenize or detokenize text", param=param, code="no_tokenizer")


def tokenize(body: object, info: ModelInfo) -> dict:
    body = _object(body, TOKENIZE)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise APIError(400, "give either prompt (a string) or messages, not both or neither",
                       param="prompt", code="invalid_value")
    _no_tokenizer(info, "prompt" if has_prompt else "messages")
    if has_messages:
        ids = chat_prompt(body, info)
    elif isinstance(body["prompt"], str):
        ids = encode_text(body["prompt"], info, "prompt")
    else:
        raise APIError(400, f"prompt must be a string, got {show_value(body['prompt'])}",
                       param="prompt", code="invalid_value")
    return {"tokens": ids, "count": len(ids), "max_model_len": info.limits.max_context,
            "token_strs": None}


def detokenize(body: object, info: ModelInfo) -> dict:
    tokens = _object(body, DETOKENIZE).get("tokens")
    if not isinstance(tokens, list):
        raise APIError(400, f"tokens must be a list of token ids, got {show_value(tokens)}",
                       param="tokens", code="invalid_value")
    _no_tokenizer(info, "tokens")
    return {"prompt": info.tokenizer.decode(checked_ids(tokens, info, "tokens"))}


def add_token_routes(app: FastAPI, state) -> None:
    """The two routes on ``app``; ``state``: its ``ServerState`` (settings, ``info()``)."""

    async def body_of(request: Request) -> object:
        check_api_key(request.headers.get("authorization"), state.settings.api_key)
        state.info()  # (503 while starting or draining)
        return await read_json(request, state.settings)

    @app.post("/tokenize", openapi_extra=openapi_body(TOKENIZE_SCHEMA))
    async def tokenize_route(request: Request):
        return tokenize(await body_of(request), state.info())

    @app.post("/detokenize", openapi_extra=openapi_body(DETOKENIZE_SCHEMA))
    async def detokenize_route(request: Request):
        return detokenize(await body_of(request), state.info())
