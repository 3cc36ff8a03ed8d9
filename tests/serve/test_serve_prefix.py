"""The prefix cache behind the server: a prompt that shares a cached page reports it in
``usage.prompt_tokens_details.cached_tokens`` (as inference-perf reads it) and in
``/metrics``, with the tokens of plain greedy decoding; ``--no-prefix-cache`` turns it
off."""

from __future__ import annotations

import httpx

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.cli.commands import build_parser
from nextn_graph.config import load_run_config
from nextn_graph.runtime.generate import plain_generate
from nextn_graph.serve.command import serve_config
from nextn_graph.serve.front.limits import ServeSettings
from nextn_graph.serve.thread import ServerThread

from helpers import corpus_prompts
from serve_support import metric, scrape

PAGE = 128


def test_a_cached_page_is_reported_and_exact():
    a, b = corpus_prompts(6, [200, 40])
    first, second = a[:180], a[:150] + b  # shares a's first page of 128
    cfg = load_run_config(None, pool={"max_requests": 2, "max_context": 512,
                                      "page_size": PAGE}, graph={"sampling": False})
    models = load_checkpoint(cfg.checkpoint)
    want = plain_generate(models.target, [first, second], 12, stop_ids=()).outputs
    with ServerThread(cfg, ServeSettings(port=0, engine="thread")) as srv:
        got = []
        for prompt in (first, second):
            r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True})
            assert r.status_code == 200, r.text
            got.append(r.json())
        samples = scrape(srv.url)
    assert [g["choices"][0]["token_ids"] for g in got] == want
    assert [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got] == [0, PAGE]
    assert metric(samples, "nextn_prefix_cache_hit_tokens_total") == PAGE
    assert metric(samples, "nextn_prefix_cache_queried_tokens_total") == len(first) + len(second)
    assert metric(samples, "nextn_engine_cached_tokens_total") == PAGE


def test_no_prefix_cache_switch():
    on = serve_config(build_parser().parse_args(["serve"]))
    off = serve_config(build_parser().parse_args(["serve", "--no-prefix-cache"]))
    assert on.pool.prefix_cache and not off.pool.prefix_cache
