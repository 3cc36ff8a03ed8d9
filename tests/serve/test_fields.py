"""Request fields over loopback: every field of OpenAI's completions and chat schemas is
honoured or refused by name (the walk), unknown fields are refused, ``ignore_eos``, and
vLLM's /tokenize and /detokenize. One server serves the module: builtin:tiny-trained with
a chat template, and its EOS id moved to a token greedy decoding of PROMPT reaches (the
trained model never emits its real EOS), so a request can stop at EOS."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import httpx
import pytest

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.config import load_run_config
from nextn_graph.runtime.generate import plain_generate, reference_generate
from nextn_graph.sampling import SamplingParams
from nextn_graph.serve.front.errors import APIError
from nextn_graph.serve.front.fields import CHAT, COMPLETIONS, HONOURED, METADATA, REFUSED
from nextn_graph.serve.front.limits import ServeSettings
from nextn_graph.serve.front.protocol import parse_request
from nextn_graph.serve.front.tokens import detokenize, tokenize
from nextn_graph.serve.thread import ServerThread

from serve_support import chat_checkpoint

MAX_CONTEXT = 128
PROMPT = [72, 101, 108, 108, 111, 44, 32, 109, 121]  # "Hello, my"
EOS_AT = 3  # the served EOS is greedy's 4th output token for PROMPT
MESSAGES = [{"role": "user", "content": "Hi"}]
MAX_LOGPROBS = 3
# An honoured field that means something only beside another: both go in the base it is
# compared with, so the change is the field's own.
COMPANIONS = {"top_logprobs": {"logprobs": True}}

# OpenAI's request schemas (API reference), field by field.
OPENAI_COMPLETIONS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
    "suffix", "temperature", "top_p", "user"}
OPENAI_CHAT = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens",
    "metadata", "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty",
    "reasoning_effort", "response_format", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_p", "user",
    "web_search_options"}
VLLM_EXTENSIONS = {
    "top_k", "stop_token_ids", "return_token_ids", "ignore_eos", "min_tokens", "min_p",
    "repetition_penalty", "include_stop_str_in_output", "skip_special_tokens",
    "prompt_logprobs"}

# A value other than the default for every field (what a client asking for it sends).
COMMON = {
    "model": "another-name", "frequency_penalty": 0.5, "presence_penalty": -0.5,
    "logit_bias": {"72": 5}, "max_tokens": 3, "n": 2, "seed": 7, "stop": ["zz"],
    "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5,
    "top_p": 0.9, "user": "someone", "top_k": 20, "stop_token_ids": [5],
    "return_token_ids": True, "ignore_eos": True, "min_tokens": 2, "min_p": 0.1,
    "repetition_penalty": 1.2, "include_stop_str_in_output": True,
    "skip_special_tokens": False, "prompt_logprobs": 1}
ONLY = {
    False: {"prompt": "Hello", "best_of": 2, "echo": True, "logprobs": 1, "suffix": "x"},
    True: {
        "messages": [{"role": "user", "content": "Hey"}], "max_completion_tokens": 3,
        "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto",
        "functions": [{"name": "f"}], "logprobs": True, "top_logprobs": 2,
        "metadata": {"k": "v"}, "modalities": ["text", "audio"],
        "parallel_tool_calls": False, "prediction": {"type": "content", "content": "x"},
        "reasoning_effort": "low", "response_format": {"type": "json_object"},
        "service_tier": "auto", "store": True, "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "web_search_options": {}},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = chat_checkpoint(tmp_path_factory.mktemp("ckpt"))
    target = load_checkpoint(root).target
    greedy = plain_generate(target, [PROMPT], 8, stop_ids=[], max_context=MAX_CONTEXT)
    greedy = greedy.outputs[0]
    assert greedy[EOS_AT] not in greedy[:EOS_AT]
    config = json.loads((root / "config.json").read_text())
    config["eos_token_id"] = greedy[EOS_AT]
    (root / "config.json").write_text(json.dumps(config))
    cfg = load_run_config(None, checkpoint=str(root),
                          pool={"max_requests": 2, "max_context": MAX_CONTEXT},
                          graph={"logprobs": MAX_LOGPROBS, "penalties": True})
    with ServerThread(cfg, ServeSettings(port=0, engine="thread")) as srv:
        srv.greedy, srv.target = greedy, target
        srv.http = httpx.Client(base_url=srv.url, timeout=60)
        yield srv
        srv.http.close()


def _path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


def _base(chat: bool) -> dict:
    first = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    return {**first, "max_tokens": 2, "temperature": 0}


def _refused(server, path: str, body: dict, param: str) -> str:
    r = server.http.post(path, json=body)
    assert r.status_code == 400, (param, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


def test_tables_cover_the_openai_schemas():
    for table, openai_fields in ((COMPLETIONS, OPENAI_COMPLETIONS), (CHAT, OPENAI_CHAT)):
        assert set(table) == openai_fields | VLLM_EXTENSIONS
        for name, field in table.items():
            assert field.policy in (HONOURED, METADATA, REFUSED) and field.why, name
    metadata = {n for n, f in CHAT.items() if f.policy == METADATA}
    assert metadata == {"model", "user", "metadata", "store", "service_tier",
                        "parallel_tool_calls"}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_field_is_honoured_or_refused_by_name(server, chat):
    """Each field alone at a value other than its default: a refused one is a 400 naming
    it over HTTP, and its null and neutral values parse; an honoured one parses into a
    request other than the default's, a metadata one into the same request. Then one request carrying every honoured and metadata field at those
    values, and every refused one at its neutral value, is served: a stream with the
    usage chunk and token ids, ending [DONE]. (One served request, not one per field:
    each costs a prefill and rounds; the parse is what takes or refuses a field.)"""
    table, info = CHAT if chat else COMPLETIONS, server.state.worker.info
    examples = {**COMMON, **ONLY[chat]}
    assert set(examples) == set(table)
    everything = _base(chat)
    for name, field in table.items():
        base = {**_base(chat), **COMPANIONS.get(name, {})}
        body = {**base, name: examples[name]}
        if field.policy == REFUSED:
            message = _refused(server, _path(chat), body, name)
            assert "not supported by this server (yet)" in message
            for neutral in (None, *field.neutral):  # the default is taken
                parse_request({**_base(chat), name: neutral}, info, chat)
            everything[name] = field.neutral[0] if field.neutral else None
        else:
            if name == "max_completion_tokens":  # (max_tokens wins when both are given)
                del body["max_tokens"]
            changed = parse_request(body, info, chat) != parse_request(base, info, chat)
            assert changed == (field.policy == HONOURED), name
            everything[name] = examples[name]
    r = server.http.post(_path(chat), json=everything)
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    content = [c["choices"][0] for c in chunks[:-1]
               if not (chat and "role" in c["choices"][0]["delta"])]  # (not the role chunks)
    assert all("token_ids" in c and c["logprobs"] is not None for c in content)
    assert {c["index"] for c in content} == {0, 1}  # n = 2


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_unknown_fields_are_refused_by_name(server, chat):
    other = "prompt" if chat else "messages"  # the other endpoint's field
    for name in ("bogus_field", other, "repeat_penalty"):
        message = _refused(server, _path(chat), {**_base(chat), name: 1}, name)
        assert message.startswith(f"Unrecognized request argument supplied: {name}")
    body = {**_base(chat), "stream": True, "stream_options": {"include_usage": True, "x": 1}}
    _refused(server, _path(chat), body, "stream_options.x")
    body["stream_options"] = {"continuous_usage_stats": False, "include_obfuscation": True}
    assert server.http.post(_path(chat), json=body).status_code == 200
    _refused(server, _path(chat), {**_base(chat), "ignore_eos": "yes"}, "ignore_eos")


def _stream(server, chat: bool, options: dict) -> list[dict]:
    body = {**_base(chat), "max_tokens": 6, "stream": True, "stream_options": options}
    r = server.http.post(_path(chat), json=body)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server, chat):
    """guidellm streams with include_usage and continuous_usage_stats: every content chunk
    carries the usage so far (as vLLM's), the last one the final usage; without it only
    the finishing chunk and the usage chunk do."""
    chunks = _stream(server, chat, {"include_usage": True, "continuous_usage_stats": True})
    content = chunks[1 if chat else 0:-1]  # (chat's first chunk is the role's)
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts and counts == sorted(counts) and counts[0] >= 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == counts[-1]
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"]
               for c in content)
    plain = _stream(server, chat, {"include_usage": True})[1 if chat else 0:-1]
    assert all(("usage" in c) == (c["choices"][0]["finish_reason"] is not None)
               for c in plain)


def test_ignore_eos_runs_to_max_tokens(server):
    """Greedy PROMPT reaches the served EOS at its 4th token and stops there; with
    ignore_eos it runs on to max_tokens, the same tokens as the oracle's."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    stopped = server.http.post("/v1/completions", json=body).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["token_ids"] == server.greedy[:EOS_AT + 1]
    for stream in (False, True):
        r = server.http.post("/v1/completions", json={**body, "ignore_eos": True,
                                                      "stream": stream})
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            ids, reason = r.json()["choices"][0]["token_ids"], r.json()["choices"][0][
                "finish_reason"]
        assert ids == server.greedy and reason == "length"


def test_penalties_and_min_tokens_are_applied(server):
    """A greedy request with penalties and a logit bias gets the tokens of the oracle that
    applies them token by token; min_tokens holds the served EOS back."""
    eos = server.greedy[EOS_AT]
    pen = {"logit_bias": {"101": 15.0}, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    for extra, n, stops in ((pen, 8, set()), ({"min_tokens": 6}, 8, {eos})):
        body = {"prompt": PROMPT, "max_tokens": n, "temperature": 0, "return_token_ids": True,
                "ignore_eos": not stops, **extra}
        got = server.http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        want = reference_generate(server.target, [PROMPT], n, stop_ids=stops,
                                  max_context=MAX_CONTEXT,
                                  sampling=SamplingParams(seed=0, **extra)).outputs[0]
        assert got == want and got != server.greedy, extra
    assert eos not in got[:6]


def test_penalty_refusals_name_the_field(server):
    for extra, param in [({"presence_penalty": 3}, "presence_penalty"),
                         ({"logit_bias": {"999": 1}}, "logit_bias"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"logit_bias": [1, 2]}, "logit_bias"),
                         ({"min_tokens": 9}, "min_tokens"),
                         ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"min_p": 2}, "min_p")]:
        _refused(server, "/v1/completions", {**_base(False), **extra}, param)
    info = server.state.worker.info
    info = dataclasses.replace(info, limits=dataclasses.replace(info.limits, penalizes=False))
    with pytest.raises(APIError) as exc:
        parse_request({**_base(False), "min_tokens": 1}, info, False)
    assert exc.value.param == "min_tokens" and "no penalties" in exc.value.message


