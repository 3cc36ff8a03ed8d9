"""Per-request sampling from the outside: sampling keys on JSONL prompt lines, and
``generate``'s ``--temperature``, ``--top-p``, ``--top-k`` and ``--seed``.

Runs ``main`` in-process on the random ``tiny`` checkpoint (its flat distributions make
sampled tokens differ from greedy ones) in plain and reference mode, which take a few
tenths of a second; one test runs spec mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nextn_graph.checkpoint import load_checkpoint
from nextn_graph.cli.commands import main, make_checkpoint
from nextn_graph.errors import InputError
from nextn_graph.runtime.generate import reference_generate
from nextn_graph.cli.prompts import read_prompts
from nextn_graph.sampling import KEYS, SEED_LIMIT, request_seed

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [9, 200, 31, 17, 3]]
NEW = "12"  # tokens per request: enough that two seeds all but surely differ


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("sampling_ckpt"), seed=0)


def _jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _ids_file(tmp_path: Path, *extra: dict) -> Path:
    """PROMPTS as input_ids lines; ``extra[i]`` adds keys to line i."""
    rows = [{"input_ids": p} for p in PROMPTS]
    for row, keys in zip(rows, extra):
        row.update(keys)
    return _jsonl(tmp_path / "p.jsonl", rows)


def _run(ckpt: Path, prompts: Path, capsys, *extra: str) -> list[dict]:
    """generate --json -> its requests."""
    rc = main(["generate", "--checkpoint", str(ckpt), "--prompts", str(prompts),
               "--max-new-tokens", NEW, "--json", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)["requests"]


def _outputs(requests: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in requests]


# -- prompt lines ---------------------------------------------------------------------------

def test_line_sampling_keys_are_parsed(tmp_path):
    """Each line keeps the sampling keys it gave, checked and in the library's types;
    a line without any has none."""
    path = _jsonl(tmp_path / "p.jsonl", [
        {"input_ids": [5, 6], "temperature": 1, "top_p": 0.9, "top_k": 20, "seed": 7,
         "min_p": 0.1, "presence_penalty": 1, "frequency_penalty": -0.5,
         "repetition_penalty": 1.2, "logit_bias": {"9": 2, "3": -1}, "min_tokens": 2},
        {"text": "hi", "temperature": 0.5},
        {"input_ids": [7]},
        {"seed": None, "input_ids": [8]},
    ])
    prompts = read_prompts(path)
    assert [p.value for p in prompts] == [[5, 6], "hi", [7], [8]]
    assert prompts[0].sampling == {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "seed": 7,
                                   "min_p": 0.1, "presence_penalty": 1.0,
                                   "frequency_penalty": -0.5, "repetition_penalty": 1.2,
                                   "logit_bias": ((3, -1.0), (9, 2.0)), "min_tokens": 2}
    assert isinstance(prompts[0].sampling["temperature"], float)
    assert prompts[1].sampling == {"temperature": 0.5}
    assert prompts[2].sampling == {}
    assert prompts[3].sampling == {"seed": None}  # explicit null: a fresh seed
    assert set(prompts[0].sampling) == set(KEYS)


@pytest.mark.parametrize("keys, message", [
    ({"top_p": 1.5}, "top_p must lie in (0, 1], got 1.5"),
    ({"top_p": 0}, "top_p must lie in (0, 1], got 0"),
    ({"temperature": -0.5}, "temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
    ({"temperature": "hot"}, "temperature must be a finite number >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer >= 0 (0 = off), got 2.5"),
    ({"top_k": True}, "top_k must be an integer >= 0"),
    ({"seed": -1}, "seed must be an integer in [0, 2**63) or None, got -1"),
    ({"seed": SEED_LIMIT}, "seed must be an integer in [0, 2**63)"),
], ids=["top_p_high", "top_p_zero", "negative_temperature", "string_temperature",
        "float_top_k", "bool_top_k", "negative_seed", "seed_too_big"])
def test_bad_line_value_names_file_line_and_key(tmp_path, keys, message):
    path = _ids_file(tmp_path, {}, {}, keys)
    with pytest.raises(InputError) as exc:
        read_prompts(path)
    assert str(exc.value).startswith(f"{path}:3: {message}")


@pytest.mark.parametrize("keys, key", [
    ({"max_new_tokens": 9}, "max_new_tokens"),
    ({"stop_ids": [3]}, "stop_ids"),
    ({"temp": 0.8}, "temp"),  # a misspelt sampling key is not silently greedy
    ({"topP": 0.9}, "topP"),
])
def test_other_keys_still_refused(tmp_path, keys, key):
    path = _ids_file(tmp_path, {}, keys)
    with pytest.raises(InputError) as exc:
        read_prompts(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:2: unknown key {key!r}")
    assert "temperature, top_p, top_k, seed" in msg and "command options" in msg


@pytest.mark.parametrize("row, needle", [
    ({"temperature": 0.8}, 'expected {"input_ids": [int, ...]} or {"text": "..."}'),
    ({"input_ids": [5], "text": "hi", "seed": 1}, ", not both"),
], ids=["sampling_only", "both_prompt_keys"])
def test_exactly_one_prompt_key(tmp_path, row, needle):
    """Sampling keys do not count as the prompt: a line still needs exactly one of
    input_ids and text."""
    path = _jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(InputError, match=r":1: expected ") as exc:
        read_prompts(path)
    assert needle in str(exc.value)


def test_bad_line_value_is_one_line_exit_2(ckpt, tmp_path, capsys):
    """Through the command: exit 2, one stderr line naming FILE:LINE and the key."""
    path = _ids_file(tmp_path, {}, {"top_p": 1.5})
    assert main(["generate", "--checkpoint", str(ckpt), "--prompts", str(path),
                 "--max-new-tokens", "2", "--mode", "plain"]) == 2
    err = capsys.readouterr().err
    assert err == f"nextn-graph: error: {path}:2: top_p must lie in (0, 1], got 1.5\n"


# -- command options ------------------------------------------------------------------------

@pytest.mark.parametrize("option, value, message", [
    ("--top-p", "0", "top_p must lie in (0, 1], got 0.0"),
    ("--top-p", "1.01", "top_p must lie in (0, 1], got 1.01"),
    ("--temperature", "-1", "temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    ("--temperature", "nan", "temperature must be a finite number >= 0"),
    ("--temperature", "warm", "expected a number, got 'warm'"),
    ("--top-k", "-1", "top_k must be an integer >= 0 (0 = off), got -1"),
    ("--top-k", "1.5", "expected an integer, got '1.5'"),
    ("--seed", str(SEED_LIMIT), "seed must be an integer in [0, 2**63) or None"),
])
def test_bad_option_refused_before_any_work(tmp_path, capsys, option, value, message):
    """A bad sampling option exits 2 from argparse, naming the option and the range,
    before the checkpoint (which does not exist here) is touched."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--checkpoint", str(tmp_path / "absent"), "--prompt", "hi",
              "--max-new-tokens", "2", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {message}" in err and "Traceback" not in err


