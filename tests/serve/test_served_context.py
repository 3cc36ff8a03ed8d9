"""A page-bound pool, served: the front checks requests against the engine's own
``RequestLimits``, built on production's path (``build_engine``), whose max_context is
capped by the pool's pages; so a request without max_tokens defaults to a room the
engine holds, and the limits' max_context is exactly what ``add_request`` accepts.

builtin:tiny-trained (with a chat template) on the embedded default config, with one
page (256 positions) for its pool.max_context of 512, and two rows (the default's eight
would capture buckets up to 8: four times the start-up). One server (its engine on a
thread) serves the module."""

from __future__ import annotations

import pickle

import httpx
import pytest

from nextn_graph.config import load_run_config
from nextn_graph.errors import InputError
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.request_checks import output_room
from nextn_graph.serve.front.limits import ServeSettings
from nextn_graph.serve.thread import ServerThread

from serve_support import chat_checkpoint

ROWS, PAGES = 2, 1
PROBE = [5] * 10  # the prompt add_request is probed with


def _probe(engine: SpecEngine, seen: dict) -> None:
    """(``prepare``: on the engine's thread, before its loop) add_request at the edge of
    the engine's limits: a request of exactly the room, and one token more."""
    limits = seen["limits"] = engine.request_limits
    room = output_room(len(PROBE), limits.max_context, limits.lookahead)
    for n in (room, room + 1):
        try:
            engine.abort(engine.add_request(PROBE, n, stop_ids=[]))
            seen[n] = "accepted"
        except InputError as exc:
            seen[n] = exc
    seen["room"] = room


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = chat_checkpoint(tmp_path_factory.mktemp("ckpt"))
    cfg = load_run_config(None, checkpoint=str(root),
                          pool={"max_requests": ROWS, "num_pages": PAGES})
    seen: dict = {}
    with ServerThread(cfg, ServeSettings(port=0, engine="thread"),
                      prepare=lambda engine: _probe(engine, seen)) as srv:
        srv.cfg, srv.seen = cfg, seen
        srv.http = httpx.Client(base_url=srv.url, timeout=120)
        yield srv
        srv.http.close()


def test_limits_are_what_the_engine_accepts(served):
    """max_context: the pages' 256 positions, below pool.max_context (and the model's
    512); a request of exactly the room is taken, one more is refused naming the
    pages; the limits pickle (the engine process's pipe) and are what the front holds."""
    pool, seen = served.cfg.pool, served.seen
    limits = seen["limits"]
    assert (pool.max_context, pool.page_size, pool.num_pages) == (512, 256, PAGES)
    assert limits.max_context == PAGES * pool.page_size == 256
    assert seen[seen["room"]] == "accepted"
    refused = seen[seen["room"] + 1]
    assert isinstance(refused, InputError) and refused.field == "max_new_tokens"
    assert str(refused).endswith(
        f"exceeds the maximum context 256 (the pool's pages: pool.num_pages {PAGES} x "
        f"page_size 256)"), refused
    assert pickle.loads(pickle.dumps(limits)) == limits
    assert served.state.worker.info.limits == limits
    models = served.http.get("/v1/models").json()
    assert models["data"][0]["max_model_len"] == 256


def _post(served, path: str, body: dict) -> dict:
    r = served.http.post(path, json={**body, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_without_max_tokens_gets_the_room_the_engine_holds(served):
    """Chat's default max_tokens is the prompt's whole room: the pages' (the trained
    model never emits its EOS, so the request runs to it)."""
    lookahead = served.seen["limits"].lookahead
    got = _post(served, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}]})
    usage = got["usage"]
    assert got["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == 256 - lookahead - usage["prompt_tokens"] > 16


def test_completion_without_max_tokens_fits_what_the_engine_holds(served):
    """Completions default to 16 tokens, cut to the prompt's room: 4 here; asking 5 is a
    400 naming the pages."""
    lookahead = served.seen["limits"].lookahead
    prompt = [5] * (256 - lookahead - 4)
    got = _post(served, "/v1/completions", {"prompt": prompt})
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4,
                            "total_tokens": len(prompt) + 4,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    r = served.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_tokens"
    assert error["message"] == (
        f"max_tokens 5 + the prompt's {len(prompt)} tokens + {lookahead} positions of "
        f"verify lookahead exceed the maximum context 256 (the pool's pages: "
        f"pool.num_pages 1 x page_size 256): at most 4 here")
