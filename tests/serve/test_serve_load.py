"""A load test on loopback: 200 requests, 32 at a time, mixed prompt and output lengths,
streamed and whole, every tenth cancelled by its client after its first chunk. Every
request must end complete and equal to the plain-decoding oracle, or cancelled with a
prefix of it; no pool row may leak; /metrics must agree with what the clients saw. The
engine runs in its own process (the server's default)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.config import load_run_config
from nextn_graph.runtime.generate import plain_generate
from nextn_graph.serve.front.limits import ServeSettings
from nextn_graph.serve.thread import ServerThread

from helpers import corpus_prompts
from serve_support import metric, scrape, wait_idle

REQUESTS, CONCURRENCY, ROWS, MAX_CONTEXT = 200, 32, 8, 192
OUTPUT_LENGTHS = (8, 24, 48)
CANCEL_TOKENS = 140  # prompts < 40 + 140 + the verify lookahead fit MAX_CONTEXT


def _plan(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    lengths = [rng.randrange(3, 40) for _ in range(REQUESTS)]
    prompts = corpus_prompts(seed + 1, lengths)
    # a cancelled request asks for far more than any other (a round commits at most N = 4
    # tokens), so it is still running when its client goes away after the first chunk,
    # even where a loaded host is slow to schedule that client's thread
    return [{"i": i, "prompt": p, "stream": i % 2 == 0, "cancel": i % 10 == 5,
             "max_tokens": CANCEL_TOKENS if i % 10 == 5 else rng.choice(OUTPUT_LENGTHS)}
            for i, p in enumerate(prompts)]


def _run(client: openai.OpenAI, job: dict) -> dict:
    args = dict(model="tiny-trained", prompt=job["prompt"], max_tokens=job["max_tokens"],
                temperature=0, extra_body={"return_token_ids": True})
    if job["cancel"]:  # one chunk, then the client goes away
        with client.completions.with_streaming_response.create(stream=True, **args) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))
        return {"outcome": "cancelled"}
    try:
        if job["stream"]:
            chunks = [c for c in client.completions.create(stream=True, **args) if c.choices]
            tokens = [t for c in chunks for t in c.choices[0].token_ids]
            return {"outcome": chunks[-1].choices[0].finish_reason, "tokens": tokens,
                    "usage": chunks[-1].usage.completion_tokens}
        whole = client.completions.create(**args)
        return {"outcome": whole.choices[0].finish_reason, "tokens": whole.choices[0].token_ids,
                "usage": whole.usage.completion_tokens}
    except openai.APIError as exc:
        return {"outcome": "error", "error": str(exc)}


@pytest.mark.heavy
def test_load_200_requests_32_concurrent():
    cfg = load_run_config(None, pool={"max_requests": ROWS, "max_context": MAX_CONTEXT})
    plan = _plan()
    models = load_checkpoint(cfg.checkpoint)
    want = {}
    for n in OUTPUT_LENGTHS:  # the oracle, batched by output length
        jobs = [j for j in plan if j["max_tokens"] == n]
        outs = plain_generate(models.target, [j["prompt"] for j in jobs], n,
                              max_context=MAX_CONTEXT).outputs
        want.update({j["i"]: o for j, o in zip(jobs, outs)})
    with ServerThread(cfg, ServeSettings(port=0, max_waiting=64, engine="thread")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        start = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            got = list(pool.map(lambda j: _run(client, j), plan))
        wall = time.monotonic() - start
        wait_idle(srv, ROWS, 30)  # no pool row leaked (the engine's own process says)
        seen = scrape(srv.url)
    done = [(j, g) for j, g in zip(plan, got) if g["outcome"] in ("stop", "length")]
    errors = [g for g in got if g["outcome"] == "error"]
    assert not errors, errors[:3]
    assert len(done) + sum(j["cancel"] for j in plan) == REQUESTS
    for job, g in done:
        assert g["tokens"] == want[job["i"]], job["i"]
        assert g["usage"] == len(g["tokens"])
    for reason in ("stop", "length"):
        mine = [g for _, g in done if g["outcome"] == reason]
        assert metric(seen, "nextn_serve_requests_total", reason=reason) == len(mine)
        assert metric(seen, "nextn_serve_completion_tokens_total", reason=reason) == sum(
            g["usage"] for g in mine)
    assert metric(seen, "nextn_serve_requests_total", reason="cancelled") == REQUESTS // 10
    assert metric(seen, "nextn_serve_ttft_seconds_count") >= len(done)
    assert metric(seen, "nextn_serve_running_requests") == 0
    assert metric(seen, "nextn_serve_in_flight_requests") == 0
    assert metric(seen, "nextn_engine_faults_total") == 0
    print(f"load: {REQUESTS} requests in {wall:.1f} s")
