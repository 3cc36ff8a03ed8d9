"""The ``nextn-graph`` command line: generate, make-checkpoint, demo, and bad input.

``main`` runs in-process (fast); one test goes through ``python -m nextn_graph``
to prove the module entry point works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nextn_graph.cli.commands import build_parser, main, make_checkpoint
from nextn_graph.errors import InputError

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("cli_ckpt"), seed=0)


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (n,), generator=gen).tolist()


def _jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _generate(ckpt: Path, prompts: Path, *extra: str) -> list[str]:
    return ["generate", "--checkpoint", str(ckpt), "--prompts", str(prompts), *extra]


def test_generate_plain_equals_reference(ckpt, tmp_path, capsys):
    """generate --mode plain, reference and spec print the same output_ids for every request."""
    prompts = [_prompt(n, seed) for seed, n in enumerate([3, 20, 45])]
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": p} for p in prompts])
    runs = {}
    for mode in ("plain", "reference", "spec"):
        rc = main(_generate(ckpt, path, "--max-new-tokens", "12", "--mode", mode, "--json"))
        out = capsys.readouterr()
        assert rc == 0, out.err
        runs[mode] = json.loads(out.out)
    for mode, res in runs.items():
        assert [r["input_ids"] for r in res["requests"]] == prompts
        assert all(1 <= len(r["output_ids"]) <= 12 for r in res["requests"])
        assert res["stats"]["mode"] == mode
    ref = [r["output_ids"] for r in runs["reference"]["requests"]]
    assert [r["output_ids"] for r in runs["plain"]["requests"]] == ref
    assert [r["output_ids"] for r in runs["spec"]["requests"]] == ref
    assert any(len(o) == 12 for o in ref)  # not all cut short by eos


def test_generate_text_output(ckpt, tmp_path, capsys):
    """Without --json, generate prints one 'request i: [...]' line per request, then the stats."""
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7]}, "", {"input_ids": [8, 9]}])
    assert main(_generate(ckpt, path, "--max-new-tokens", "3", "--mode", "plain")) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3  # the blank line was skipped: two requests + stats
    assert [line.split(":")[0] for line in lines[:2]] == ["request 0", "request 1"]
    assert json.loads(lines[2])["mode"] == "plain"


def _bad(argv: list[str], capsys, *needles: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nextn-graph: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]


MODES = ["spec", "plain", "reference"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lines, needles", [
    ([{"input_ids": [5, 6]}, "{not json"], [":2:", "malformed JSON"]),
    ([{"input_ids": [5, 6]}, {"prompt": "hi"}], [":2:", "input_ids"]),
    ([{"input_ids": [5, 6]}, {"input_ids": [5, "6"]}], [":2:", "input_ids"]),
    ([{"input_ids": [5, 6]}, {"input_ids": []}], ["empty prompt"]),
    ([{"input_ids": [5, 999, 6]}], ["999", "outside the vocabulary"]),
    ([], ["no prompts"]),
    (['{"input_ids": [5, 6], "input_ids": [7, 8]}'], [":1:", "duplicate key 'input_ids'"]),
    ([{"input_ids": [5, 6]}, {"input_ids": [5], "max_new_tokens": 9}],
     [":2:", "unknown key 'max_new_tokens'"]),
    ([{"input_ids": [5], "stop_ids": [3]}], [":1:", "unknown key 'stop_ids'"]),
    ([{"input_ids": [5, 6]}, "[" * 100_000 + "]" * 100_000], [":2:", "nested too deeply"]),
], ids=["malformed", "no_input_ids", "non_int_id", "empty", "out_of_vocab", "no_prompts",
        "duplicate_key", "unknown_key", "stop_ids_key", "deep_nesting"])
def test_generate_bad_prompts_file(ckpt, tmp_path, capsys, lines, needles, mode):
    """A bad prompts file exits 2 with one stderr line naming the problem, no traceback."""
    path = _jsonl(tmp_path / "p.jsonl", lines)
    _bad(_generate(ckpt, path, "--max-new-tokens", "4", "--mode", mode), capsys, *needles)


def test_generate_bad_prompt_names_request(ckpt, tmp_path, capsys):
    """The error for a bad prompt names the request by its index in the file."""
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": [5, 6]}, {"input_ids": []}])
    _bad(_generate(ckpt, path, "--max-new-tokens", "4", "--mode", "plain"), capsys,
         "request 1: empty prompt")


@pytest.mark.parametrize("mode", MODES)
def test_generate_prompt_longer_than_context(ckpt, tmp_path, capsys, mode):
    """A 40-token prompt with --max-context 32 exits 2 naming the prompt length."""
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": _prompt(40, 1)}])
    msg = _bad(_generate(ckpt, path, "--max-new-tokens", "4", "--max-context", "32",
                         "--mode", mode), capsys, "40 tokens", "maximum context")
    if mode != "spec":  # spec reports the context less its verify lookahead
        assert "maximum context 32" in msg


def test_generate_missing_prompts_file(ckpt, tmp_path, capsys):
    """A prompts path that does not exist exits 2 naming the path."""
    path = tmp_path / "absent.jsonl"
    _bad(_generate(ckpt, path, "--max-new-tokens", "4"), capsys, str(path), "not found")


def test_generate_missing_checkpoint(tmp_path, capsys):
    """A checkpoint dir that does not exist exits 2 naming the dir."""
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": [5, 6]}])
    root = tmp_path / "no_ckpt"
    _bad(_generate(root, path, "--max-new-tokens", "4"), capsys, str(root), "not found")


def test_make_checkpoint_command(tmp_path, capsys):
    """make-checkpoint --seed 3 writes config.json + model.safetensors and prints the dir."""
    out = tmp_path / "seed3"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
    tensors = load_file(str(out / "model.safetensors"))
    assert "embed.weight" in tensors and "mtp.0.e_proj.weight" in tensors
    again = load_file(str(make_checkpoint("tiny", tmp_path / "again", seed=3) / "model.safetensors"))
    assert torch.equal(again["embed.weight"], tensors["embed.weight"])


@pytest.mark.parametrize("value", ["-1", str(2**63), "99999999999999999999999", "x"])
def test_make_checkpoint_seed_out_of_range_refused(tmp_path, capsys, value):
    """--seed outside [0, 2**63) (what a torch generator takes) is refused by argparse
    before any work, not a ValueError overflow from inside torch."""
    with pytest.raises(SystemExit) as exc:
        main(["make-checkpoint", "--out", str(tmp_path / "c"), "--seed", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --seed: expected an integer in [0, 2**63), got {value!r}" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", [-1, 2**63, True, 1.0])
def test_make_checkpoint_api_refuses_bad_seed(tmp_path, seed):
    with pytest.raises(InputError, match=r"seed must be an integer in \[0, 2\*\*63\), got "):
        make_checkpoint("tiny", tmp_path / "c", seed=seed)
    assert list(tmp_path.iterdir()) == []


def test_make_checkpoint_largest_seed_parses():
    args = build_parser().parse_args(["make-checkpoint", "--out", "c", "--seed", str(2**63 - 1)])
    assert args.seed == 2**63 - 1


def test_make_checkpoint_under_a_file_is_one_line(tmp_path, capsys):
    """--out AFILE/sub with AFILE a regular file: exit 2, one line naming both paths."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "sub"
    _bad(["make-checkpoint", "--out", str(out)], capsys,
         f"{out}: cannot create it, {tmp_path / 'afile'} is not a directory")


