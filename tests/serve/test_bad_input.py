"""Bad input over loopback (issue 38's fuzzing of ``nextn-graph serve``): it never answers
500 and never names a server path. Field names that are lone surrogates, integers past
int64, text prompts that cannot be encoded, metadata fields of the wrong type, a wrong
method, a body that never arrives: each is a 4xx in OpenAI's shape naming its field (or
a clamp, top_k's). Then the published /openapi.json, and what it drives
(``schema_fuzz``): every field at its edges, and a Hypothesis fuzz. One server (its
engine on a thread of this process, a short body timeout) serves the module."""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nextn_graph
from nextn_graph.config import load_run_config
from nextn_graph.errors import InputError
from nextn_graph.serve.front.fields import CHAT, COMPLETIONS
from nextn_graph.serve.front.limits import ServeSettings
from nextn_graph.serve.front.protocol import parse_request
from nextn_graph.serve.front.tokens import DETOKENIZE, TOKENIZE
from nextn_graph.serve.thread import ServerThread

from schema_fuzz import edge_cases, from_schema, mutated
from serve_support import chat_checkpoint, metric, scrape

ROWS, MAX_CONTEXT, BODY_TIMEOUT_S = 2, 64, 1.0
MESSAGES = [{"role": "user", "content": "Hi"}]
BASES = {"/v1/completions": {"prompt": [72, 101], "max_tokens": 1},
         "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 1},
         "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [72]}}
TABLES = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT,
          "/tokenize": TOKENIZE, "/detokenize": DETOKENIZE}
