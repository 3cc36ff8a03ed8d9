"""Bad configs, prompts and stop ids raise the library's named errors, whose messages
name the key or request and the bad value: never a raw TypeError / IndexError from
inside torch, and never a silent acceptance (``True`` as token 1, a float tensor as
"outside the vocabulary")."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from nextn_graph.checkpoint.loader import build_models, resolve_checkpoint
from nextn_graph.errors import ConfigError, InputError
from nextn_graph.runtime.generate import plain_generate, reference_generate
from nextn_graph.runtime.request_checks import (RequestLimits, validate_max_new_tokens,
                                                validate_prompt, validate_stop_ids)
from nextn_graph.model.config import (config_from_dict, load_config, model_bytes,
                                      physical_memory_bytes)
from nextn_graph.checkpoint.presets import TINY

VOCAB = TINY["vocab_size"]


def _config(**changes):
    return config_from_dict({**TINY, **changes}, "test.json")


def _refused(needles: list[str], **changes) -> str:
    with pytest.raises(ConfigError) as info:
        _config(**changes)
    message = str(info.value)
    assert message.startswith("test.json: ")
    for needle in needles:
        assert needle in message, message
    return message


# -- config.json ranges ------------------------------------------------------------------

def test_negative_rope_dim_refused():
    """qk_rope_head_dim -2 (even, below head_dim) once passed and failed inside torch."""
    _refused(["'qk_rope_head_dim'", "at least 2", "got -2"], qk_rope_head_dim=-2)


@pytest.mark.parametrize("key, value, needles", [
    ("o_lora_rank", -1, ["'o_lora_rank'", "at least 1, got -1"]),
    ("q_lora_rank", 0, ["'q_lora_rank'", "at least 1, got 0"]),
    ("hc_sinkhorn_iters", -1, ["'hc_sinkhorn_iters'", "at least 1, got -1"]),
    ("hc_sinkhorn_iters", 0, ["'hc_sinkhorn_iters'", "got 0"]),
    ("moe_intermediate_size", 0, ["'moe_intermediate_size'", "got 0"]),
    ("index_n_heads", -3, ["'index_n_heads'", "got -3"]),
    ("n_shared_experts", -1, ["'n_shared_experts'", "at least 0, got -1"]),
    ("num_hash_layers", -1, ["'num_hash_layers'", "at least 0, got -1"]),
    ("num_hash_layers", 5, ["'num_hash_layers'", "5 exceeds num_hidden_layers 4"]),
    ("qk_rope_head_dim", 0, ["'qk_rope_head_dim'", "got 0"]),
    ("qk_rope_head_dim", 15, ["'qk_rope_head_dim'", "even", "got 15"]),
    ("qk_rope_head_dim", 34, ["'qk_rope_head_dim'", "at most head_dim 32, got 34"]),
    ("o_groups", 3, ["'o_groups'", "3 must divide num_attention_heads * head_dim = 128"]),
    ("rms_norm_eps", 0.0, ["'rms_norm_eps'", "> 0.0, got 0.0"]),
    ("rms_norm_eps", math.nan, ["'rms_norm_eps'", "finite", "got nan"]),
    ("routed_scaling_factor", math.inf, ["'routed_scaling_factor'", "got inf"]),
    ("swiglu_limit", -1.0, ["'swiglu_limit'", ">= 0.0, got -1.0"]),
    ("hc_eps", -1e-6, ["'hc_eps'", "got -1e-06"]),
    ("rope_theta", 1.0, ["'rope_theta'", "> 1.0, got 1.0"]),
    ("compress_rope_theta", -5, ["'compress_rope_theta'", "got -5.0"]),
    ("bos_token_id", VOCAB, ["'bos_token_id'", f"{VOCAB} is outside the vocabulary"]),
    ("bos_token_id", -1, ["'bos_token_id'", "at least 0, got -1"]),
])
def test_out_of_range_config_value_refused(key, value, needles):
    """Every integer and float key has a range; the error names the key and value."""
    _refused(needles, **{key: value})


@pytest.mark.parametrize("ratios, needle", [
    ([False, 4, 128, 4, False], "must be a list of ints, got [False, 4, 128, 4, False]"),
    ([0, 4, True, 4, 0], "must be a list of ints, got [0, 4, True, 4, 0]"),
    ([0, 4, 128, 4, 4], "entry 4 (the NextN layer) is 4; the NextN layer is sliding-window "
                        "only, ratio 0"),
    ([0, 4, 128, 4, 128], "entry 4 (the NextN layer) is 128"),
])
def test_bad_compress_ratios_refused(ratios, needle):
    """``false`` is not ratio 0 (bool is an int in Python), and the NextN entry is the
    draft layer's, which is always sliding-window only: anything but 0 is refused, not
    ignored."""
    _refused([f"'compress_ratios' {needle}"], compress_ratios=ratios)
    assert _config(compress_ratios=[0, 4, 128, 4]).compress_ratios == (0, 4, 128, 4)


@pytest.mark.parametrize("key, value", [
    ("vocab_size", True), ("hc_sinkhorn_iters", False), ("rope_theta", True),
])
def test_bool_config_values_refused(key, value):
    """true/false never pass as 1/0 for a numeric key."""
    _refused([f"'{key}' must be", f"got {value}"], **{key: value})


@pytest.mark.parametrize("key, high", [("hc_sinkhorn_iters", 1000), ("num_hidden_layers", 1024),
                                       ("n_routed_experts", 4096)])
def test_absurd_loop_counts_refused(key, high):
    """Loop counts of every forward (hc_sinkhorn_iters 1e9 hung the first one) have an
    upper bound far above any released model, checked before anything is built."""
    for value in (high + 1, 10**9):
        _refused([f"'{key}' must be at most {high}, got {value}"], **{key: value})
    assert _config(hc_sinkhorn_iters=1000).hc_sinkhorn_iters == 1000


@pytest.mark.parametrize("key, value, needle", [
    ("rope_theta", 10**400, "'rope_theta' is out of the float range, got 1000"),
    ("hidden_size", 10**400, "'hidden_size' must fit in 64 bits, got 1000"),
    ("max_position_embeddings", 2**63, "'max_position_embeddings' must fit in 64 bits"),
    ("rope_scaling", {**TINY["rope_scaling"], "factor": 10**400},
     "'rope_scaling.factor' is out of the float range"),
])
def test_huge_integers_refused_without_overflow(key, value, needle):
    """An integer past the float range (or 64 bits) is a named error, cut short, not an
    OverflowError from float() or from the size estimate."""
    assert len(_refused([needle, "..."] if value != 2**63 else [needle], **{key: value})) < 300


def _config_file(tmp_path, data: bytes):
    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'config.json'}:") and len(message) < 400
    return message


def test_unreadable_config_json_is_a_config_error(tmp_path):
    """Bytes that are not UTF-8, absurd nesting, an integer literal too long to parse
    and a huge integer for a float key: each a ConfigError naming config.json."""
    assert "not UTF-8 text (byte 0xff at byte offset 0)" in _config_file(tmp_path, b"\xff\xfe{}")
    deep = b"[" * 100_000 + b"]" * 100_000
    assert "malformed JSON (nested too deeply)" in _config_file(tmp_path, deep)
    assert "malformed JSON" in _config_file(tmp_path, b'{"vocab_size": ' + b"1" * 5000 + b"}")
    huge = json.dumps({**TINY, "rope_theta": 0}).replace('"rope_theta": 0',
                                                         '"rope_theta": 1' + "0" * 400)
    assert "'rope_theta' is out of the float range" in _config_file(tmp_path, huge.encode())


@pytest.mark.parametrize("changes, needles", [
    ({"factor": 0}, ["rope_scaling.factor", "> 0, got 0.0"]),
    ({"beta_slow": -1}, ["rope_scaling.beta_slow", "got -1.0"]),
    ({"beta_fast": 0.5}, ["beta_fast 0.5 must be at least beta_slow 1.0"]),
    ({"original_max_position_embeddings": 0},
     ["rope_scaling.original_max_position_embeddings", "got 0"]),
    ({"factor": "4"}, ["'rope_scaling.factor' must be float, got '4'"]),
    ({"original_max_position_embeddings": 128.5},
     ["'rope_scaling.original_max_position_embeddings' must be int, got 128.5"]),
])
def test_bad_yarn_value_refused(changes, needles):
    """YaRN takes log(original / (beta * 2 pi)) and divides by the factor: each figure
    is typed and positive (a 0 was a ZeroDivisionError / math domain error)."""
    _refused(needles, rope_scaling={**TINY["rope_scaling"], **changes})


def test_index_topk_bounded_by_c4_entries_of_max_position():
    """The indexer picks top-k of at most max_position_embeddings // 4 C4 entries:
    a top-k above that never selects anything and is refused; exactly that is fine;
    with no C4 layer the indexer does not exist and the bound does not apply."""
    entries = TINY["max_position_embeddings"] // 4
    assert _config(index_topk=entries).index_topk == entries
    _refused(["'index_topk'", f"{entries + 1} exceeds the {entries} C4 entries",
              "max_position_embeddings 512"], index_topk=entries + 1)
    no_c4 = _config(index_topk=10 * entries, compress_ratios=[0, 128, 128, 0, 0])
    assert no_c4.index_topk == 10 * entries


# -- the model size bound ----------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("vocab_size", 10**12), ("hidden_size", 10**7),
                                        ("max_position_embeddings", 10**12)])
def test_absurd_model_refused_with_size_in_gib(key, value):
    """A model that cannot be built in this machine's memory is refused before any tensor
    is allocated, with the size in GiB and the key's value (a checkpoint load builds on
    meta and checks the bytes it will place instead: tests/model/test_quant.py)."""
    cfg = dataclasses.replace(_config(), **{key: value})
    need, ram = model_bytes(cfg), physical_memory_bytes()
    assert ram is not None and need > 100 * ram  # absurd on any machine
    with pytest.raises(ConfigError) as info:
        build_models(cfg)
    for needle in (f"needs {need / 2**30:.1f} GiB", f"{ram / 2**30:.1f} GiB of physical memory",
                   f"{key} {value}"):
        assert needle in str(info.value)


@pytest.mark.parametrize("changes", [
    {},
    {"num_hash_layers": 0, "n_shared_experts": 2},
    {"num_hash_layers": 4, "n_shared_experts": 0, "compress_ratios": [4, 4, 4, 4]},
    {"compress_ratios": [128, 0, 4, 128, 0], "index_n_heads": 3, "index_head_dim": 16,
     "max_position_embeddings": 256, "num_experts_per_tok": 3},
])
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # n_shared_experts 0
def test_model_bytes_equals_built_models(changes):
    """The estimate the size bound uses is exact: every parameter and buffer (RoPE
    tables, int64 hash tables) of the built target and draft, byte for byte."""
    cfg = _config(**changes)
    models = build_models(cfg)
    built = sum(t.numel() * t.element_size() for m in (models.target, models.draft)
                for t in [*m.parameters(), *m.buffers()])
    assert model_bytes(cfg) == built


def test_shipped_configs_pass_the_size_bound():
    """The tiny preset and the shipped trained checkpoint load; they are far below it."""
    shipped = load_config(resolve_checkpoint("builtin:tiny-trained"))
    for cfg in (_config(), shipped):
        assert 0 < model_bytes(cfg) < physical_memory_bytes() / 100


# -- prompts -----------------------------------------------------------------------------

def _check(prompt, max_new_tokens=4):
    return validate_prompt(prompt, RequestLimits.of(_config(), 64), max_new_tokens, "request 3")


@pytest.mark.parametrize("prompt, needle", [
    (None, "got NoneType None"), (5, "got int 5"), ("abc", "got str 'abc'"),
    ({5, 6}, "got set {5, 6}"),
])
def test_non_sequence_prompt_refused(prompt, needle):
    """add_request(None) / add_request(5) once raised a TypeError from list()."""
    with pytest.raises(InputError) as info:
        _check(prompt)
    assert str(info.value) == (f"request 3: prompt must be a sequence of token ids (list, "
                               f"tuple, or 1-D integer tensor or array), {needle}")


@pytest.mark.parametrize("prompt", [
    np.array([5, 6, 7]), np.array([5, 6, 7], dtype=np.uint8),
    torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7], dtype=torch.int32),
    [np.int64(5), np.int32(6), 7], [torch.tensor(5), torch.tensor(6, dtype=torch.int16), 7],
    (5, 6, 7), range(5, 8),
])
def test_numpy_and_tensor_prompts_accepted(prompt):
    """Integer arrays, tensors and scalars become a plain list of Python ints."""
    ids = _check(prompt)
    assert ids == [5, 6, 7] and all(type(t) is int for t in ids)


def test_tensor_prompt_decodes_like_list_prompt(tiny):
    """A 1-D integer tensor prompt decodes to the same tokens as the same ids as a list."""
    ids = tiny.tokens(9, seed=3)
    from_tensor = reference_generate(tiny.target, [ids], 3, stop_ids=[]).outputs
    assert from_tensor == reference_generate(tiny.target, [ids.tolist()], 3,
                                             stop_ids=[]).outputs


@pytest.mark.parametrize("prompt, needle", [
    (torch.tensor([5.0, 6.0]), "a prompt tensor must be 1-D with an integer dtype, got 1-D "
                               "torch.float32"),
    (torch.tensor([True, False]), "a prompt tensor must be 1-D with an integer dtype, got 1-D "
                                   "torch.bool"),
    (torch.tensor([[5, 6]]), "a prompt tensor must be 1-D with an integer dtype, got 2-D "
                             "torch.int64"),
    (np.array([5.0, 6.0]), "a prompt array must be 1-D with an integer dtype, got 1-D float64"),
    ([5, 6.0], "token id float 6.0 is not an integer"),
    ([5, None], "token id NoneType None is not an integer"),
    ([5, True], "token id bool True is not an integer"),
    ([5, "6"], "token id str '6' is not an integer"),
    ([5, torch.tensor(6.0)], "token id Tensor tensor(6.) is not an integer"),
    ([5, np.int64(VOCAB)], f"token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    (torch.tensor([5, -2]), f"token id -2 is outside the vocabulary [0, {VOCAB})"),
])
def test_non_integer_token_ids_refused(prompt, needle):
    """Float or bool ids are refused as such, not reported as 'outside the vocabulary'."""
    with pytest.raises(InputError) as info:
        _check(prompt)
    assert str(info.value) == f"request 3: {needle}"


@pytest.mark.parametrize("value, needle", [
    (True, "must be an int of at least 1, got bool True"),
    (2.0, "must be an int of at least 1, got float 2.0"),
    (None, "must be an int of at least 1, got NoneType None"),
    (0, "must be at least 1, got 0"),
    (np.bool_(True), "must be an int of at least 1, got bool np.True_"),
    (np.float64(8), "must be an int of at least 1, got float64 np.float64(8.0)"),
    (torch.tensor(True), "must be an int of at least 1, got Tensor tensor(True)"),
    (torch.tensor(8.0), "must be an int of at least 1, got Tensor tensor(8.)"),
    (torch.tensor([8]), "must be an int of at least 1, got Tensor tensor([8])"),
    (np.int64(0), "must be at least 1, got 0"),
])
def test_bool_max_new_tokens_refused(value, needle):
    """max_new_tokens=True was accepted as 1; it must be an int >= 1."""
    with pytest.raises(InputError) as info:
        _check([5, 6], max_new_tokens=value)
    assert str(info.value) == f"request 3: max_new_tokens {needle}"


@pytest.mark.parametrize("value", [np.int64(3), np.uint8(3), torch.tensor(3),
                                   torch.tensor(3, dtype=torch.int32)])
def test_numpy_and_tensor_max_new_tokens_accepted(tiny, value):
    """max_new_tokens takes the integer scalars a prompt's ids may be (numpy integers,
    0-d integer tensors) as the int they hold, and decodes exactly as with that int."""
    assert validate_max_new_tokens(value, "request 0") == 3
    assert type(validate_max_new_tokens(value, "request 0")) is int
    assert _check([5, 6], max_new_tokens=value) == [5, 6]
    ids = tiny.tokens(5, seed=4).tolist()
    want = reference_generate(tiny.target, [ids], 3, stop_ids=[]).outputs
    assert reference_generate(tiny.target, [ids], value, stop_ids=[]).outputs == want
    assert plain_generate(tiny.target, [ids], value, stop_ids=[]).outputs == want
    assert len(want[0]) == 3


# -- stop ids ----------------------------------------------------------------------------

def test_stop_ids_default_to_eos_and_convert_integers():
    cfg = _config()
    limits = RequestLimits.of(cfg, 64)
    assert validate_stop_ids(None, limits, "request 0") == frozenset({cfg.eos_token_id})
    assert validate_stop_ids([], limits, "request 0") == frozenset()
    stops = validate_stop_ids((np.int64(3), torch.tensor(4), 5, 5), limits, "request 0")
    assert stops == frozenset({3, 4, 5}) and all(type(t) is int for t in stops)


@pytest.mark.parametrize("stop_ids, needle", [
    ([1, None], "stop token id NoneType None is not an integer"),
    ([True], "stop token id bool True is not an integer"),
    ({2.5}, "stop token id float 2.5 is not an integer"),
    ([VOCAB], f"stop token id {VOCAB} is outside the vocabulary [0, {VOCAB})"),
    ((-1,), f"stop token id -1 is outside the vocabulary [0, {VOCAB})"),
    (7, "stop_ids must be a list, tuple, set or frozenset of token ids, got int 7"),
    ("7", "stop_ids must be a list, tuple, set or frozenset of token ids, got str '7'"),
])
def test_bad_stop_ids_refused_naming_request_and_element(stop_ids, needle):
    with pytest.raises(InputError) as info:
        validate_stop_ids(stop_ids, RequestLimits.of(_config(), 64), "request 7")
    assert str(info.value) == f"request 7: {needle}"


def test_generate_checks_stop_ids_and_max_context(tiny):
    """reference_generate names itself for bad stop ids or a bad max_context."""
    with pytest.raises(InputError, match=r"^reference_generate: stop token id NoneType None"):
        reference_generate(tiny.target, [[5, 6]], 2, stop_ids=[1, None])
    with pytest.raises(InputError, match=r"^reference_generate: max_context must be an int "
                                         r"of at least 1, got int 0$"):
        reference_generate(tiny.target, [[5, 6]], 2, max_context=0)
