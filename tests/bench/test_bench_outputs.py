"""Bench outputs and CLI failure paths: bad output paths fail before any measurement,
the output files land as one set (old set or new set, no temporaries left behind),
Ctrl-C ends every command with one line and exit 130, bad counts are refused by
argparse, and unreadable prompts files are named errors.

One real small bench run (module fixture) gives a report to write; the CLI tests
that reach the measurement use the same small settings as ``test_bench_cli``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal

import pytest

import nextn_graph.bench.files as files_mod
import nextn_graph.bench.run as run_mod
import nextn_graph.cli.commands as cli
from nextn_graph.bench import BenchSettings, run_bench
from nextn_graph.bench.files import _sigint_deferred
from nextn_graph.bench.report import PLOTS, check_outputs, write_outputs
from nextn_graph.cli import main
from nextn_graph.config import load_run_config
from nextn_graph.errors import ConfigError, InputError

NAMES = (*PLOTS, "bench.md", "bench.json")
SMALL_YAML = "pool: {max_requests: 1, max_context: 128}\ngraph: {buckets: [1]}\n"


@pytest.fixture(scope="module")
def small_report(tmp_path_factory) -> dict:
    cfg = load_run_config(None, pool={"max_requests": 1, "max_context": 128},
                          graph={"buckets": [1]})
    st = BenchSettings(warmup_rounds=1, timed_rounds=2, repeats=1)
    return run_bench(cfg, "test", st, tmp_path_factory.mktemp("small"), progress=False)


def _bench_argv(tmp_path, *extra: str) -> list[str]:
    cfg = tmp_path / "small.yaml"
    cfg.write_text(SMALL_YAML)
    return ["bench", "--config", str(cfg), "--rounds", "2", "--warmup-rounds", "1",
            "--repeats", "1", "--quiet", *extra]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _old_set(out, json_path=None) -> dict:
    """Sentinel files where the bench writes: the 'previous run' that must survive."""
    out.mkdir(parents=True, exist_ok=True)
    files = {out / n: f"old {n}".encode() for n in NAMES}
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        files[json_path] = b"old json"
    for path, data in files.items():
        path.write_bytes(data)
    return files


def _temporaries(root) -> list:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def _no_measurement(monkeypatch):
    def boom(*args, **kwargs):
        pytest.fail("the bench started loading/measuring despite a bad output path")
    monkeypatch.setattr(run_mod, "load_on_ranks", boom)
    monkeypatch.setattr(run_mod, "build_engines", boom)


@pytest.mark.parametrize("case", ["json_is_dir", "json_parent_is_file", "out_is_file",
                                  "out_under_file", "json_is_another_output"])
def test_bad_json_path_fails_before_measuring(tmp_path, capsys, monkeypatch, case):
    """A bad --out / --json exits 2 with one line naming the path, before the checkpoint
    is loaded or an engine built, and writes nothing."""
    _no_measurement(monkeypatch)
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("x")
    out, json_path, needle = {
        "json_is_dir": ("o", "a_dir", "a_dir: is a directory"),
        "json_parent_is_file": ("o", "a_file/r.json", "a_file is not a directory"),
        "out_is_file": ("a_file", None, "a_file is not a directory"),
        "out_under_file": ("a_file/o", None, "cannot create"),
        "json_is_another_output": ("o", "o/bench.md", "would overwrite"),
    }[case]
    extra = ["--out", str(tmp_path / out)]
    if json_path:
        extra += ["--json", str(tmp_path / json_path)]
    argv = _bench_argv(tmp_path, *extra)
    before = sorted(tmp_path.rglob("*"))
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith("nextn-graph: error: ") and needle in line, line
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


def test_output_dir_that_can_be_created_passes_the_check(tmp_path):
    """A missing --out and a missing --json parent are fine (created at write time), and
    the check itself creates nothing."""
    check_outputs(tmp_path / "new" / "out", tmp_path / "other" / "r.json")
    assert list(tmp_path.iterdir()) == []


def test_interrupted_bench_leaves_no_half_written_outputs(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the first output file is written: exit 130 with one line, the old
    set of files untouched, and no temporary file left in either destination dir."""
    out, json_path = tmp_path / "o", tmp_path / "j" / "r.json"
    old = _old_set(out, json_path)
    real_write, written = files_mod._write_temp, []

    def interrupted_write(dest, data):
        if written:
            raise KeyboardInterrupt
        written.append(real_write(dest, data))
        return written[-1]

    monkeypatch.setattr(files_mod, "_write_temp", interrupted_write)
    rc = main(_bench_argv(tmp_path, "--out", str(out), "--json", str(json_path)))
    assert rc == 130
    assert _one_error_line(capsys) == "nextn-graph: interrupted"
    assert len(written) == 1  # the interrupt came mid-set, after a complete temporary
    assert {p: p.read_bytes() for p in old} == old
    assert _temporaries(tmp_path) == []


