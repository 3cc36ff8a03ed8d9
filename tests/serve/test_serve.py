"""The OpenAI-compatible server, driven with the official ``openai`` client over
loopback: streamed and whole completions against the plain-decoding oracle, seeded
sampling, stop strings, chat, logprobs and n, disconnects, every refusal path, and
/metrics against what the client saw. Every test runs on both hosts of the engine: its
own process (the default) and a thread of the server's; one server per host (captured
once) serves the module."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.config import load_run_config
from nextn_graph.runtime.generate import plain_generate
from nextn_graph.serve.front.limits import ServeSettings
from nextn_graph.serve.thread import ServerThread
from nextn_graph.checkpoint.tokenizer import load_tokenizer

from serve_support import chat_checkpoint, metric, scrape, wait_idle

KEY = "test-key-1234"
ROWS = 4
MAX_CONTEXT = 256
BODY_LIMIT = 4096


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module", params=[pytest.param("process", marks=pytest.mark.process), "thread"])
def server(request, root):
    cfg = load_run_config(None, checkpoint=str(root),
                          pool={"max_requests": ROWS, "max_context": MAX_CONTEXT},
                          graph={"logprobs": 2})
    settings = ServeSettings(port=0, api_key=KEY, max_body_bytes=BODY_LIMIT, max_waiting=0,
                             engine=request.param)
    with ServerThread(cfg, settings) as srv:
        srv.root = root
        yield srv


@pytest.fixture(scope="module")
def oracle(root):
    """Plain greedy decoding of the served checkpoint (no server, no graphs)."""
    models = load_checkpoint(root)
    return lambda prompts, n: plain_generate(models.target, prompts, n,
                                             max_context=MAX_CONTEXT).outputs


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _idle(server) -> None:
    """Wait until every pool row is free and the engine has no work."""
    wait_idle(server, ROWS)


PROMPT = [72, 101, 108, 108, 111, 44, 32, 109, 121]  # "Hello, my"


def test_health_and_models(server, client):
    assert server.health() == 200
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]


def test_streamed_greedy_equals_oracle(server, client, oracle):
    want = oracle([PROMPT], 40)[0]
    chunks = list(client.completions.create(
        model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    tokens = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert tokens == want
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] in ("length", "stop") and not any(finals[:-1])
    assert chunks[-1].usage.completion_tokens == len(want)
    assert chunks[-1].usage.prompt_tokens == len(PROMPT)
    tok = load_tokenizer(server.root, 256)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(want)
    whole = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40,
                                      temperature=0, extra_body={"return_token_ids": True})
    assert whole.choices[0].token_ids == want and whole.usage.total_tokens == 9 + len(want)


def test_text_prompt_matches_token_prompt(client):
    a = client.completions.create(model="tiny-chat", prompt="Hello, my", max_tokens=12,
                                  temperature=0)
    b = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=12,
                                  temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.usage == b.usage


def test_seeded_sampling_is_reproducible(client):
    def run(seed):
        return client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=24,
                                         temperature=0.9, top_p=0.95, seed=seed,
                                         extra_body={"top_k": 50, "return_token_ids": True})
    first, again = run(11), run(11)
    assert first.choices[0].token_ids == again.choices[0].token_ids
    assert len(first.choices[0].token_ids) == first.usage.completion_tokens


def test_stop_string_cuts_text(client):
    full = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=30,
                                     temperature=0).choices[0].text
    stop = full[5:7]
    assert len(stop) == 2 and "\ufffd" not in stop, full
    for stream in (False, True):
        got = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=30,
                                        temperature=0, stop=[stop], stream=stream)
        if stream:
            parts = [c for c in got if c.choices]
            text = "".join(c.choices[0].text for c in parts)
            reason = parts[-1].choices[0].finish_reason
        else:
            text, reason = got.choices[0].text, got.choices[0].finish_reason
        assert text == full[:full.index(stop)] and reason == "stop"


def test_chat_with_template(client, oracle):
    msgs = [{"role": "user", "content": "Hi"}]
    prompt = list(b"user: Hi\nassistant:")
    want = load_tokenizer_text(oracle(prompt and [prompt], 16)[0])
    whole = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=16,
                                           temperature=0)
    assert whole.choices[0].message.content == want
    assert whole.usage.prompt_tokens == len(prompt)
    streamed = list(client.chat.completions.create(model="tiny-chat", messages=msgs,
                                                   max_tokens=16, temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want


def load_tokenizer_text(ids):
    from nextn_graph.checkpoint.tokenizer import byte_level_tokenizer
    return byte_level_tokenizer().decode(ids, skip_special_tokens=True)


def test_client_disconnect_frees_row(server, client):
    before = scrape(server.url)
    with client.completions.with_streaming_response.create(
            model="tiny-chat", prompt=PROMPT, max_tokens=200, temperature=0,
            stream=True) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # the client closed the connection after one chunk: the request is aborted
    _idle(server)
    after = scrape(server.url)
    cancelled = metric(after, "nextn_serve_requests_total", reason="cancelled") - metric(
        before, "nextn_serve_requests_total", reason="cancelled")
    assert cancelled == 1
    assert metric(after, "nextn_serve_running_requests") == 0
    assert metric(after, "nextn_serve_free_rows") == ROWS  # (the engine's pool, wherever)
    assert server.state.admission.in_flight == 0


def test_logprobs_and_two_choices(client, oracle):
    """n = 2 greedy choices, whole and streamed: both the oracle's tokens, each token
    with its logprob and its top dict (2 alternatives and the chosen token, keyed by
    token string, so ids that decode alike share an entry), the chosen one the most
    likely (greedy)."""
    want = oracle([PROMPT], 12)[0]
    args = dict(model="tiny-chat", prompt=PROMPT, max_tokens=12, temperature=0, n=2,
                logprobs=2, extra_body={"return_token_ids": True})
    whole = client.completions.create(**args)
    streamed: dict[int, list] = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            streamed[c.index].append(c)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    for choice in whole.choices:
        assert choice.token_ids == want
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(want) and all(v <= 0 for v in lp.token_logprobs)
        for value, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert 1 <= len(top) <= 3 and value == pytest.approx(max(top.values()))
    for index, parts in streamed.items():
        assert [t for c in parts for t in c.token_ids] == want
        values = [v for c in parts if c.logprobs for v in c.logprobs.token_logprobs]
        assert values == pytest.approx(whole.choices[index].logprobs.token_logprobs, abs=1e-5)
    assert whole.usage.completion_tokens == 2 * len(want)


def test_openapi_says_which_routes_take_the_key(server):
    """A server with an API key publishes it as a bearer scheme on every route that checks
    it, and on none of those that do not (a request without it is the 401 it says)."""
    spec = httpx.get(server.url + "/openapi.json").json()
    assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            guarded = operation.get("security") == [{"bearer": []}]
            assert guarded == (path not in ("/health", "/metrics")), (path, method)
            if method == "get":
                status = httpx.get(server.url + path).status_code
                assert (status == 401) == guarded, (path, status)


def test_refusals_are_openai_errors(server, client):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=10_000)
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=[5, 999], max_tokens=4)
    assert err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=PROMPT * 40, max_tokens=4)
    assert err.value.body["param"] == "prompt"  # longer than the context
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-chat", prompt=PROMPT, temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="tiny-chat", prompt="x" * BODY_LIMIT)
    assert err.value.status_code == 413 and err.value.body["type"] == "invalid_request_error"
    headers = {"Authorization": f"Bearer {KEY}"}
    for path, body in (("/v1/completions", b"{not json"), ("/v1/nothing", b"{}")):
        r = httpx.post(server.url + path, content=body, headers=headers)
        assert r.status_code in (400, 404) and set(r.json()["error"]) == {
            "message", "type", "param", "code"}


def test_queue_full_is_429(server, client):
    """max_waiting 0: ROWS requests in flight fill the server; one more is refused.
    (Once its response headers came back a request is in flight, and these need 60+
    rounds each, so the refusal comes while they run, however loaded the machine.)"""
    streams = [client.completions.with_streaming_response.create(
        model="tiny-chat", prompt=PROMPT, max_tokens=240, temperature=0, stream=True)
        for _ in range(ROWS)]
    opened = [s.__enter__() for s in streams]
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=4)
        assert err.value.response.headers["retry-after"] == "1"
        for resp in opened:  # the admitted ones run
            assert next(line for line in resp.iter_lines() if line.startswith("data:"))
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    _idle(server)


def test_metrics_match_what_clients_saw(server, client):
    before = scrape(server.url)
    seen = [client.completions.create(model="tiny-chat", prompt=PROMPT[:n], max_tokens=n * 3,
                                      temperature=0) for n in (3, 5, 7)]
    after = scrape(server.url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    reasons = [r.choices[0].finish_reason for r in seen]
    for reason in ("stop", "length"):
        assert delta("nextn_serve_requests_total", reason=reason) == reasons.count(reason)
        assert delta("nextn_serve_completion_tokens_total", reason=reason) == sum(
            r.usage.completion_tokens for r in seen if r.choices[0].finish_reason == reason)
    assert delta("nextn_serve_prompt_tokens_total") == 15
    assert delta("nextn_serve_ttft_seconds_count") == 3
    assert delta("nextn_engine_emitted_tokens_total") == sum(
        r.usage.completion_tokens for r in seen)
    assert delta("nextn_engine_faults_total") == 0

    def total(name, **labels):  # over every other label, as a delta
        return sum(v - before.get((n, ls), 0.0) for (n, ls), v in after.items()
                   if n == name and set(labels.items()) <= set(ls))

    # Per position: exactly the engine's own draft counts, position 1 at least as often
    # accepted as position 2 (a chain), every position proposed once per request round.
    proposed = [delta("nextn_serve_draft_proposed_total", position=str(p)) for p in (1, 2, 3)]
    accepted = [delta("nextn_serve_draft_accepted_total", position=str(p)) for p in (1, 2, 3)]
    assert sum(proposed) == delta("nextn_engine_proposed_drafts_total") > 0
    assert sum(accepted) == delta("nextn_engine_accepted_drafts_total")
    assert proposed[0] == proposed[2] == delta("nextn_engine_request_rounds_total")
    assert accepted[0] >= accepted[1] >= accepted[2]
    # Phases by name and bucket: the replays are the engine's graph replays.
    assert total("nextn_serve_phase_runs_total", mode="graph") == delta(
        "nextn_engine_graph_replays_total") > 0
    assert total("nextn_serve_phase_runs_total", mode="eager") == delta(
        "nextn_engine_eager_fallbacks_total")
    assert 0 <= metric(after, "nextn_serve_draft_acceptance_rate", position="1") <= 1


def test_engine_fault_fails_only_its_request(server, client, oracle):
    """A fault in a prefill (raised from a forward pre-hook, once) fails the request being
    admitted with a 500 in OpenAI's shape, whose message names no server path; the
    request already running is untouched.
    (The hook goes on the engine's model: the thread host's, in this process.)"""
    if server.state.settings.engine != "thread":
        pytest.skip("the engine is in another process: no hook to place")
    want = oracle([PROMPT], 120)[0]
    engine = server.state.worker.host.engine
    fired = []

    def fault(module, args):
        if not fired:
            fired.append(True)
            raise RuntimeError("injected prefill fault in /home/me/kernels/attn.py:12")

    before = scrape(server.url)
    with client.completions.with_streaming_response.create(
            model="tiny-chat", prompt=PROMPT, max_tokens=120, temperature=0, stream=True,
            extra_body={"return_token_ids": True}) as running:
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))
        hook = engine.models.target.register_forward_pre_hook(fault)  # rounds replay graphs
        try:
            with pytest.raises(openai.InternalServerError) as err:
                client.completions.create(model="tiny-chat", prompt=PROMPT[:4], max_tokens=8,
                                          stream=True)
        finally:
            hook.remove()
        message = err.value.body["message"]
        assert "injected prefill fault in <path>" in message and "/home" not in message
        assert err.value.body["type"] == "server_error"
        events = [json.loads(line[6:]) for line in [first, *lines]
                  if line.startswith("data:") and line != "data: [DONE]"]
    tokens = [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]]
    assert tokens == want
    after = scrape(server.url)
    assert metric(after, "nextn_engine_faults_total") - metric(
        before, "nextn_engine_faults_total") == 1
    assert metric(after, "nextn_serve_requests_total", reason="error") - metric(
        before, "nextn_serve_requests_total", reason="error") == 1
    _idle(server)
