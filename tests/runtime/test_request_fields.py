"""A refused request's ``InputError`` names the field at fault as data (``.field``), for
every check of ``add_request`` and ``generate``; the server's 400 ``param`` is that
field, never read off the message; the server and the engine share one room rule."""

from __future__ import annotations

import pickle

import pytest
import torch

from nextn_graph.config import GraphConfig, PoolConfig, SpeculativeConfig
from nextn_graph.errors import InputError
from nextn_graph.penalties import MAX_BAN_IDS
from nextn_graph.runtime.engine import SpecEngine
from nextn_graph.runtime.request_checks import NewRequest, output_room
from nextn_graph.sampling import SamplingParams
from nextn_graph.serve.front.errors import APIError
from nextn_graph.serve.front.model_info import ModelInfo
from nextn_graph.serve.front.protocol import parse_request

MAX_CONTEXT = 64
K = 2  # graph.logprobs of the full engine


def _engine(tiny, **graph) -> SpecEngine:
    return SpecEngine(tiny.target, tiny.draft, SpeculativeConfig(num_steps=3, num_draft_tokens=4),
                      PoolConfig(2, MAX_CONTEXT), GraphConfig(backend="eager", **graph))


@pytest.fixture(scope="module")
def full(tiny) -> SpecEngine:
    """Takes everything: sampling, penalties, K logprobs."""
    return _engine(tiny, sampling=True, penalties=True, logprobs=K)


@pytest.fixture(scope="module")
def bare(tiny) -> SpecEngine:
    """Greedy only, no penalties, no logprobs."""
    return _engine(tiny, sampling=False, penalties=False, logprobs=0)


def _bad_inputs(vocab: int, room: int) -> list:
    """(add_request's keyword arguments, the field its refusal names) on ``full``."""
    ok = {"prompt": [5, 6, 7], "max_new_tokens": 3}
    cases = [
        ({"prompt": None}, "prompt"), ({"prompt": []}, "prompt"),
        ({"prompt": [5, vocab]}, "prompt"), ({"prompt": [5, True]}, "prompt"),
        ({"prompt": torch.tensor([5.0, 6.0])}, "prompt"),
        ({"prompt": [5] * room, "max_new_tokens": 1}, "prompt"),  # no room at all
        ({"prompt": [5] * (room - 2)}, "max_new_tokens"),  # room for 2, not 3
        ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": True}, "max_new_tokens"),
        ({"max_new_tokens": 2.0}, "max_new_tokens"),
        ({"stop_ids": 7}, "stop_ids"), ({"stop_ids": [None]}, "stop_ids"),
        ({"stop_ids": [vocab]}, "stop_ids"),
        ({"sampling": 5}, "sampling"), ({"sampling": {"temp": 1.0}}, "sampling"),
        ({"logprobs": K + 1}, "logprobs"), ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"sampling": {"min_tokens": 2}, "stop_ids": list(range(MAX_BAN_IDS + 1))},
         "min_tokens"),  # (with_bans: too many stop ids to hold back)
        ({"sampling": {"logit_bias": {vocab: 1.0}}}, "logit_bias"),  # (the engine's vocab)
    ]
    for key, value in [("temperature", -1.0), ("top_p", 0.0), ("top_k", -1), ("seed", -1),
                       ("min_p", 2.0), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
                       ("repetition_penalty", 0.0), ("logit_bias", {"x": 1.0}),
                       ("logit_bias", {5: 200.0}), ("min_tokens", -1)]:
        cases.append(({"sampling": {key: value}}, key))
    return [({**ok, **kw}, field) for kw, field in cases]


BARE_CASES = [  # what an engine built without them refuses
    ({"sampling": {"temperature": 0.5}}, "temperature"),
    ({"sampling": {"presence_penalty": 0.5}}, "presence_penalty"),
    ({"sampling": {"logit_bias": {5: 1.0}}}, "logit_bias"),
    ({"sampling": {"min_tokens": 2}}, "min_tokens"),  # (holds the EOS back: a penalty)
    ({"logprobs": 0}, "logprobs"), ({"prompt_logprobs": 1}, "prompt_logprobs"),
]


def _refusal(eng: SpecEngine, kwargs: dict) -> InputError:
    waiting, rid = eng.num_waiting, eng.scheduler.next_rid
    with pytest.raises(InputError) as info:
        eng.add_request(**kwargs)
    assert eng.num_waiting == waiting and eng.scheduler.next_rid == rid  # nothing queued
    assert str(info.value).startswith(f"request {rid}: "), info.value
    return info.value


def test_each_add_request_refusal_names_its_field(full, bare):
    room = output_room(0, MAX_CONTEXT, full.request_limits.lookahead)
    for kwargs, field in _bad_inputs(full.cfg.vocab_size, room):
        assert _refusal(full, kwargs).field == field, kwargs
    for kwargs, field in BARE_CASES:
        assert _refusal(bare, {"prompt": [5, 6, 7], "max_new_tokens": 3, **kwargs}).field \
            == field, kwargs
        full.abort(full.add_request(**{"prompt": [5, 6, 7], "max_new_tokens": 3, **kwargs}))