def test_greedy_default_unchanged(ckpt, tmp_path, capsys):
    """No sampling options or keys: the library's greedy tokens, and no "sampling" in the
    JSON; --temperature 0 (greedy, whatever the seed) is the same run."""
    path = _ids_file(tmp_path)
    want = reference_generate(load_checkpoint(ckpt).target, PROMPTS, int(NEW)).outputs
    for extra in ([], ["--temperature", "0", "--seed", "3"]):
        for mode in ("plain", "reference"):
            reqs = _run(ckpt, path, capsys, "--mode", mode, *extra)
            assert _outputs(reqs) == want
            assert all(set(r) == {"input_ids", "output_ids"} for r in reqs)


def test_seeded_runs_repeat_and_differ_by_seed(ckpt, tmp_path, capsys):
    """--temperature 0.8 --seed 5 twice: the same tokens; --seed 6 differs, and both
    sample (differ from greedy)."""
    path = _ids_file(tmp_path)
    first = _outputs(_run(ckpt, path, capsys, "--mode", "plain", "--temperature", "0.8",
                          "--seed", "5"))
    again = _outputs(_run(ckpt, path, capsys, "--mode", "plain", "--temperature", "0.8",
                          "--seed", "5"))
    other = _outputs(_run(ckpt, path, capsys, "--mode", "plain", "--temperature", "0.8",
                          "--seed", "6"))
    greedy = _outputs(_run(ckpt, path, capsys, "--mode", "plain"))
    assert first == again
    assert all(a != b for a, b in zip(first, other))
    assert all(a != g for a, g in zip(first, greedy))