@pytest.fixture
def restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("extra, want", [([], 1), (["--threads", "3"], 3)])
def test_generate_pins_torch_threads(ckpt, tmp_path, capsys, restore_threads, extra, want):
    """generate sets torch's intra-op threads before any work, like bench: default 1
    (on a shared 2-core box the default thread count made a tiny run 35x slower)."""
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7]}])
    torch.set_num_threads(2)
    assert main(_generate(ckpt, path, "--max-new-tokens", "2", "--mode", "plain", *extra)) == 0
    capsys.readouterr()
    assert torch.get_num_threads() == want


@pytest.mark.parametrize("command", [["bench"], ["demo"],
                                     ["generate", "--prompts", "p", "--max-new-tokens", "1"]])
def test_threads_option_shared_by_subcommands(capsys, command):
    """bench, demo and generate all take --threads (default 1) and refuse 0 in argparse."""
    assert build_parser().parse_args(command).threads == 1
    assert build_parser().parse_args([*command, "--threads", "4"]).threads == 4
    with pytest.raises(SystemExit) as exc:
        main([*command, "--threads", "0"])
    assert exc.value.code == 2
    assert "argument --threads: expected a positive integer, got '0'" in capsys.readouterr().err


def test_demo_plain_equals_reference(ckpt, capsys, restore_threads):
    """The demo prints 'plain == reference token for token: True' and returns 0, with
    torch pinned to its --threads default of 1 whatever it was before."""
    torch.set_num_threads(2)
    rc = main(["demo", "--checkpoint", str(ckpt), "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert rc == 0
    assert torch.get_num_threads() == 1
    assert "plain == reference token for token: True" in out
    assert f"checkpoint: {ckpt}" in out
    modes = [line.split()[0] for line in out.splitlines() if line.split()]
    assert "plain" in modes and "reference" in modes


def test_no_arguments_runs_the_bench(monkeypatch):
    """`nextn-graph` with no arguments runs the bench (the main job) with its defaults."""
    import nextn_graph.cli.commands as cli

    seen = []
    monkeypatch.setattr(cli, "_bench", lambda args, cfg, group: seen.append(args) or 0)
    assert main([]) == 0
    assert len(seen) == 1
    assert vars(seen[0]) == vars(cli.build_parser().parse_args(["bench"]))
    assert seen[0].command == "bench" and seen[0].config is None


@pytest.mark.process
def test_module_entry_point(ckpt, tmp_path):
    """`python -m nextn_graph` runs generate end to end and maps a library error to exit 2."""
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": [5, 6, 7, 8]}])
    proc = subprocess.run(
        [sys.executable, "-m", "nextn_graph", *_generate(ckpt, path, "--max-new-tokens", "3"),
         "--json"], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["requests"][0]["input_ids"] == [5, 6, 7, 8]
    assert 1 <= len(res["requests"][0]["output_ids"]) <= 3

    proc = subprocess.run(
        [sys.executable, "-m", "nextn_graph",
         *_generate(tmp_path / "no_ckpt", path, "--max-new-tokens", "2")],
        cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "checkpoint directory not found" in proc.stderr


@pytest.mark.process
def test_embedding_example_runs():
    """examples/serve.py, the README's embedding example, runs to completion."""
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "serve.py")], cwd=REPO,
                          env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    done = [line for line in proc.stdout.splitlines() if " done: " in line]
    assert len(done) == 3


def test_kernels_option(ckpt, tmp_path, capsys, monkeypatch):
    """``--kernels`` on generate, bench, serve and profile; the reference runs; triton on a
    CPU without Triton's interpreter is one line naming what to set."""
    path = _jsonl(tmp_path / "p.jsonl", [{"input_ids": _prompt(5, 1)}])
    rc = main(_generate(ckpt, path, "--max-new-tokens", "3", "--kernels", "reference", "--json"))
    assert rc == 0 and json.loads(capsys.readouterr().out)["requests"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _bad(_generate(ckpt, path, "--max-new-tokens", "3", "--kernels", "triton"), capsys,
         "kernels 'triton'", "TRITON_INTERPRET=1")
    parser = build_parser()
    for command in (["bench"], ["serve"], ["profile", "--preset", "tiny"],
                    _generate(ckpt, path, "--max-new-tokens", "3")):
        assert parser.parse_args([*command, "--kernels", "triton"]).kernels == "triton"
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--kernels", "fastest"])
    assert parser.parse_args(["profile", "--preset", "tiny"]).kernels == "auto"
