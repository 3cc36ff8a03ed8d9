"""The engine in its own process, killed (SIGKILL: as a segfault or the OOM killer
would end it) while requests are open: a stream gets an ``error`` event naming the
death, a waiting whole request a 500 naming it, ``/health`` a 503 with the reason,
new requests a 503, and ``/metrics`` nothing running, waiting or free. A fault inside the engine process in the middle of a stream (one
request's round chunk raising) ends that stream alone. Also the front's own process
never builds an engine: the pool and the device are the engine process's, seen through
the loop's snapshots."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from nextn_graph.checkpoint.loader import load_checkpoint
from nextn_graph.config import load_run_config
from nextn_graph.runtime.generate import plain_generate
from nextn_graph.serve.engine.hosts import ProcessHost
from nextn_graph.serve.front.limits import ServeSettings
from nextn_graph.serve.thread import ServerThread

from serve_support import FAULT, fault_a_shared_round, metric, scrape, wait_idle

pytestmark = pytest.mark.process  # the engine in its own process: the process boundary's tests

ROWS = 2
PROMPT = [72, 101, 108, 108, 111, 44, 32, 109, 121]


@pytest.fixture
def server():
    cfg = load_run_config(None, pool={"max_requests": ROWS, "max_context": 512})
    with ServerThread(cfg, ServeSettings(port=0, max_waiting=4)) as srv:
        yield srv


def test_the_engine_runs_in_another_process(server):
    host = server.state.worker.host
    assert isinstance(host, ProcessHost) and host.pid != os.getpid()
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    wait_idle(server, ROWS)  # (an overlapped round may hold the row one more step)
    snap = server.state.worker.snapshot
    assert snap.stats["emitted_tokens"] == r.json()["usage"]["completion_tokens"]


def test_a_killed_engine_fails_every_request_explicitly(server):
    http = httpx.Client(base_url=server.url, timeout=120)
    body = {"prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    whole: dict = {}

    def wait_whole() -> None:  # a non-streamed request in flight when the engine dies
        r = http.post("/v1/completions", json=body)
        whole.update(status=r.status_code, body=r.json())

    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert "error" not in json.loads(first[6:])
        waiter = threading.Thread(target=wait_whole)
        waiter.start()
        deadline = time.monotonic() + 30
        while server.state.admission.in_flight < 2 or metric(
                scrape(server.url), "nextn_serve_running_requests") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(server.state.worker.host.pid, signal.SIGKILL)
        events = [json.loads(line[6:]) for line in lines
                  if line.startswith("data: {")]
    waiter.join(60)
    reason = f"the engine process died (exit code {-signal.SIGKILL})"
    assert events and events[-1]["error"]["message"] == reason
    assert all("error" not in e for e in events[:-1])
    assert whole["status"] == 500 and whole["body"]["error"]["message"] == reason
    health = http.get("/health")
    assert health.status_code == 503 and health.json()["reason"] == reason
    late = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    assert late.status_code == 503 and late.json()["error"]["message"] == reason
    assert server.state.admission.in_flight == 0
    after = scrape(server.url)  # the dead engine runs, queues and serves nothing
    for name in ("ready", "running_requests", "queue_depth", "free_rows",
                 "in_flight_requests"):
        assert metric(after, f"nextn_serve_{name}") == 0, name
    assert metric(after, "nextn_engine_emitted_tokens_total") > 0  # (its totals stay)
    http.close()


def _stream(url: str, prompt: list[int], max_tokens: int) -> tuple[list[int], list[dict]]:
    """A streamed greedy completion -> (its token ids, its error events)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    tokens, errors = [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                elif event["choices"]:
                    tokens += event["choices"][0].get("token_ids") or []
    return tokens, errors


def test_a_fault_mid_stream_fails_that_stream_alone():
    """Two streams decode in the engine process, one request per round chunk (bucket 1);
    a round chunk raises there (placed by ``prepare``, once both rows ran): that chunk's
    stream ends with an error event naming the fault after the tokens it had, the other
    stream's tokens are the no-cache oracle's, and the engine serves the next request."""
    cfg = load_run_config(None, pool={"max_requests": ROWS, "max_context": 512},
                          graph={"buckets": [1], "sampling": False})
    prompts = [PROMPT, PROMPT[::-1]]
    models = load_checkpoint(cfg.checkpoint)
    want = plain_generate(models.target, prompts, 48, max_context=512).outputs
    with ServerThread(cfg, ServeSettings(port=0, max_waiting=4),
                      prepare=fault_a_shared_round) as srv:
        got: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i: got.update({i: _stream(
            srv.url, prompts[i], 48)})) for i in range(2)]
        for t in threads:  # (at once: both are admitted into the same steps)
            t.start()
        for t in threads:
            t.join(120)
        failed = [i for i in got if got[i][1]]
        assert len(got) == 2 and len(failed) == 1, got
        assert min(len(w) for w in want) > 8  # (both still decoding at the fault)
        bad, good = failed[0], 1 - failed[0]
        assert got[good] == (want[good], [])
        tokens, errors = got[bad]
        assert len(errors) == 1 and FAULT in errors[0]["message"]
        assert tokens == want[bad][:len(tokens)]  # what it streamed before stays right
        assert _stream(srv.url, prompts[bad], 48) == (want[bad], [])
        wait_idle(srv, ROWS)
