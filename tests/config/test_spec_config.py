"""The YAML run config: shipped files load, the speculative settings are resolved
once (NEXTN alias, topk 1, N = S + 1), and every bad file is a ConfigError that
names the file and the dotted key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nextn_graph.config import (PoolConfig, RunConfig, SpeculativeConfig, load_run_config,
                                resolve, resolve_speculative)
from nextn_graph.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "capture_configs").glob("*.yaml"))

GOOD = """\
checkpoint: builtin:tiny-trained
dtype: fp32
device: cpu
speculative:
  algorithm: {algorithm}
  num_steps: {num_steps}
  eagle_topk: {eagle_topk}
  num_draft_tokens: {num_draft_tokens}
pool:
  max_requests: 4
  max_context: 256
"""


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def spec_file(tmp_path: Path, algorithm="EAGLE", num_steps=3, eagle_topk=1,
              num_draft_tokens=4) -> Path:
    return write(tmp_path, GOOD.format(algorithm=algorithm, num_steps=num_steps,
                                       eagle_topk=eagle_topk,
                                       num_draft_tokens=num_draft_tokens))


def test_every_shipped_config_loads():
    """Each capture_configs/*.yaml loads into a resolved RunConfig with topk 1 and N = S + 1."""
    assert {p.name for p in CONFIGS} >= {"cpu_default.yaml", "cuda.yaml",
                                         "deepseek_v4_flash_ascend.yaml"}
    for path in CONFIGS:
        cfg = load_run_config(path)
        assert isinstance(cfg, RunConfig), path
        assert cfg.speculative.algorithm == "EAGLE" and cfg.speculative.eagle_topk == 1
        assert cfg.speculative.num_draft_tokens == cfg.speculative.num_steps + 1


def test_ascend_flash_config_loads_unchanged(caplog):
    """The DeepSeek-V4-Flash Ascend config (the official flags: EAGLE, 2 steps, topk 1,
    3 draft tokens) loads exactly as written, with no correction warning."""
    with caplog.at_level(logging.WARNING):
        cfg = load_run_config(REPO / "capture_configs" / "deepseek_v4_flash_ascend.yaml")
    assert cfg.speculative == SpeculativeConfig("EAGLE", 2, 1, 3)
    assert cfg.speculative.verify_width == 3
    assert (cfg.device, cfg.dtype) == ("npu", "bf16")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_embedded_default_equals_cpu_default_yaml():
    """load_run_config(None), the embedded default, equals capture_configs/cpu_default.yaml."""
    default = load_run_config(None)
    assert default == load_run_config(REPO / "capture_configs" / "cpu_default.yaml")
    assert default == resolve(RunConfig())
    assert default.graph.buckets == (1, 2, 4, 8)  # auto: powers of two up to the pool
    assert default.speculative == SpeculativeConfig("EAGLE", 3, 1, 4)
    assert default.pool == PoolConfig(8, 512)


@pytest.mark.parametrize("alias", ["NEXTN", "nextn", "EAGLE", "eagle"])
def test_nextn_alias_resolves_to_eagle(tmp_path, alias):
    """algorithm NEXTN (any case) names the same runtime and is stored as EAGLE."""
    cfg = load_run_config(spec_file(tmp_path, algorithm=alias))
    assert cfg.speculative.algorithm == "EAGLE"


@pytest.mark.parametrize("algorithm", ["DSPARK", "DSpark", "foo"])
def test_other_algorithms_are_refused(tmp_path, algorithm):
    """DSpark (a different, block-wise drafter) and unknown algorithms are a ConfigError
    saying the runtime drives the NextN draft only, naming the file and key."""
    path = spec_file(tmp_path, algorithm=algorithm)
    with pytest.raises(ConfigError, match="drives the NextN draft only") as exc:
        load_run_config(path)
    assert str(path) in str(exc.value) and "speculative.algorithm" in str(exc.value)


def test_topk_other_than_1_is_refused(tmp_path):
    """eagle_topk 2 (a tree draft) is a ConfigError: only the linear chain is supported."""
    with pytest.raises(ConfigError, match="speculative.eagle_topk.*topk 1"):
        load_run_config(spec_file(tmp_path, eagle_topk=2))


@pytest.mark.parametrize("steps", [0, -1, 33])
def test_num_steps_outside_1_to_32_is_refused(tmp_path, steps):
    """num_steps must lie in [1, 32]: 0 drafts nothing, a deeper chain only costs."""
    with pytest.raises(ConfigError, match=rf"speculative.num_steps.*\[1, 32\], got {steps}"):
        load_run_config(spec_file(tmp_path, num_steps=steps, num_draft_tokens=steps + 1))


def test_inconsistent_num_draft_tokens_is_corrected_with_warning(tmp_path, caplog):
    """num_draft_tokens 5 with num_steps 3 and topk 1 becomes 4 (= num_steps + 1), with a
    logged warning naming the file; a consistent value logs nothing."""
    path = spec_file(tmp_path, num_draft_tokens=5)
    with caplog.at_level(logging.WARNING, logger="nextn_graph.config"):
        cfg = load_run_config(path)
    assert cfg.speculative.num_draft_tokens == 4 and cfg.speculative.num_steps == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "num_draft_tokens 5" in warnings[0] and "4" in warnings[0]
    assert str(path) in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nextn_graph.config"):
        load_run_config(spec_file(tmp_path))
    assert not caplog.records
    # The same rule when a SpeculativeConfig is resolved directly.
    assert resolve_speculative(SpeculativeConfig("NEXTN", 1, 1, 7), "x") == \
        SpeculativeConfig("EAGLE", 1, 1, 2)


@pytest.mark.parametrize("text,key", [
    ("foo: 1\n", "'foo'"),
    ("speculative:\n  foo: 3\n", "'speculative.foo'"),
    ("pool:\n  max_request: 3\n", "'pool.max_request'"),
])
def test_unknown_key_names_file_and_dotted_key(tmp_path, text, key):
    """An unknown key, at the top level or nested, is a ConfigError naming the file
    and the dotted key."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="unknown key") as exc:
        load_run_config(path)
    assert str(path) in str(exc.value) and key in str(exc.value)


@pytest.mark.parametrize("text,key", [
    ("speculative:\n  num_steps: \"3\"\n", "'speculative.num_steps'"),
    ("speculative:\n  num_steps: true\n", "'speculative.num_steps'"),
    ("pool:\n  max_requests: 2.5\n", "'pool.max_requests'"),
    ("pool:\n  max_context: null\n", "'pool.max_context'"),
    ("checkpoint: 5\n", "'checkpoint'"),
    ("speculative: 3\n", "speculative"),
])
def test_wrong_type_names_file_and_key(tmp_path, text, key):
    """A value of the wrong type (a string or bool for an int, a float, null, an int
    for a string, a scalar for a section) is a ConfigError naming file and key."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_run_config(path)
    assert str(path) in str(exc.value) and key in str(exc.value)


@pytest.mark.parametrize("text,key", [
    ("dtype: fp16\n", "'dtype'"),
    ("device: tpu\n", "'device'"),
])
def test_dtype_and_device_outside_the_allowed_set(tmp_path, text, key):
    """dtype and device must be one of the listed choices."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="must be one of") as exc:
        load_run_config(path)
    assert str(path) in str(exc.value) and key in str(exc.value)


def test_pool_limits(tmp_path):
    """max_requests 0 and a max_context smaller than one verify window are refused."""
    with pytest.raises(ConfigError, match="pool.max_requests"):
        load_run_config(write(tmp_path, "pool:\n  max_requests: 0\n"))
    with pytest.raises(ConfigError, match="pool.max_context"):
        load_run_config(write(tmp_path, "pool:\n  max_context: 4\n"))


def test_invalid_yaml_and_missing_file(tmp_path):
    """Invalid YAML and a missing file are ConfigErrors naming the file; an empty file
    is the defaults."""
    bad = write(tmp_path, "speculative: [1, 2\n", "bad.yaml")
    with pytest.raises(ConfigError, match="invalid YAML") as exc:
        load_run_config(bad)
    assert str(bad) in str(exc.value)
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as exc:
        load_run_config(missing)
    assert str(missing) in str(exc.value)
    assert load_run_config(write(tmp_path, "", "empty.yaml")) == resolve(RunConfig())


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "5\n", "just text\n"])
def test_top_level_not_a_mapping(tmp_path, text):
    """A YAML file whose top level is not a mapping is a ConfigError naming the file."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="mapping") as exc:
        load_run_config(path)
    assert str(path) in str(exc.value)


def test_command_line_overrides(tmp_path):
    """Overrides (top-level values and per-section dicts) replace the file's values, are
    validated the same way, and the error says which override was involved."""
    cfg = load_run_config(REPO / "capture_configs" / "cuda.yaml", device="cpu", dtype="fp32",
                          checkpoint=None, graph={"backend": "eager"}, pool={"max_context": 64})
    assert (cfg.device, cfg.dtype, cfg.checkpoint) == ("cpu", "fp32", "builtin:tiny-trained")
    assert (cfg.graph.backend, cfg.pool.max_context, cfg.pool.max_requests) == ("eager", 64, 32)
    with pytest.raises(ConfigError, match="overrides dtype") as exc:
        load_run_config(None, dtype="fp8")
    assert "'dtype'" in str(exc.value)
    with pytest.raises(ConfigError, match="needs device 'cuda'"):
        load_run_config(REPO / "capture_configs" / "cuda.yaml", device="cpu")