def test_completed_write_replaces_the_whole_set(small_report, tmp_path):
    """A finished write replaces every old file, leaves no temporaries, and creates the
    files with the usual 0o666-less-umask mode (not a temp file's 0o600)."""
    out = tmp_path / "o"
    old = _old_set(out)
    write_outputs(copy.deepcopy(small_report), out, None)
    assert all(p.read_bytes() != data for p, data in old.items())
    assert json.loads((out / "bench.json").read_text())["buckets"][0]["bucket"] == 1
    assert (out / "round_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _temporaries(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    assert all((out / n).stat().st_mode & 0o777 == 0o666 & ~umask for n in NAMES)


def test_failed_write_keeps_the_old_set(small_report, tmp_path, monkeypatch):
    """An OSError (say, a full disk) on the third file is a named error; the old set is
    untouched and the two finished temporaries are removed."""
    out = tmp_path / "o"
    old = _old_set(out)
    real_write, calls = files_mod._write_temp, []

    def full_disk(dest, data):
        calls.append(dest)
        if len(calls) == 3:
            raise OSError(28, "No space left on device", str(dest))
        return real_write(dest, data)

    monkeypatch.setattr(files_mod, "_write_temp", full_disk)
    with pytest.raises(InputError, match=f"cannot write {out / PLOTS[2]}: No space left"):
        write_outputs(copy.deepcopy(small_report), out, None)
    assert {p: p.read_bytes() for p in old} == old
    assert _temporaries(tmp_path) == []


def test_ctrl_c_is_held_until_the_renames_are_done():
    """A SIGINT that arrives while the staged files are being renamed is raised only
    after the block, so it cannot split the set."""
    reached_end = False
    # Python's own handler, whatever this process inherited (a shell starts background
    # jobs with SIGINT ignored, and Python then installs none)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with _sigint_deferred():
                signal.raise_signal(signal.SIGINT)
                reached_end = True
        assert reached_end
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


@pytest.mark.parametrize("command, argv", [
    ("_bench", ["bench"]),
    ("run_generate", ["generate", "--checkpoint", "builtin:tiny-trained", "--prompts", "p.jsonl",
                   "--max-new-tokens", "2"]),
    ("_demo", ["demo"]),
    ("make_checkpoint", ["make-checkpoint", "--out", "ckpt"]),
])
def test_ctrl_c_in_any_command_exits_130_with_one_line(capsys, monkeypatch, command, argv):
    """KeyboardInterrupt from inside any command: 'nextn-graph: interrupted', exit 130."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, command, interrupted)
    assert main(argv) == 130
    assert _one_error_line(capsys) == "nextn-graph: interrupted"


@pytest.mark.parametrize("option, value", [
    ("--rounds", "0"), ("--repeats", "0"), ("--threads", "0"), ("--rounds", "-3"),
    ("--repeats", "-1"), ("--threads", "-2"), ("--rounds", "two"), ("--warmup-rounds", "-1"),
])
def test_nonpositive_rounds_refused(capsys, monkeypatch, option, value):
    """Zero or negative counts are refused by argparse (exit 2, the option named) before
    the bench starts."""
    monkeypatch.setattr(cli, "_bench", lambda args: pytest.fail("the bench ran"))
    with pytest.raises(SystemExit) as exc:
        main(["bench", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: expected" in err and repr(value) in err
    assert "Traceback" not in err


@pytest.mark.parametrize("field", ["timed_rounds", "repeats"])
def test_bench_settings_refuse_zero(field):
    """The library refuses the same counts, for callers that bypass the CLI."""
    with pytest.raises(ConfigError, match=field):
        BenchSettings(**{field: 0})


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), "hot", True])
def test_bad_bench_temperature_is_a_config_error(tmp_path, value):
    """bench.temperature: a finite number >= 0 (a whole number reads as one), else a
    ConfigError naming the file and the key."""
    cfg = tmp_path / "t.yaml"
    cfg.write_text(SMALL_YAML + f"bench: {{temperature: {json.dumps(value)}}}\n"
                   .replace("NaN", ".nan").replace("Infinity", ".inf"))
    with pytest.raises(ConfigError, match=re.escape(f"{cfg}: key 'bench.temperature' must be")):
        load_run_config(cfg)
    assert load_run_config(None, bench={"temperature": 1}).bench.temperature == 1.0


def test_sampling_bench_on_greedy_only_engines_fails_before_measuring(tmp_path, monkeypatch):
    """bench.temperature > 0 needs engines that can sample: with graph.sampling false the
    bench refuses, naming both keys, before loading anything; at 0 it is let through."""
    _no_measurement(monkeypatch)
    cfg = load_run_config(None, graph={"sampling": False})
    with pytest.raises(ConfigError, match="'bench.temperature' 0.8 samples.*graph.sampling"):
        run_bench(cfg, "test", BenchSettings(), tmp_path / "o", progress=False)
    off = load_run_config(None, graph={"sampling": False}, bench={"temperature": 0})
    with pytest.raises(pytest.fail.Exception, match="started loading"):
        run_bench(off, "test", BenchSettings(), tmp_path / "o", progress=False)


def _generate_argv(prompts) -> list[str]:
    return ["generate", "--checkpoint", "builtin:tiny-trained", "--prompts", str(prompts),
            "--max-new-tokens", "2", "--mode", "plain"]


def test_non_utf8_prompts_file_is_named_error(tmp_path, capsys):
    """A prompts file with a non-UTF-8 byte exits 2 with one line naming the file, the
    line and the byte offset."""
    path = tmp_path / "latin1.jsonl"
    good = b'{"input_ids": [5, 6]}\n'
    path.write_bytes(good + b'{"input_ids": [7]} \xe9\n')
    assert main(_generate_argv(path)) == 2
    line = _one_error_line(capsys)
    offset = len(good) + len(b'{"input_ids": [7]} ')
    assert line == (f"nextn-graph: error: {path}:2: not UTF-8 text "
                    f"(byte 0xe9 at byte offset {offset})")


@pytest.mark.parametrize("kind, needle", [("missing", "prompts file not found"),
                                          ("directory", "is a directory")])
def test_unreadable_prompts_path_is_named_error(tmp_path, capsys, kind, needle):
    """A missing prompts file, or a directory given as one, exits 2 naming the path."""
    path = tmp_path / "prompts"
    if kind == "directory":
        path.mkdir()
    assert main(_generate_argv(path)) == 2
    line = _one_error_line(capsys)
    assert str(path) in line and needle in line, line