def test_top_k_minus_one_is_off(server):
    """vLLM's clients send top_k -1 for "off": the same request as 0; below is a 400."""
    info, base = server.state.worker.info, {**_base(False), "temperature": 0.7, "seed": 1}
    assert parse_request({**base, "top_k": -1}, info, False) == parse_request(
        {**base, "top_k": 0}, info, False)
    _refused(server, "/v1/completions", {**base, "top_k": -2}, "top_k")


def test_a_client_gone_mid_body_is_no_server_fault(server, caplog):
    """guidellm's sweep leaves clients that close mid-request: a body cut short is a
    499 (nothing to answer), not an unexpected-error 500 with a traceback."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 400\r\n\r\n{\"prompt\": ")
    time.sleep(0.5)
    assert server.http.get("/health").status_code == 200
    assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]


def test_tokenize_and_detokenize(server):
    info = server.state.worker.info
    got = server.http.post("/tokenize", json={"prompt": "Hello, my", "model": "x"}).json()
    assert got == {"tokens": PROMPT, "count": len(PROMPT), "max_model_len": MAX_CONTEXT,
                   "token_strs": None}
    assert info.limits.max_context == MAX_CONTEXT
    chat = server.http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == list(b"user: Hi\nassistant:")  # the chat template's render
    back = server.http.post("/detokenize", json={"tokens": chat["tokens"]}).json()
    assert back == {"prompt": "user: Hi\nassistant:"}
    assert server.http.post("/detokenize", json={"tokens": [0, *PROMPT, 1]}).json() == {
        "prompt": "Hello, my"}  # (special tokens left out; id 1 is not the served EOS)


def test_tokenize_refusals_name_the_field(server):
    for path, body, param in (
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
            ("/tokenize", {"messages": [{"role": "user"}]}, "messages"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
            ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
            ("/detokenize", {"tokens": [5, 999]}, "tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens"),
            ("/detokenize", {"tokens": [1], "skip": 1}, "skip")):
        _refused(server, path, body, param)
    r = server.http.post("/tokenize", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_no_tokenizer_is_a_400_saying_so(server):
    bare = dataclasses.replace(server.state.worker.info, tokenizer=None)
    for call, body, param in ((tokenize, {"prompt": "a"}, "prompt"),
                              (tokenize, {"messages": MESSAGES}, "messages"),
                              (detokenize, {"tokens": [5]}, "tokens")):
        with pytest.raises(APIError) as err:
            call(body, bare)
        assert err.value.status == 400 and err.value.param == param
        assert err.value.code == "no_tokenizer" and "no tokenizer.json" in err.value.message