def test_plain_equals_reference_when_sampling(ckpt, tmp_path, capsys):
    """Plain and reference decoding draw the same keyed uniforms: token for token equal,
    top-p and top-k included, and a line's own settings too."""
    path = _ids_file(tmp_path, {}, {"top_k": 3, "seed": 11}, {"temperature": 1.5})
    opts = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "5"]
    plain = _run(ckpt, path, capsys, "--mode", "plain", *opts)
    reference = _run(ckpt, path, capsys, "--mode", "reference", *opts)
    assert _outputs(plain) == _outputs(reference)
    assert [r["sampling"] for r in plain] == [
        {"temperature": 0.8, "top_p": 0.9, "top_k": 0, "seed": request_seed(5, 0)},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 3, "seed": 11},
        {"temperature": 1.5, "top_p": 0.9, "top_k": 0, "seed": request_seed(5, 2)},
    ]


def test_line_seed_overrides_option(ckpt, tmp_path, capsys):
    """--seed seeds the run: each request gets its own seed from it (never the same one,
    so requests of a run are not correlated); a line's own seed is used as given."""
    sampled = ["--mode", "plain", "--temperature", "0.8"]
    five = _run(ckpt, _ids_file(tmp_path), capsys, *sampled, "--seed", "5")
    assert len({r["sampling"]["seed"] for r in five}) == 3
    assert [r["sampling"]["seed"] for r in five] == [request_seed(5, i) for i in range(3)]
    alone = _outputs(_run(ckpt, _ids_file(tmp_path, {}, {"seed": 6}), capsys, *sampled))
    mixed = _outputs(_run(ckpt, _ids_file(tmp_path, {}, {"seed": 6}), capsys, *sampled,
                          "--seed", "5"))
    assert mixed == [_outputs(five)[0], alone[1], _outputs(five)[2]]
    assert _outputs(five)[1] != alone[1]


def test_json_shows_the_sampling_used(ckpt, tmp_path, capsys):
    """Only a sampled request carries "sampling", with the seed drawn for it; that seed
    given back reproduces its tokens."""
    path = _ids_file(tmp_path, {"temperature": 0.8})
    reqs = _run(ckpt, path, capsys, "--mode", "plain")
    assert "sampling" not in reqs[1] and "sampling" not in reqs[2]
    used = reqs[0]["sampling"]
    assert set(used) == {"temperature", "top_p", "top_k", "seed"}  # (the others are off)
    assert used["temperature"] == 0.8 and used["top_p"] == 1.0 and used["top_k"] == 0
    assert isinstance(used["seed"], int) and 0 <= used["seed"] < SEED_LIMIT
    again = _run(ckpt, _ids_file(tmp_path, used), capsys, "--mode", "reference")
    assert again[0]["output_ids"] == reqs[0]["output_ids"]
    assert _outputs(again)[1:] == _outputs(reqs)[1:]


def test_spec_mode_samples_the_same_in_graphs_and_eagerly(ckpt, tmp_path, capsys):
    """Spec mode takes the per-request sampling: its cpu graphs and eager rounds give the
    same seeded tokens, which are not the greedy ones, and report it in the JSON."""
    path = _ids_file(tmp_path, {}, {"seed": 6})
    opts = ["--mode", "spec", "--temperature", "0.8", "--seed", "5"]
    graphs = _run(ckpt, path, capsys, *opts)
    eager = _run(ckpt, path, capsys, *opts, "--backend", "eager")
    greedy = _run(ckpt, path, capsys, "--mode", "spec", "--backend", "eager")
    assert _outputs(graphs) == _outputs(eager)
    assert all(s != g for s, g in zip(_outputs(eager), _outputs(greedy)))
    assert [r["sampling"]["seed"] for r in graphs] == [request_seed(5, 0), 6,
                                                        request_seed(5, 2)]


def test_greedy_only_config_refuses_a_sampled_request_before_capture(ckpt, tmp_path, capsys,
                                                                      monkeypatch):
    """graph.sampling false: a sampled line is named before any engine is built."""
    import nextn_graph.cli.generate as command
    config = tmp_path / "greedy.yaml"
    config.write_text("graph:\n  backend: eager\n  sampling: false\n")
    monkeypatch.setattr(command, "SpecEngine", None)  # building one would raise a TypeError
    rc = main(["generate", "--checkpoint", str(ckpt), "--config", str(config), "--prompts",
               str(_ids_file(tmp_path, {}, {"temperature": 0.5})), "--max-new-tokens", NEW])
    err = capsys.readouterr().err
    assert rc == 2 and "p.jsonl:2: the request samples, but the config sets graph.sampling: " \
                       "false" in err
