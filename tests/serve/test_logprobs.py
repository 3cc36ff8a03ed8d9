"""Logprobs, echo, prompt_logprobs, n > 1 and list prompts over loopback, against the
no-cache oracle (``reference_logits(...).log_softmax(-1)``: the target's raw fp32
log-softmax), in the request shapes lm-evaluation-harness's ``local-completions`` model
sends; then the shaping, the seeding and the all-or-nothing end of a request's choices
on fakes. One server (speculative, CPU emulator graphs, graph.logprobs = K) serves the
module."""

from __future__ import annotations

import asyncio
import json
import queue
from collections import Counter
from operator import itemgetter
from types import SimpleNamespace

import httpx
import pytest
import torch

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.checkpoint.tokenizer import load_tokenizer
from nextn_graph.config import load_run_config
from nextn_graph.errors import InputError
from nextn_graph.runtime.generate import plain_generate
from nextn_graph.runtime.request import StepOutput, TokenLogprob
from nextn_graph.runtime.request_checks import RequestLimits
from nextn_graph.runtime.tolerance import reference_logits
from nextn_graph.sampling import request_seed
from nextn_graph.serve.engine.loop import EngineLoop
from nextn_graph.serve.front.errors import APIError
from nextn_graph.serve.front.limits import Admission, ServeSettings
from nextn_graph.serve.front.logprobs import TokenNames
from nextn_graph.serve.front.metrics import ServeMetrics
from nextn_graph.serve.front.model_info import ModelInfo
from nextn_graph.serve.front.protocol import parse_request
from nextn_graph.serve.front.responses import Shaper
from nextn_graph.serve.front.session import Piece, Session
from nextn_graph.serve.front.worker import Job
from nextn_graph.serve.messages import Failure, JobEvent
from nextn_graph.serve.thread import ServerThread

from helpers import corpus_prompts
from serve_support import chat_checkpoint, wait_idle

K, ROWS, MAX_CONTEXT = 5, 4, 160  # (K: OpenAI's most for completions' logprobs)
TOL = 1e-4
PROMPT = [72, 101, 108, 108, 111, 44, 32, 109, 121]  # "Hello, my"
MESSAGES = [{"role": "user", "content": "Hi"}]
CHAT_PROMPT = list(b"user: Hi\nassistant:")  # MESSAGES under serve_support's template


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = chat_checkpoint(tmp_path_factory.mktemp("ckpt"))
    cfg = load_run_config(None, checkpoint=str(root),
                          pool={"max_requests": ROWS, "max_context": MAX_CONTEXT},
                          graph={"logprobs": K})
    with ServerThread(cfg, ServeSettings(port=0, engine="thread")) as srv:
        srv.target = load_checkpoint(root).target
        srv.names = TokenNames(load_tokenizer(root, 256))
        srv.http = httpx.Client(base_url=srv.url, timeout=120)
        yield srv
        srv.http.close()


