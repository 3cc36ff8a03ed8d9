"""The server's per-request timeout (``serve --request-timeout``): a request still running
at its deadline fails explicitly (504 before its stream started, an error event in it
after), its engine requests are aborted and their rows freed, and requests that finish in
time are untouched."""

from __future__ import annotations

import json

import httpx
import pytest

from nextn_graph.config import load_run_config
from nextn_graph.serve.front.limits import ServeSettings
from nextn_graph.serve.thread import ServerThread

from serve_support import metric, scrape, wait_idle

ROWS, TIMEOUT_S = 2, 0.4
PROMPT = [72, 101, 108, 108, 111, 44, 32, 109, 121]
LONG = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    cfg = load_run_config(None, pool={"max_requests": ROWS, "max_context": 512})
    settings = ServeSettings(port=0, engine="thread", request_timeout_s=TIMEOUT_S)
    with ServerThread(cfg, settings) as srv:
        srv.http = httpx.Client(base_url=srv.url, timeout=60)
        yield srv
        srv.http.close()


def test_a_request_past_its_deadline_fails_and_frees_its_row(server):
    r = server.http.post("/v1/completions", json=LONG)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["code"] == "timeout" and f"{TIMEOUT_S:g} s" in error["message"]
    with server.http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as s:
        assert s.status_code == 200  # the first tokens came in time
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events]
    assert "error" in chunks[-1] and chunks[-1]["error"]["code"] == "timeout"
    assert any(c.get("choices") for c in chunks[:-1])  # tokens before the deadline
    wait_idle(server, ROWS)
    assert metric(scrape(server.url), "nextn_serve_requests_total", reason="timeout") == 2


def test_requests_within_the_deadline_are_untouched(server):
    r = server.http.post("/v1/completions", json={**LONG, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_a_bad_timeout_is_refused_by_name():
    with pytest.raises(Exception, match="request_timeout_s"):
        ServeSettings(request_timeout_s=0)