INT64_PAST = (2**63, 2**64, 10**30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = chat_checkpoint(tmp_path_factory.mktemp("ckpt"))
    cfg = load_run_config(None, checkpoint=str(root),
                          pool={"max_requests": ROWS, "max_context": MAX_CONTEXT},
                          graph={"logprobs": 2, "penalties": True})
    settings_ = ServeSettings(port=0, engine="thread", body_timeout_s=BODY_TIMEOUT_S)
    with ServerThread(cfg, settings_) as srv:
        srv.root = root
        srv.http = httpx.Client(base_url=srv.url, timeout=60)
        yield srv
        srv.http.close()


def _raw(server, path: str, body: bytes) -> httpx.Response:
    return server.http.post(path, content=body, headers={"Content-Type": "application/json"})


def _send(server, path: str, body: object) -> httpx.Response:
    """``body`` as JSON with every non-ASCII character escaped (a lone surrogate too)."""
    return _raw(server, path, json.dumps(body).encode())


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = json.loads(r.content.decode("utf-8"))["error"]  # (strict UTF-8)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    return error


def _paths(server) -> list[str]:
    """What no response may name: the checkpoint's directory, the package's, temp, home."""
    return [str(server.root), os.path.dirname(nextn_graph.__file__), tempfile.gettempdir(),
            os.path.expanduser("~")]


def _no_path(server, r: httpx.Response) -> None:
    text = r.content.decode("utf-8", "replace")
    assert not [p for p in _paths(server) if p in text], text
    assert not re.search(r"/[\w.-]+/[\w./-]*\.(json|py|safetensors)\b", text), text


def test_a_lone_surrogate_field_name_is_a_400_naming_it(server):
    """A field name ``"\\ud800"`` (lone surrogate) on every POST route and inside
    stream_options: a 400 whose param is the name escaped (the six characters \\ud800),
    counted as a refusal; no internal error."""
    before = scrape(server.url)
    for path, base in BASES.items():
        head = json.dumps(base)[:-1].encode()
        r = _raw(server, path, head + b', "\\ud800": 1}')
        error = _error(r, 400, "\\ud800")
        assert error["code"] == "unknown_field" and "\\ud800" in error["message"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        head = json.dumps({**BASES[path], "stream": True})[:-1].encode()
        r = _raw(server, path, head + b', "stream_options": {"\\udfff": true}}')
        _error(r, 400, "stream_options.\\udfff")
    after = scrape(server.url)
    assert metric(after, "nextn_serve_rejected_total", status="400") - metric(
        before, "nextn_serve_rejected_total", status="400") == 6
    assert metric(after, "nextn_serve_internal_errors_total") == 0


def test_top_k_past_the_vocabulary_is_off(server):
    """top_k >= the vocabulary filters nothing: the request is top_k 0's, however large
    k is (2**63 used to reach an int64 tensor and fail the engine)."""
    info = server.state.worker.info
    base = {**BASES["/v1/completions"], "temperature": 0.7, "seed": 3}
    off = parse_request({**base, "top_k": 0}, info, False)
    assert parse_request({**base, "top_k": info.limits.vocab_size - 1}, info, False) != off
    for k in (info.limits.vocab_size, *INT64_PAST):
        assert parse_request({**base, "top_k": k}, info, False) == off
    before = scrape(server.url)
    r = _send(server, "/v1/completions", {**base, "top_k": 2**63, "return_token_ids": True})
    assert r.status_code == 200, r.text
    again = _send(server, "/v1/completions", {**base, "top_k": -1, "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == again.json()["choices"][0]["token_ids"]
    assert metric(scrape(server.url), "nextn_engine_faults_total") == metric(
        before, "nextn_engine_faults_total")


def _until_closed(s: socket.socket) -> bytes:
    reply = b""
    while chunk := s.recv(4096):  # (until the server closes)
        reply += chunk
    return reply


def test_a_head_that_never_completes_is_a_408(server):
    """A client that trickles its request head, or opens a connection and sends nothing,
    gets a 408 once the timeout passes and the connection closes; a head that completes
    in time is served; the server serves on."""
    host, port = server.url.removeprefix("http://").split(":")
    for sent in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-", b""):
        start = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(sent)
            reply = _until_closed(s)
        assert time.monotonic() - start >= BODY_TIMEOUT_S
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "head_timeout"
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(BODY_TIMEOUT_S / 2)  # slow, but within the deadline
        s.sendall(b"Host: x\r\nConnection: close\r\n\r\n")
        assert _until_closed(s).startswith(b"HTTP/1.1 200")
    assert server.http.get("/health").status_code == 200


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"seed": 2**63}, "seed"),
    ("/v1/completions", {"max_tokens": 2**63}, "max_tokens"),
    ("/v1/completions", {"n": 2**64}, "n"),
    ("/v1/completions", {"logprobs": 2**63}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 2**63}, "prompt_logprobs"),
    ("/v1/completions", {"min_tokens": 2**63}, "min_tokens"),
    ("/v1/completions", {"stop_token_ids": [2**63]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [2**64]}, "prompt"),
    ("/v1/completions", {"logit_bias": {str(2**63): 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 2**63}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"\u00b2": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"--5": 1}}, "logit_bias"),
    ("/v1/completions", {"temperature": 10**400}, "temperature"),
    ("/v1/completions", {"frequency_penalty": -(10**400)}, "frequency_penalty"),
    ("/v1/completions", {"top_k": -(2**63)}, "top_k"),
    ("/v1/chat/completions", {"max_completion_tokens": 2**63, "max_tokens": None},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2**63}, "top_logprobs"),
    ("/detokenize", {"tokens": [2**64]}, "tokens"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_integers_past_int64_are_refused_by_name(server, path, extra, param):
    r = _send(server, path, {**BASES[path], **extra})
    _error(r, 400, param)
    _no_path(server, r)


@pytest.mark.parametrize("path, body, param, says", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt", "character 1 is a lone surrogate"),
    ("/v1/completions", {"prompt": ""}, "prompt", "prompt: the text is empty"),
    ("/v1/completions", {"prompt": ["ok", "\x00\x01"]}, "prompt", "prompt[1]: text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]},
     "messages", "lone surrogate"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt", "lone surrogate"),
    ("/tokenize", {"prompt": ""}, "prompt", "the text is empty"),
])
def test_text_that_does_not_encode_names_the_field_not_a_path(server, path, body, param,
                                                              says):
    r = _send(server, path, body)
    error = _error(r, 400, param)
    assert says in error["message"] and "tokenizer.json" not in error["message"]
    _no_path(server, r)


def test_a_wrong_method_is_a_405_with_allow(server):
    for method, path, allow in (("GET", "/v1/completions", "POST"),
                                ("PUT", "/tokenize", "POST"), ("POST", "/health", "GET")):
        r = server.http.request(method, path)
        error = _error(r, 405, None)
        assert error["type"] == "invalid_request_error"
        assert allow in [m.strip() for m in r.headers["allow"].split(",")]


def test_a_body_that_never_arrives_is_a_408(server):
    """Headers that declare 100 bytes, and 10 sent: a 408 once the body timeout passes,
    and the connection closes; the server serves on."""
    host, port = server.url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        reply = b""
        while chunk := s.recv(4096):  # (until the server closes)
            reply += chunk
    assert time.monotonic() - start >= BODY_TIMEOUT_S
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "body_timeout"
    assert server.http.get("/health").status_code == 200
    with pytest.raises(InputError, match="body_timeout_s"):
        ServeSettings(body_timeout_s=0)


@pytest.mark.parametrize("path, extra, param", [
    ("/tokenize", {"model": 5}, "model"), ("/detokenize", {"model": ["x"]}, "model"),
    ("/v1/completions", {"model": {}}, "model"), ("/v1/completions", {"user": 5}, "user"),
    ("/v1/chat/completions", {"user": True}, "user"),
    ("/v1/chat/completions", {"metadata": "x"}, "metadata"),
    ("/v1/chat/completions", {"store": "yes"}, "store"),
    ("/v1/completions", {"stream_options": {"include_obfuscation": 1}},
     "stream_options.include_obfuscation"),
])
def test_metadata_fields_must_be_of_their_type(server, path, extra, param):
    error = _error(_send(server, path, {**BASES[path], **extra}), 400, param)
    assert error["message"].startswith(f"{param} must be ")
    if param in ("model", "user"):  # (null, or a string, is taken)
        for fine in (None, "someone"):
            assert _send(server, path, {**BASES[path], param: fine}).status_code == 200


def test_openapi_describes_every_route_and_field(server):
    spec = server.http.get("/openapi.json").json()
    assert {"/health", "/metrics", "/v1/models"} <= set(spec["paths"])
    assert "securitySchemes" not in spec.get("components", {})  # no key: none asked
    for path, table in TABLES.items():
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        schema = body["schema"]
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        assert set(schema["properties"]) == set(table), path
    completions = _body_schema(spec, "/v1/completions")
    assert completions["required"] == ["prompt"]
    props = completions["properties"]
    assert props["n"]["anyOf"] == [{"type": "integer", "minimum": 1, "maximum": 16},
                                   {"type": "null"}]
    assert props["best_of"]["enum"] == [None, 1]  # refused: null or its neutral value
    assert props["user"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    chat = _body_schema(spec, "/v1/chat/completions")["properties"]
    assert chat["logprobs"]["anyOf"][0] == {"type": "boolean"}
    assert set(chat["stream_options"]["anyOf"][0]["properties"]) == {
        "include_usage", "continuous_usage_stats", "include_obfuscation"}


def _body_schema(spec: dict, path: str) -> dict:
    return spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


def _sound(server, path: str, body: object) -> int:
    """Send ``body``: the answer is a 2xx, or a 4xx in OpenAI's shape; it names no path."""
    r = _send(server, path, body)
    assert r.status_code < 500, (path, body, r.text)
    _no_path(server, r)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
    return r.status_code


def test_every_field_at_its_schemas_edges(server):
    """Every field of every POST route's published schema, and each field of an object
    field, at each of its edge values (past its bounds, int64's, a lone surrogate, an
    empty string, another JSON type) on a body that is fine otherwise: no answer is a
    5xx or names a path, and no internal error or engine fault is counted."""
    spec = server.http.get("/openapi.json").json()
    before = scrape(server.url)
    statuses = []
    for path in TABLES:
        for name, change in edge_cases(_body_schema(spec, path)):
            statuses.append(_sound(server, path, {**BASES[path], **change}))
    after = scrape(server.url)
    assert 400 in statuses and 200 in statuses
    assert metric(after, "nextn_serve_internal_errors_total") == 0
    assert metric(after, "nextn_engine_faults_total") == metric(
        before, "nextn_engine_faults_total")


@pytest.fixture(scope="module")
def bodies(server):
    """(route, body) pairs drawn from the published schema: valid, and mutated."""
    spec = server.http.get("/openapi.json").json()
    per_route = [st.tuples(st.just(path), from_schema(_body_schema(spec, path))
                           | mutated(_body_schema(spec, path))) for path in TABLES]
    return st.one_of(per_route)


def test_schema_driven_fuzz_never_answers_5xx_or_a_path(server, bodies):
    """Bodies drawn from /openapi.json's schemas, and broken ones, on every POST route:
    every answer is a 2xx or a 4xx in OpenAI's shape, none names a path, and no internal
    error or engine fault is counted."""
    before = scrape(server.url)

    @settings(max_examples=150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(bodies)
    def check(case):
        _sound(server, *case)

    check()
    after = scrape(server.url)
    assert metric(after, "nextn_serve_internal_errors_total") == 0
    assert metric(after, "nextn_engine_faults_total") == metric(
        before, "nextn_engine_faults_total")
