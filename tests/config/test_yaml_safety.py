"""The run-config YAML loader refuses what could blow up or silently mislead.

Anchors/aliases are refused while composing (an alias bomb is never expanded),
duplicate and merge keys are refused with file and line, and rejected values
are cut short in messages so an error line never grows with the input.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from nextn_graph.config import load_run_config
from nextn_graph.errors import ConfigError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def _refused(path: Path, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    return msg


def _bomb(levels: int) -> str:
    """Each level is a list of 9 aliases of the one above: 9**levels leaves once expanded."""
    lines = ['l0: &l0 ["xxxxxxxx","xxxxxxxx","xxxxxxxx","xxxxxxxx","xxxxxxxx"]']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines + [f"dtype: *l{levels}"]) + "\n"


def test_yaml_alias_bomb_is_refused_without_expanding(tmp_path):
    """A ~600-byte file that would expand to ~10**10 strings is refused at the first anchor,
    naming file and line, with a short message and almost no memory."""
    path = _write(tmp_path, _bomb(10))
    assert len(path.read_bytes()) < 700
    tracemalloc.start()
    try:
        msg = _refused(path, f"{path}:1:", "anchor", "'l0'")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(msg) < 200
    assert peak < 2 * 2**20, f"peak {peak} bytes: the aliases were expanded"


def test_yaml_alias_without_anchor_is_refused(tmp_path):
    """A bare alias (even of an undefined anchor) is refused as an alias, with its line."""
    path = _write(tmp_path, "device: cpu\ndtype: *fp\n")
    _refused(path, f"{path}:2:", "alias", "'fp'")


@pytest.mark.parametrize("text, key, line", [
    ("dtype: fp32\ndevice: cpu\ndtype: bf16\n", "'dtype'", 3),
    ("pool:\n  max_requests: 4\n  max_context: 64\n  max_requests: 2\n", "'max_requests'", 4),
    ("graph: {backend: cpu, backend: eager}\n", "'backend'", 1),
])
def test_duplicate_yaml_keys_refused(tmp_path, text, key, line):
    """A key given twice is refused, naming the key, the file and the line of the repeat."""
    path = _write(tmp_path, text)
    _refused(path, f"{path}:{line}:", "duplicate key", key)


def test_yaml_merge_keys_refused(tmp_path):
    """``<<`` merges silently override keys; refused like duplicates."""
    path = _write(tmp_path, "speculative:\n  <<: {num_steps: 2}\n  num_steps: 3\n")
    _refused(path, f"{path}:2:", "merge key")


@pytest.mark.parametrize("text, key", [
    ("dtype: [" + ", ".join(["123456"] * 500) + "]\n", "'dtype'"),
    ("device: " + "x" * 2_000 + "\n", "'device'"),
    ("speculative: {algorithm: " + "y" * 2_000 + "}\n", "speculative.algorithm"),
    ("graph: {buckets: [" + ", ".join(["0"] * 500) + "]}\n", "graph.buckets"),
    ("pool: [" + ", ".join(["[1, [2, [3, [4]]]]"] * 200) + "]\n", "'pool'"),
])
def test_rejected_values_are_cut_short_in_messages(tmp_path, text, key):
    """A big rejected value prints as a short head ending in '...', never in full."""
    msg = _refused(_write(tmp_path, text), key, "...")
    assert len(msg) < 300, len(msg)


@pytest.mark.parametrize("text, needle", [
    ("pool: {max_requests: 1" + "1" * 5_000 + "}\n", "invalid YAML"),
    ("dtype: " + "[" * 2_000 + "\n", "invalid YAML"),
    ("pool:\n  ? [1]\n  : 2\n", "unhashable"),
])
def test_hostile_yaml_is_a_config_error(tmp_path, text, needle):
    """Oversized ints, absurd nesting and unhashable keys are ConfigErrors naming the file."""
    path = _write(tmp_path, text)
    assert len(_refused(path, str(path), needle)) < 400


def test_plain_configs_still_load(tmp_path):
    """Nothing strict about the loader gets in the way of an ordinary config."""
    path = _write(tmp_path, "dtype: bf16\npool: {max_requests: 4, max_context: 64}\n"
                            "speculative:\n  num_steps: 2\ngraph:\n  buckets: [1, 4]\n")
    cfg = load_run_config(path)
    assert (cfg.dtype, cfg.pool.max_requests, cfg.speculative.num_steps) == ("bf16", 4, 2)
    assert cfg.graph.buckets == (1, 4)
    assert load_run_config(_write(tmp_path, "")).dtype == "fp32"


@pytest.mark.parametrize("text, line, key, read_as", [
    ("yes: 1\n", 1, "'yes'", "True"),
    ("dtype: fp32\n1: 2\n", 2, "'1'", "1"),
    ("null: 3\n", 1, "'null'", "None"),
    ("on: 4\n", 1, "'on'", "True"),
    ("pool:\n  max_requests: 4\n  null: 3\n", 3, "'null'", "None"),
    ("pool:\n  on: 3\n", 2, "'on'", "True"),
    ("graph: {1: eager}\n", 1, "'1'", "1"),
])
def test_non_string_yaml_keys_refused(tmp_path, text, line, key, read_as):
    """`yes:`, `on:`, `null:` and `1:` are booleans, None and ints to YAML: refused as
    keys naming the file, line and the key as written, not a TypeError from sorting them."""
    path = _write(tmp_path, text)
    msg = _refused(path, f"{path}:{line}: key {key} reads as {read_as}, not a string",
                   "quote the key")
    assert len(msg) < 300


@pytest.mark.parametrize("section, key", [("pool", 1), ("graph", None), ("speculative", True)])
def test_non_string_override_keys_refused(section, key):
    """Overrides bypass the YAML loader; a non-string key there is named too."""
    with pytest.raises(ConfigError) as info:
        load_run_config(None, **{section: {key: 2}})
    assert f"key {key!r} under '{section}' is not a string" in str(info.value)


@pytest.mark.parametrize("warmup, ok", [(0, True), (100, True), (101, False),
                                        (100_000_000, False)])
def test_absurd_graph_warmup_refused(tmp_path, warmup, ok):
    """graph.warmup is a loop of full eager forwards before each capture: 1e8 would hang
    start-up, so it is bounded (100) and the error names the key, bound and value."""
    path = _write(tmp_path, f"graph: {{warmup: {warmup}}}\n")
    if ok:
        assert load_run_config(path).graph.warmup == warmup
    else:
        _refused(path, "'graph.warmup' must be in [0, 100]", f"got {warmup}")
