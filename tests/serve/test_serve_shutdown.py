"""SIGTERM on a running ``nextn-graph serve`` process: it stops admitting, every request
in flight either completes or fails with an explicit error event (none is cut off
silently), and the process exits 0. Also the chat endpoint's 400 on a checkpoint
without a chat template (builtin:tiny-trained ships none)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from serve_support import free_port, metric, scrape

PROMPT = [72, 101, 108, 108, 111, 44, 32, 109, 121]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 240) -> list[int]:
    """Poll /health until 200 -> the statuses seen on the way."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                seen.append(r.status)
                return seen
        except urllib.error.HTTPError as exc:
            seen.append(exc.code)
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.05)
    raise AssertionError("the server did not become healthy")


@pytest.mark.process
def test_sigterm_loses_no_request_silently():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "nextn_graph", "serve", "--host", "127.0.0.1", "--port",
         str(port), "--max-requests", "2", "--shutdown-grace", "1", "--log-level", "warning"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        # listening at once, 503 while the engine thread loads and captures, then 200
        # (loading and capture take seconds; the socket is bound in milliseconds)
        statuses = _wait_healthy(url, proc)
        assert statuses[0] == 503 and statuses[-1] == 200, statuses
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tiny-trained",
                                           messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["code"] == "no_chat_template"
        results: dict[int, tuple] = {}

        def run(i: int, max_tokens: int) -> None:
            try:
                chunks = [c for c in client.completions.create(
                    model="tiny-trained", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                    stream=True) if c.choices]
                results[i] = ("done", chunks[-1].choices[0].finish_reason)
            except openai.APIError as exc:
                results[i] = ("error", str(exc))

        # two rows: two long requests run, the third waits; the short one may finish
        jobs = [threading.Thread(target=run, args=(i, n)) for i, n in
                enumerate((480, 480, 480, 4))]
        for job in jobs:
            job.start()
        deadline = time.monotonic() + 60
        while metric(scrape(url), "nextn_serve_in_flight_requests") < len(jobs) - int(3 in results):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for job in jobs:
            job.join(120)
        assert proc.wait(120) == 0, proc.stderr.read()
        assert sorted(results) == [0, 1, 2, 3]
        for outcome, detail in results.values():
            assert (outcome == "done" and detail in ("length", "stop")) or (
                outcome == "error" and "shut" in detail), (outcome, detail)
        assert any(outcome == "error" for outcome, _ in results.values())  # grace 1 s
        with pytest.raises(openai.APIConnectionError):  # nothing listens any more
            client.completions.create(model="tiny-trained", prompt=PROMPT, max_tokens=4)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_without_a_checkpoint_exits_2(tmp_path, capsys):
    from nextn_graph.cli import main

    assert main(["serve", "--port", "0", "--log-level", "critical",
                 "--checkpoint", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "the engine failed to start" in err and "missing" in err


def test_serve_passes_the_prefill_budget_to_the_engine(capsys):
    """--prefill-token-budget overrides the YAML's scheduler section; a bad value exits 2
    naming the key before anything listens."""
    from nextn_graph.cli.commands import build_parser, main
    from nextn_graph.serve.command import serve_config

    args = build_parser().parse_args(["serve", "--prefill-token-budget", "64"])
    assert serve_config(args).scheduler.prefill_token_budget == 64
    args = build_parser().parse_args(["serve"])
    assert serve_config(args).scheduler.prefill_token_budget == 0  # the config's
    assert main(["serve", "--port", "0", "--log-level", "critical",
                 "--prefill-token-budget", "-1"]) == 2
    assert "scheduler.prefill_token_budget" in capsys.readouterr().err


def test_serve_passes_max_logprobs_to_the_engine(capsys):
    """--max-logprobs (default 20, as vLLM's) sets graph.logprobs; a bad value exits 2
    naming the key."""
    from nextn_graph.cli.commands import build_parser, main
    from nextn_graph.serve.command import serve_config

    assert serve_config(build_parser().parse_args(["serve"])).graph.logprobs == 20
    args = build_parser().parse_args(["serve", "--max-logprobs", "3"])
    assert serve_config(args).graph.logprobs == 3
    assert main(["serve", "--port", "0", "--log-level", "critical",
                 "--max-logprobs", "-1"]) == 2
    assert "graph.logprobs" in capsys.readouterr().err


def test_serve_runs_the_engine_in_a_process_unless_told():
    """The engine's own process is the default; --engine-thread keeps it on a thread."""
    from nextn_graph.cli.commands import build_parser
    from nextn_graph.serve.command import serve_settings

    assert serve_settings(build_parser().parse_args(["serve"])).engine == "process"
    args = build_parser().parse_args(["serve", "--engine-thread"])
    assert serve_settings(args).engine == "thread"


def test_serve_body_timeout_option(capsys):
    """--body-timeout sets ServeSettings.body_timeout_s (30 s unless told); a value that
    is no positive number of seconds is refused by argparse, naming it."""
    from nextn_graph.cli.commands import build_parser
    from nextn_graph.serve.command import serve_settings

    assert serve_settings(build_parser().parse_args(["serve"])).body_timeout_s == 30.0
    args = build_parser().parse_args(["serve", "--body-timeout", "2.5"])
    assert serve_settings(args).body_timeout_s == 2.5
    for bad in ("0", "-1", "inf", "soon"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--body-timeout", bad])
        assert "--body-timeout" in capsys.readouterr().err
