"""The `graph:` section of the YAML run config, loaded strictly by ``load_run_config``.

Every bad value is a ConfigError naming the file and the dotted key; omitted
buckets resolve once to powers of two plus the pool size; the backend must match
the device; and every shipped capture config loads and explains itself (a header
comment and a comment on every key line).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nextn_graph.config import PHASE_NAMES, GraphConfig, load_run_config
from nextn_graph.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "capture_configs").glob("*.yaml"))

BASE = """\
# test config
checkpoint: builtin:tiny-trained
dtype: fp32
device: {device}
pool:
  max_requests: {max_requests}
  max_context: 256
"""


def write(tmp_path: Path, graph: str | None, device: str = "cpu", max_requests: int = 6) -> Path:
    """A run config with the given `graph:` body (indented YAML lines), or none."""
    text = BASE.format(device=device, max_requests=max_requests)
    if graph is not None:
        text += "graph:\n" + "".join(f"  {line}\n" for line in graph.splitlines())
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def load_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    msg = str(info.value)
    assert msg.startswith(str(path)), msg  # names the file
    return msg


BAD_BUCKETS = {
    "unsorted": "buckets: [4, 2, 1]",
    "duplicate": "buckets: [1, 2, 2, 4]",
    "zero": "buckets: [0, 1, 2]",
    "negative": "buckets: [-1, 2]",
    "above pool": "buckets: [1, 2, 8]",
    "not a list": "buckets: 4",
    "a mapping": "buckets: {a: 1}",
    "null": "buckets:",
    "a string item": "buckets: [1, two]",
    "a bool item": "buckets: [true, 2]",
}


@pytest.mark.parametrize("body", BAD_BUCKETS.values(), ids=BAD_BUCKETS.keys())
def test_bad_buckets_name_file_and_key(tmp_path, body):
    """Every malformed graph.buckets is a ConfigError naming the file and graph.buckets."""
    msg = load_error(write(tmp_path, body, max_requests=6))
    assert "'graph.buckets'" in msg


def test_bucket_above_pool_names_the_pool_size(tmp_path):
    """A bucket above pool.max_requests names the bucket and the pool size."""
    msg = load_error(write(tmp_path, "buckets: [1, 2, 8]", max_requests=6))
    assert "8" in msg and "pool.max_requests = 6" in msg


@pytest.mark.parametrize("body", ["captured_phases: [draft_extend, foo]",
                                  "captured_phases: [rollout, rollout]",
                                  "captured_phases: rollout"],
                         ids=["unknown", "duplicate", "not a list"])
def test_bad_captured_phases_name_file_and_key(tmp_path, body):
    """An unknown, duplicated or non-list phase is a ConfigError naming graph.captured_phases."""
    msg = load_error(write(tmp_path, body))
    assert "'graph.captured_phases'" in msg


@pytest.mark.parametrize("body", ["kinds: [rollout]", "kinds: [rollout]\ncaptured_phases: []"],
                         ids=["alone", "beside the new key"])
def test_old_kinds_key_says_it_was_renamed(tmp_path, body):
    """A file written for graph.kinds is told its key is now graph.captured_phases."""
    msg = load_error(write(tmp_path, body))
    assert "'graph.kinds' was renamed to 'graph.captured_phases'" in msg


def test_old_kinds_override_says_it_was_renamed():
    """An override naming the old key is refused the same way as a file."""
    with pytest.raises(ConfigError, match="'graph.kinds' was renamed to 'graph.captured_phases'"):
        load_run_config(graph={"kinds": ["rollout"]})


@pytest.mark.parametrize("body,key", [
    ("backend: tpu", "graph.backend"),
    ("warmup: -1", "graph.warmup"),
    ("warmup: 1.5", "graph.warmup"),
    ("debug_check_addresses: 'yes'", "graph.debug_check_addresses"),
    ("debug_check_addresses: 1", "graph.debug_check_addresses"),
    ("foo: 1", "graph.foo"),
], ids=["unknown backend", "negative warmup", "float warmup", "debug string", "debug int",
        "unknown key"])
def test_bad_graph_values_name_file_and_key(tmp_path, body, key):
    """A bad backend, warmup, debug switch or unknown graph key names the file and the key."""
    msg = load_error(write(tmp_path, body))
    assert f"'{key}'" in msg


@pytest.mark.parametrize("backend,needs", [("cuda", "cuda"), ("npu", "npu"), ("torchair", "npu")])
def test_backend_must_match_device(tmp_path, backend, needs):
    """A device backend with device cpu is an error saying which device it needs."""
    msg = load_error(write(tmp_path, f"backend: {backend}", device="cpu"))
    assert "'graph.backend'" in msg and f"needs device '{needs}'" in msg


def test_cpu_backend_needs_device_cpu_and_eager_runs_anywhere(tmp_path):
    """The cpu emulator needs device cpu; the eager backend loads with any device."""
    msg = load_error(write(tmp_path, "backend: cpu", device="cuda"))
    assert "needs device 'cpu'" in msg
    eager = load_run_config(write(tmp_path, "backend: eager", device="cuda"))
    assert eager.graph.backend == "eager"


@pytest.mark.parametrize("max_requests,auto", [(6, (1, 2, 4, 6)), (8, (1, 2, 4, 8)),
                                               (1, (1,)), (5, (1, 2, 4, 5))])
@pytest.mark.parametrize("body", [None, "backend: cpu", "buckets: []"],
                         ids=["no graph section", "buckets omitted", "buckets empty"])
def test_omitted_buckets_are_powers_of_two_plus_pool(tmp_path, max_requests, auto, body):
    """Omitted or empty buckets resolve to powers of two below the pool plus the pool size."""
    cfg = load_run_config(write(tmp_path, body, max_requests=max_requests))
    assert cfg.graph.buckets == auto


def test_good_graph_section_loads_as_written(tmp_path):
    """A full valid graph section loads into the GraphConfig it spells; captured_phases may
    be empty."""
    body = ("backend: cpu\nbuckets: [1, 3, 6]\ncaptured_phases: [target_verify, rollout]\n"
            "warmup: 0\ndebug_check_addresses: true")
    cfg = load_run_config(write(tmp_path, body))
    assert cfg.graph == GraphConfig("cpu", (1, 3, 6), ("target_verify", "rollout"), 0, True,
                                    round="split", overlap="off")  # auto: not every phase
    assert load_run_config(write(tmp_path, "captured_phases: []")).graph.captured_phases == ()
    assert load_run_config(write(tmp_path, "buckets: [2]")).graph.buckets == (2,)


# -- shipped files -----------------------------------------------------------------------

KEY_LINE = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_]*\s*:(?P<value>.*)$")


def test_every_shipped_capture_config_loads():
    """Each capture_configs/*.yaml loads strictly with valid buckets and known phases."""
    assert {p.name for p in CONFIGS} >= {"cpu_default.yaml", "cuda.yaml",
                                         "deepseek_v4_flash_ascend.yaml"}
    for path in CONFIGS:
        cfg = load_run_config(path)
        b = cfg.graph.buckets
        assert b and list(b) == sorted(set(b)) and b[0] >= 1, path
        assert b[-1] <= cfg.pool.max_requests, path
        assert set(cfg.graph.captured_phases) <= set(PHASE_NAMES), path


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_capture_config_is_commented(path):
    """A shipped config has a header comment and a `#` comment on every line that sets a value."""
    lines = path.read_text().splitlines()
    first = next(line for line in lines if line.strip())
    assert first.startswith("#"), f"{path.name}: no header comment"
    uncommented = []
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = KEY_LINE.match(line)
        assert m, f"{path.name}:{number}: not a key line: {line!r}"
        value = m.group("value").split("#", 1)[0].strip()
        if value and "#" not in line:  # section headers (`graph:`) open a mapping
            uncommented.append(f"{path.name}:{number}: {stripped}")
    assert not uncommented, uncommented