def test_checked_request_is_the_validated_values(full):
    """What ``add_request`` queues: ints, a frozenset of stops, resolved sampling."""
    got = NewRequest(torch.tensor([5, 6]), torch.tensor(3), None,
                     {"min_tokens": 1, "temperature": 0.7}, 1).checked(full.request_limits, "r")
    assert got.prompt == [5, 6] and type(got.max_new_tokens) is int and got.max_new_tokens == 3
    assert got.stop_ids == frozenset({full.cfg.eos_token_id})
    assert got.sampling.seed is not None and got.sampling.ban_ids == (full.cfg.eos_token_id,)
    assert (got.logprobs, got.prompt_logprobs) == (1, None)


@pytest.mark.parametrize("call, field", [
    (lambda e: e.generate([[5, 6], [5, 10**6]], 2), "prompt"),
    (lambda e: e.generate("abc", 2), "prompts"),
    (lambda e: e.generate([[5, 6], [7, 8]], 2, sampling=[None, {"top_p": 0.0}]), "top_p"),
    (lambda e: e.generate([[5, 6], [7, 8]], 2, sampling=[None]), "sampling"),
    (lambda e: e.generate([[5, 6]], 2, stop_ids=[None]), "stop_ids"),
])
def test_generate_refusals_name_their_field_before_queuing(full, call, field):
    with pytest.raises(InputError) as info:
        call(full)
    assert info.value.field == field and not full.has_work


def test_field_survives_pickling():
    """(an error may cross a process boundary: the server's engine process)"""
    back = pickle.loads(pickle.dumps(InputError("request 0: top_k ...", field="top_k")))
    assert (str(back), back.field) == ("request 0: top_k ...", "top_k")
    assert InputError("no single field").field is None


def _info(eng: SpecEngine) -> ModelInfo:
    """The front's view of ``eng``: its own limits (no tokenizer, no chat template)."""
    return ModelInfo("m", eng.request_limits, None, None)


# (the sampling values the server passes to the runtime's checks as given: its own
# integer checks refuse a bad top_k, seed or min_tokens first)
SERVED_CASES = [("temperature", -1.0), ("top_p", 0.0), ("min_p", 2.0),
                ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
                ("repetition_penalty", 0.0), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 200}),
                # a digit no decimal one, a key past int(str)'s 4300 digits, a bias past a
                # float (each raised a bare ValueError or OverflowError: a 500)
                ("logit_bias", {"\u00b2": 1}), ("logit_bias", {"1" * 5000: 1}),
                ("logit_bias", {"5": 10**400})]


@pytest.mark.parametrize("key, value", SERVED_CASES)
def test_server_param_is_the_runtime_field(full, key, value):
    """The same bad value: the runtime check's field is the 400's param."""
    with pytest.raises(InputError) as runtime:
        SamplingParams(**{key: value}).checked("sampling")
    with pytest.raises(APIError) as served:
        parse_request({"prompt": [5, 6, 7], "max_tokens": 2, key: value}, _info(full), False)
    assert served.value.status == 400 and served.value.param == runtime.value.field == key
    assert served.value.message == str(runtime.value).removeprefix("sampling: ")


def test_server_param_comes_from_the_field_not_the_message(full, monkeypatch):
    """A message that names no field (or another) still maps by ``.field``."""
    def refuse(self, where):
        raise InputError(f"{where}: temperature words, but the fault is top_k's", field="top_k")
    monkeypatch.setattr(SamplingParams, "checked", refuse)
    with pytest.raises(APIError) as served:
        parse_request({"prompt": [5, 6, 7], "max_tokens": 2}, _info(full), False)
    assert served.value.param == "top_k"
    assert served.value.message == "temperature words, but the fault is top_k's"


def test_min_tokens_holding_too_many_stops_is_min_tokens(full):
    ids = list(range(2, MAX_BAN_IDS + 2))  # with the EOS: one more than is held back
    with pytest.raises(APIError) as served:
        parse_request({"prompt": [5, 6, 7], "max_tokens": 2, "min_tokens": 1,
                       "stop_token_ids": ids}, _info(full), False)
    assert served.value.param == "min_tokens"
    assert f"at most {MAX_BAN_IDS} with min_tokens" in served.value.message


def test_server_and_engine_share_the_room_rule(full):
    """A prompt that leaves one token of room is taken by both; one token longer is
    refused by both, as the prompt's fault."""
    info = _info(full)
    lookahead = full.request_limits.lookahead
    longest = output_room(0, MAX_CONTEXT, lookahead) - 1
    assert output_room(longest, MAX_CONTEXT, lookahead) == 1 and lookahead > 0
    for n, fits in ((longest, True), (longest + 1, False)):
        body = {"prompt": [5] * n, "max_tokens": 1}
        if fits:
            assert parse_request(body, info, False).prompts == ((5,) * n,)
            full.abort(full.add_request([5] * n, 1))
            continue
        with pytest.raises(APIError) as served:
            parse_request(body, info, False)
        assert served.value.param == "prompt"
        assert _refusal(full, {"prompt": [5] * n, "max_new_tokens": 1}).field == "prompt"