def _oracle(target, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Row i [V]: the log-softmax that ``output[i]`` was drawn from."""
    with torch.inference_mode():
        return reference_logits(target, prompt, output).log_softmax(-1)


def _post(server, path: str, body: dict) -> dict:
    r = server.http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _chunks(server, path: str, body: dict) -> list[dict]:
    r = server.http.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: {")]


def _joined(chunks: list[dict]) -> dict[int, dict]:
    """A completions stream's chunks -> each choice as a whole response has it."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            got = out.setdefault(c["index"], {"text": "", "token_ids": [], "logprobs": None})
            got["text"] += c["text"]
            got["token_ids"] += c.get("token_ids", [])
            if c["logprobs"] is not None:
                lp = got["logprobs"] = got["logprobs"] or {k: [] for k in c["logprobs"]}
                for key, values in c["logprobs"].items():
                    lp[key] += values
            got["finish_reason"] = c["finish_reason"]
    return out


def _want_top(server, row: torch.Tensor, token: int, k: int) -> dict[str, float]:
    """The oracle's top dict: the k most likely and the chosen token, by name."""
    want: dict[str, float] = {}
    values, ids = row.topk(k)
    for t, v in zip(ids.tolist(), values.tolist()):
        want.setdefault(server.names(t), v)
    want.setdefault(server.names(token), float(row[token]))
    return want


def _check_rows(server, tokens, logprobs, tops, rows, k):
    for token, got, top, row in zip(tokens, logprobs, tops, rows, strict=True):
        assert abs(got - float(row[token])) < TOL
        want = _want_top(server, row, token, k)
        assert top.keys() == want.keys()
        assert all(abs(top[name] - want[name]) < TOL for name in want)


def _check_completion(server, prompt: list[int], choice: dict, k: int, echo: bool = False):
    """A completions choice's legacy logprobs object against the oracle."""
    ids, lp = choice["token_ids"], choice["logprobs"]
    rows = list(_oracle(server.target, prompt, ids))
    tokens, text = list(ids), choice["text"]
    if echo:  # the prompt's tokens first; nothing predicts its first
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        rows = [None, *_oracle(server.target, prompt[:1], prompt[1:]), *rows]
        tokens = [*prompt, *ids]
    assert lp["tokens"] == [server.names(t) for t in tokens]
    first = 1 if echo else 0
    _check_rows(server, tokens[first:], lp["token_logprobs"][first:],
                lp["top_logprobs"][first:], rows[first:], k)
    offsets = lp["text_offset"]
    assert len(offsets) == len(tokens) and offsets == sorted(offsets)
    assert offsets[-1] <= len(text)


@pytest.mark.parametrize("temperature", [0, 0.9], ids=["greedy", "sampled"])
def test_completion_logprobs_equal_the_oracle(server, temperature):
    """Whole and streamed, greedy and sampled: every token's logprob and top-k are the
    target's raw log-softmax (before temperature), as the oracle computes it."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": temperature, "seed": 3,
            "logprobs": K, "return_token_ids": True}
    whole = _post(server, "/v1/completions", body)["choices"][0]
    _check_completion(server, PROMPT, whole, K)
    streamed = _joined(_chunks(server, "/v1/completions", body))[0]
    assert streamed["token_ids"] == whole["token_ids"]  # (seeded: the same draw)
    _check_completion(server, PROMPT, streamed, K)
    assert streamed["logprobs"]["text_offset"] == whole["logprobs"]["text_offset"]


def test_plain_serving_reports_the_same_distribution(server):
    """Without the draft (bench-serve's plain mode) the logprobs are the oracle's too."""
    cfg = load_run_config(None, checkpoint=str(server.state.worker.info.tokenizer.path.parent),
                          pool={"max_requests": 1, "max_context": MAX_CONTEXT},
                          graph={"logprobs": K})
    with ServerThread(cfg, ServeSettings(port=0, engine="thread"), plain=True) as plain:
        r = httpx.post(plain.url + "/v1/completions", timeout=120, json={
            "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": K,
            "echo": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    _check_completion(server, PROMPT, r.json()["choices"][0], K, echo=True)


def test_a_stop_string_keeps_the_committed_tokens_logprobs(server):
    """A stop string cuts the text; the logprobs, as token_ids and usage, cover the tokens
    the engine committed (to the end of the round that completed the stop), the ones
    past the text's end at its end."""
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    full = _post(server, "/v1/completions", body)["choices"][0]["text"]
    stop = full[5:7]
    assert len(stop) == 2 and "\ufffd" not in stop, full
    for stream in (False, True):
        stopped = {**body, "stop": [stop]}
        got = _joined(_chunks(server, "/v1/completions", stopped))[0] if stream else \
            _post(server, "/v1/completions", stopped)["choices"][0]
        assert got["text"] == full[:full.index(stop)] and got["finish_reason"] == "stop"
        lp = got["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(got["token_ids"])
        assert max(lp["text_offset"]) <= len(got["text"])
        _check_completion(server, PROMPT, got, 1)


def test_a_client_leaving_aborts_every_choice(server):
    with server.http.stream("POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "n": 3, "stream": True,
            "logprobs": 1}) as r:
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    wait_idle(server, ROWS)  # (the engine runs in its own process: its snapshot says)


def test_text_offsets_follow_the_text(server):
    """text_offset: where each token's text starts in the choice's text (echo: the prompt's
    text counts), so the text before token i is the decode of the tokens before it."""
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "logprobs": 0,
            "echo": True, "return_token_ids": True}
    choice = _post(server, "/v1/completions", body)["choices"][0]
    tok = server.state.worker.info.tokenizer
    tokens = [*PROMPT, *choice["token_ids"]]
    prompt_text = tok.decode(PROMPT)
    assert choice["text"] == prompt_text + tok.decode(choice["token_ids"])
    for i, offset in enumerate(choice["logprobs"]["text_offset"]):
        split = len(PROMPT) if i >= len(PROMPT) else 0  # (the two texts decode apart)
        before = tok.decode(tokens[:split]) + tok.decode(tokens[split:i])
        # (a character still coming, U+FFFD so far, does not count until it is whole)
        assert len(before.rstrip("\ufffd")) <= offset <= len(before), i


def test_echo_and_prompt_logprobs_equal_the_oracle(server):
    """echo + logprobs: the prompt's tokens come first (their logprobs from the prefill);
    prompt_logprobs in vLLM's shape, with its own k."""
    body = {"prompt": "Hello, my", "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "echo": True, "prompt_logprobs": 1, "return_token_ids": True}
    choice = _post(server, "/v1/completions", body)["choices"][0]
    assert choice["text"].startswith("Hello, my")
    _check_completion(server, PROMPT, choice, 2, echo=True)
    plp = choice["prompt_logprobs"]
    rows = _oracle(server.target, PROMPT[:1], PROMPT[1:])
    assert len(plp) == len(PROMPT) and plp[0] is None
    for token, got, row in zip(PROMPT[1:], plp[1:], rows):
        ranked = row.topk(1).indices.tolist()
        assert set(got) == {str(token), *map(str, ranked)}
        assert abs(got[str(token)]["logprob"] - float(row[token])) < TOL
        assert got[str(token)]["decoded_token"] == chr(token)
        assert got[str(ranked[0])]["rank"] == 1
        assert got[str(token)]["rank"] == (1 if ranked[0] == token else None)


def _greedy_first(server, prompt: list[int]) -> int:
    return plain_generate(server.target, [prompt], 1, stop_ids=[],
                          max_context=MAX_CONTEXT).outputs[0][0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("k", [1, K])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, k, stream):
    """vLLM's prompt-only scoring (echo, max_tokens 0): the text is the prompt's, the
    logprobs the prompt's (the oracle's; the first null), and nothing of the one token
    the engine makes for its prefill shows: no token ids, completion_tokens 0, and
    finish_reason length though that token is a stop token here. Streamed: one chunk
    with all of it (as vLLM's), the usage chunk, [DONE]."""
    body = {"prompt": "Hello, my", "max_tokens": 0, "echo": True, "logprobs": k,
            "temperature": 0, "return_token_ids": True,
            "stop_token_ids": [_greedy_first(server, PROMPT)]}
    want_usage = {"prompt_tokens": len(PROMPT), "completion_tokens": 0,
                  "total_tokens": len(PROMPT), "prompt_tokens_details": {"cached_tokens": 0}}
    if stream:
        r = server.http.post("/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert len(events) == 3 and events[-1] == "[DONE]", events
        first, last = json.loads(events[0]), json.loads(events[1])
        assert last["choices"] == [] and last["usage"] == want_usage
        assert first["usage"] == want_usage  # (it ends the last choice)
        choice = _joined([first])[0]
    else:
        out = _post(server, "/v1/completions", body)
        assert out["usage"] == want_usage and len(out["choices"]) == 1
        choice = out["choices"][0]
    assert choice["text"] == "Hello, my" and choice["token_ids"] == []
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == len(PROMPT)
    _check_completion(server, PROMPT, choice, k, echo=True)
    assert choice["logprobs"]["text_offset"] == list(range(len(PROMPT)))


def test_the_hidden_token_is_a_stop_token_there(server):
    """The control of the test above: with max_tokens 1 the same request's one token is
    the stop token (finish_reason stop), so max_tokens 0's length hides it."""
    first = _greedy_first(server, PROMPT)
    choice = _post(server, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 1, "echo": True, "temperature": 0,
        "return_token_ids": True, "stop_token_ids": [first]})["choices"][0]
    assert choice["token_ids"] == [first] and choice["finish_reason"] == "stop"


def test_echo_with_max_tokens_0_for_n_choices_of_a_batch(server):
    """A batch of prompts, n 2 each: every choice is its prompt's echo alone, with the
    prompt's logprobs (prompt_logprobs too, its own k), prompt-major."""
    prompts = [PROMPT, corpus_prompts(3, [7])[0]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 0, "echo": True, "logprobs": 1,
            "prompt_logprobs": 0, "temperature": 0.8, "seed": 2, "return_token_ids": True}
    out = _post(server, "/v1/completions", body)
    tok = server.state.worker.info.tokenizer
    choices = sorted(out["choices"], key=itemgetter("index"))
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice, prompt in zip(choices, [prompts[0]] * 2 + [prompts[1]] * 2):
        assert choice["text"] == tok.decode(prompt) and choice["token_ids"] == []
        assert choice["finish_reason"] == "length"
        _check_completion(server, prompt, choice, 1, echo=True)
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(prompt) and plp[0] is None
        assert [list(p)[0] for p in plp[1:]] == [str(t) for t in prompt[1:]]
    assert out["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 0,
                            "total_tokens": sum(map(len, prompts)),
                            "prompt_tokens_details": {"cached_tokens": 0}}


def test_max_tokens_0_needs_room_for_the_hidden_token(server):
    """The engine makes one token for max_tokens 0, so the prompt's room rule is
    unchanged: a prompt leaving room for one token is served, one leaving none is a
    400 naming the prompt."""
    room = MAX_CONTEXT - server.state.worker.info.limits.lookahead
    fits = corpus_prompts(4, [room - 1])[0]
    body = {"prompt": fits, "max_tokens": 0, "echo": True, "logprobs": 0,
            "temperature": 0, "return_token_ids": True}
    choice = _post(server, "/v1/completions", body)["choices"][0]
    assert choice["token_ids"] == [] and len(choice["logprobs"]["tokens"]) == len(fits)
    r = server.http.post("/v1/completions", json={**body, "prompt": [*fits, fits[0]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_max_tokens_0_refusals(server):
    """max_tokens 0 without echo, or on chat, is a 400 naming the field and saying 0
    needs echo; so is a negative one with echo."""
    for path, body, param in (
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": False,
                                 "logprobs": 1}, "max_tokens"),
            ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
            ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0},
             "max_completion_tokens"),
            ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0, "echo": True},
             "echo"),  # (chat has no echo field)
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1, "echo": True},
             "max_tokens")):
        r = server.http.post(path, json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param, error
        if body.get(param) == 0:
            assert "needs" in error["message"] and "echo: true" in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_equal_the_oracle(server, stream):
    body = {"messages": MESSAGES, "max_tokens": 16, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "return_token_ids": True}
    if stream:
        chunks = [c["choices"][0] for c in _chunks(server, "/v1/chat/completions", body)
                  if c["choices"] and c["choices"][0]["logprobs"] is not None]
        ids = [t for c in chunks for t in c["token_ids"]]
        content = [e for c in chunks for e in c["logprobs"]["content"]]
    else:
        whole = _post(server, "/v1/chat/completions", {**body, "prompt_logprobs": 0})
        choice = whole["choices"][0]
        ids, content = choice["token_ids"], choice["logprobs"]["content"]
        prompt = whole["prompt_logprobs"]  # (chat: at the top level, as vLLM's)
        assert len(prompt) == len(CHAT_PROMPT) and prompt[0] is None
        assert [list(p) for p in prompt[1:]] == [[str(t)] for t in CHAT_PROMPT[1:]]
    rows = _oracle(server.target, CHAT_PROMPT, ids)
    assert len(content) == len(ids) > 0
    for token, entry, row in zip(ids, content, rows):
        assert entry["token"] == server.names(token)
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert abs(entry["logprob"] - float(row[token])) < TOL
        values, top = row.topk(3)
        assert [e["token"] for e in entry["top_logprobs"]] == [server.names(t) for t in
                                                                top.tolist()]
        assert all(abs(e["logprob"] - v) < TOL for e, v in zip(entry["top_logprobs"],
                                                                values.tolist()))


def _lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm_eval/models/openai_completions.py ``LocalCompletionsAPI.parse_logprobs``."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens):
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = True
        for tok, top in zip(tokens_logprobs, top_logprobs):
            if tok != max(top.values()):
                is_greedy = False
                break
        res.append((logprobs, is_greedy))
    return res


def test_lm_eval_loglikelihood_requests(server):
    """lm-evaluation-harness's loglikelihood request (a batch of token-id prompts, echo,
    logprobs 1, max_tokens 1): its sums and greedy flags are the oracle's."""
    contexts = corpus_prompts(7, [6, 11, 17])
    greedy = plain_generate(server.target, contexts[:1], 5, stop_ids=[],
                            max_context=MAX_CONTEXT).outputs[0]
    continuations = [greedy, corpus_prompts(8, [4])[0], [contexts[2][3]] * 3]
    body = {"model": "tiny-chat", "prompt": [c + x for c, x in zip(contexts, continuations)],
            "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    got = _lm_eval_parse_logprobs(_post(server, "/v1/completions", body),
                                  [len(c) for c in contexts])
    flags = []
    for (loglikelihood, is_greedy), ctx, cont in zip(got, contexts, continuations):
        rows = _oracle(server.target, ctx, cont)
        want = sum(float(rows[i, t]) for i, t in enumerate(cont))
        assert abs(loglikelihood - want) < TOL * len(cont)
        assert is_greedy == (rows.argmax(-1).tolist() == cont)
        flags.append(is_greedy)
    assert flags[0] and not all(flags)  # (both outcomes checked)


def test_lm_eval_generate_until_requests(server):
    """lm-evaluation-harness's generate_until request: each choice's text is the greedy
    oracle's, cut at the stop; choice i equals the single-prompt request i."""
    prompts = corpus_prompts(9, [5, 12, 8])
    body = {"model": "tiny-chat", "prompt": prompts, "max_tokens": 32, "temperature": 0,
            "stop": ["\n\n"], "seed": 1234}
    out = _post(server, "/v1/completions", body)
    texts = [c["text"] for c in sorted(out["choices"], key=itemgetter("index"))]
    tok = server.state.worker.info.tokenizer
    want = plain_generate(server.target, prompts, 32, max_context=MAX_CONTEXT).outputs
    assert texts == [tok.decode(w).split("\n\n")[0] for w in want]
    for i, prompt in enumerate(prompts):
        alone = _post(server, "/v1/completions", {**body, "prompt": prompt})
        assert alone["choices"][0]["text"] == texts[i]
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_n_choices_sample_distinct_reproducible_streams(server):
    """n > 1 with a seed: choice j samples with request_seed(seed, j), so the choices
    differ, the request reproduces, and streaming gives the same tokens. Greedy choices
    are alike, and choices are prompt-major over a list of prompts."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 5, "n": 3,
            "return_token_ids": True}
    first = _post(server, "/v1/completions", body)
    ids = [c["token_ids"] for c in sorted(first["choices"], key=itemgetter("index"))]
    assert len({tuple(i) for i in ids}) == 3
    assert ids == [c["token_ids"] for c in sorted(
        _post(server, "/v1/completions", body)["choices"], key=itemgetter("index"))]
    streamed = _joined(_chunks(server, "/v1/completions", body))
    assert [streamed[j]["token_ids"] for j in range(3)] == ids
    one = _post(server, "/v1/completions", {**body, "n": 1, "seed": request_seed(5, 1)})
    assert one["choices"][0]["token_ids"] == ids[1]
    assert first["usage"] == {"prompt_tokens": len(PROMPT),
                              "completion_tokens": sum(map(len, ids)),
                              "total_tokens": len(PROMPT) + sum(map(len, ids)),
                              "prompt_tokens_details": {"cached_tokens": 0}}
    two = [PROMPT, PROMPT[:4]]
    greedy = _post(server, "/v1/completions", {"prompt": two, "max_tokens": 8, "n": 2,
                                               "temperature": 0, "return_token_ids": True})
    got = [c["token_ids"] for c in sorted(greedy["choices"], key=itemgetter("index"))]
    want = plain_generate(server.target, two, 8, max_context=MAX_CONTEXT).outputs
    assert got == [want[0], want[0], want[1], want[1]]


def test_n_choices_stream_with_their_index_and_usage(server):
    chunks = _chunks(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "n": 2, "logprobs": True,
        "stream_options": {"include_usage": True}})
    roles = [c["choices"][0]["index"] for c in chunks[:2]]
    assert roles == [0, 1] and all(c["choices"][0]["delta"]["role"] == "assistant"
                                   for c in chunks[:2])
    ends = [c["choices"][0]["index"] for c in chunks if c["choices"]
            and c["choices"][0]["finish_reason"] is not None]
    assert sorted(ends) == [0, 1]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["prompt_tokens"] == len(CHAT_PROMPT)
    assert usage["completion_tokens"] == sum(
        len(c["choices"][0]["logprobs"]["content"]) for c in chunks[2:-1])


def test_refusals_name_the_field(server):
    for path, body, param in (
            ("/v1/completions", {"prompt": PROMPT, "logprobs": K + 1}, "logprobs"),
            ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
            ("/v1/completions", {"prompt": PROMPT, "echo": "yes"}, "echo"),
            ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2},
             "top_logprobs"),
            ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True,
                                      "top_logprobs": K + 1}, "top_logprobs"),
            ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
            ("/v1/completions", {"prompt": PROMPT, "n": 17}, "n"),
            ("/v1/completions", {"prompt": [PROMPT, [5, 999]]}, "prompt"),
            ("/v1/completions", {"prompt": [PROMPT, []]}, "prompt"),
            ("/v1/completions", {"prompt": ["Hi", 5]}, "prompt"),
            ("/v1/completions", {"prompt": [PROMPT] * 65}, "prompt"),
            ("/v1/completions", {"prompt": [PROMPT, PROMPT * 20]}, "prompt"),
            ("/v1/completions", {"prompt": PROMPT, "best_of": 2}, "best_of")):
        r = server.http.post(path, json={"max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, r.json()
    message = server.http.post("/v1/completions", json={
        "prompt": [PROMPT, [5, 999]]}).json()["error"]["message"]
    assert message.startswith("prompt[1]: token id 999")


# -- on fakes: no server ----------------------------------------------------------------

def _info(tokenizer, max_logprobs: int = K, penalizes: bool = False) -> ModelInfo:
    limits = RequestLimits(256, 1, 128, "the maximum context 128", 0, max_logprobs, True,
                           penalizes)
    return ModelInfo("m", limits, tokenizer, None)


@pytest.fixture(scope="module")
def tok():
    from nextn_graph.checkpoint.loader import resolve_checkpoint
    return load_tokenizer(resolve_checkpoint("builtin:tiny-trained"), 256)


def _entry(token: int) -> TokenLogprob:
    """``token`` at -2, "A" (65) the most likely at -1."""
    return TokenLogprob(token, -2.0, ((65, -1.0), (token, -2.0)))


def test_shaping_echo_offsets_and_a_stop_cut(tok):
    """Offsets count characters, not bytes (a 2-byte character's second token starts
    where the character does); tokens past a stop string sit at the text's end."""
    req = parse_request({"prompt": "hé", "echo": True, "logprobs": 1, "max_tokens": 4},
                        _info(tok), False)
    assert req.prompts == ((104, 0xC3, 0xA9),) and req.logprobs.engine_prompt == 1
    shaper = Shaper(req, "m", tok)
    prompt = (None, _entry(0xC3), _entry(0xA9))
    first = Piece(0, "ab", [97, 98], (_entry(97), _entry(98)), prompt, None)
    last = Piece(0, "", [99, 100], (_entry(99), _entry(100)), None, "stop")  # "cd" cut
    a, b = (json.loads(shaper.chunk(p, None)[6:]) for p in (first, last))
    a, b = a["choices"][0], b["choices"][0]
    assert a["text"] == "héab" and b["text"] == ""
    assert a["logprobs"]["text_offset"] == [0, 1, 1, 2, 3]
    assert b["logprobs"]["text_offset"] == [4, 4]  # (the text ends at 4: the stop cut it)
    assert a["logprobs"]["tokens"][:2] == ["h", "\ufffd"]
    assert a["logprobs"]["token_logprobs"][0] is None
    assert a["logprobs"]["top_logprobs"][3] == {"A": -1.0, "a": -2.0}  # (k 1, + chosen)
    fresh = Shaper(req, "m", tok).whole([first, last], {})["choices"][0]
    assert fresh["text"] == "héab" and fresh["logprobs"]["text_offset"] == [0, 1, 1, 2, 3,
                                                                               4, 4]


def test_max_tokens_0_with_min_tokens_is_a_400(tok):
    info = _info(tok, penalizes=True)
    with pytest.raises(APIError) as err:
        parse_request({"prompt": "ab", "echo": True, "max_tokens": 0, "min_tokens": 1},
                      info, False)
    assert err.value.param == "min_tokens"
    assert err.value.message == "min_tokens 1 exceeds max_tokens 0"
    req = parse_request({"prompt": "ab", "echo": True, "max_tokens": 0}, info, False)
    assert req.echo_only and req.engine_max_tokens == 1


def test_seeds_per_choice_and_the_choice_order(tok):
    req = parse_request({"prompt": ["a", "b"], "n": 2, "seed": 9, "temperature": 1,
                         "max_tokens": 2}, _info(tok), False)
    choices = req.choices()
    assert [(c.index, c.prompt) for c in choices] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [c.sampling.seed for c in choices] == [request_seed(9, j) for j in (0, 1, 0, 1)]
    single = parse_request({"prompt": "a", "seed": 9, "temperature": 1, "max_tokens": 2},
                           _info(tok), False)
    assert single.choices()[0].sampling.seed == 9  # (n 1: the seed as given)
    with pytest.raises(APIError) as err:
        parse_request({"prompt": "a", "logprobs": 0}, _info(tok, 0), False)
    assert err.value.param == "logprobs" and "--max-logprobs" in err.value.message


def test_admission_counts_choices():
    admission = Admission(rows=2, max_waiting=2, retry_after_s=1)
    admission.enter(6)  # more than the capacity: let in alone
    with pytest.raises(APIError) as err:
        admission.enter(1)
    assert err.value.status == 429
    admission.leave(6)
    admission.enter(3)
    with pytest.raises(APIError):
        admission.enter(2)
    admission.enter(1)
    assert admission.in_flight == 4


class _FakeWorker:
    def __init__(self):
        self.jobs: list[Job] = []
        self.aborted: list[int] = []

    def submit(self, jobs):
        self.jobs = jobs

    def abort(self, job):
        self.aborted.append(job.choice.index)


def test_a_failed_choice_fails_the_request_and_aborts_the_others(tok):
    """One choice's engine fault: the request raises a 500, and close() aborts every
    choice still running (none is left on the engine)."""
    req = parse_request({"prompt": "ab", "n": 3, "max_tokens": 4, "temperature": 0},
                        _info(tok), False)

    async def run():
        worker, closed = _FakeWorker(), []
        sess = Session(req, worker, ServeMetrics(), tok, lambda: closed.append(True))
        sess.submit()
        worker.jobs[2].deliver(StepOutput(7, [65, 1], True, []))  # finished (EOS)
        worker.jobs[1].deliver(StepOutput(6, [66], False, []))
        worker.jobs[0].deliver(Failure(500, "engine step failed: boom"))
        got = []
        with pytest.raises(APIError) as err:
            async for piece in sess.pieces():
                got.append((piece.index, piece.finish_reason))
        sess.close()
        return got, err.value, worker.aborted, closed, sess.usage

    got, err, aborted, closed, usage = asyncio.run(run())
    assert got == [(2, "stop"), (1, None)]
    assert err.status == 500 and err.code == "engine_fault"
    assert aborted == [1] and closed == [True]  # (0 failed on the engine, 2 finished)
    assert usage["completion_tokens"] == 3


class _FakeEngine:
    chunks = SimpleNamespace(phase_runs=Counter())  # (what the loop's snapshots diff)

    def __init__(self, refuse: int):
        self.refuse, self.added, self.aborted = refuse, [], []

    def add_request(self, prompt, max_tokens, stop_ids, sampling, logprobs, prompt_logprobs):
        if len(self.added) == self.refuse:
            raise InputError("refused", field="max_new_tokens")
        self.added.append(len(self.added))
        return len(self.added) - 1

    def abort(self, rid):
        self.aborted.append(rid)


def test_a_request_s_choices_are_admitted_all_or_none(tok):
    """The engine loop adds a request's choices all, or none: the third refused, the two
    added are aborted, and one failure (the refused choice's) is the request's event."""
    req = parse_request({"prompt": "ab", "n": 3, "max_tokens": 4}, _info(tok), False)
    jobs = [Job(req, c, asyncio.Queue(), key=10 + c.index) for c in req.choices()]
    engine = _FakeEngine(refuse=2)
    loop = EngineLoop(engine, queue.SimpleQueue(), lambda report: None)
    loop._add([job.ticket() for job in jobs])
    assert engine.aborted == [0, 1] and not loop._rids and not loop._keys
    assert loop._events == [JobEvent(12, Failure(400, "refused", "max_tokens"))]  # API's name
