"""Launching tensor-parallel runs: ``--tp N`` (this machine spawns the ranks), torchrun,
the ``parallel`` YAML section, and the refusals (world size, uneven split, ranks that
loaded different things)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nextn_graph.config import load_run_config
from nextn_graph.errors import ConfigError, ParallelError
from nextn_graph.parallel.group import TPGroup
from nextn_graph.launch.ranks import spawn

pytestmark = pytest.mark.process  # each test starts ranks or a CLI in other processes

REPO = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
ENV["OMP_NUM_THREADS"] = "1"
PROMPTS = [{"input_ids": [5, 6, 7, 8, 9, 10]}, {"text": "the cat sat"}, {"input_ids": [40] * 30}]


def _run(args: list[str], launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = (launcher or [sys.executable, "-m", "nextn_graph"]) + args
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tp_cli") / "p.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _generate(prompts: Path, *extra: str) -> list[str]:
    return ["generate", "--checkpoint", "builtin:tiny-trained", "--prompts", str(prompts),
            "--max-new-tokens", "16", "--json", *extra]


def _outputs(proc: subprocess.CompletedProcess) -> list[list[int]]:
    assert proc.returncode == 0, proc.stderr
    return [r["output_ids"] for r in json.loads(proc.stdout.strip().splitlines()[-1])["requests"]]


def test_tp_flag_and_torchrun_equal_one_rank(prompts):
    """`--tp 2` (spawned here) and torchrun with 2 processes print tp = 1's tokens, on the
    cpu graphs; plain decoding too."""
    want = _outputs(_run(_generate(prompts, "--backend", "cpu")))
    assert _outputs(_run(_generate(prompts, "--backend", "cpu", "--tp", "2"))) == want
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "-m", "nextn_graph"]
    assert _outputs(_run(_generate(prompts, "--backend", "cpu", "--tp", "2"), torchrun)) == want
    assert _outputs(_run(_generate(prompts, "--mode", "plain", "--tp", "2"))) == want


def test_torchrun_world_size_must_match_the_config(prompts):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "-m", "nextn_graph"]
    proc = _run(_generate(prompts, "--tp", "4"), torchrun)
    assert proc.returncode != 0
    assert "torchrun started 2 processes but the config asks for parallel.tp = 4" in proc.stderr


def test_uneven_split_is_a_named_error(prompts):
    """tp = 3 cannot split the trained checkpoint's 4 heads: exit 2, the dimension named."""
    proc = _run(_generate(prompts, "--tp", "3"))
    assert proc.returncode == 2, proc.stderr
    assert "does not divide into tp = 3" in proc.stderr and "(rank 0)" in proc.stderr


@pytest.mark.parametrize("section,message", [
    ({"tp": 0}, "'parallel.tp' must lie in [1, 1024]"),
    ({"timeout_s": 0}, "'parallel.timeout_s' must lie in [1,"),
    ({"tp": "2"}, "'parallel.tp' must be an integer"),
    ({"ranks": 2}, "unknown key 'parallel.ranks'"),
])
def test_parallel_section_is_checked(tmp_path, section, message):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"parallel": section}))  # JSON is YAML
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_run_config(path)


def disagree(group: TPGroup) -> str:
    """Rank 1 claims to have loaded something else."""
    try:
        group.agree("config-a" if group.rank == 0 else "config-b")
    except ParallelError as exc:
        return str(exc)
    return "agreed"


def test_ranks_that_loaded_different_things_are_refused():
    got = spawn(disagree, 2, timeout_s=30)
    assert all("rank(s) [1] loaded a different config or checkpoint" in g for g in got), got


def test_bench_reports_collectives_and_weights_per_rank(tmp_path):
    """`bench --tp 2`: per bucket, the collectives per steady round (eager and inside the
    graphs) and rank 0's one control message; per rank, the resident weight bytes: each
    rank's split bytes are half of one rank's, the replicated bytes the same."""
    from nextn_graph.checkpoint import load_checkpoint
    from nextn_graph.checkpoint.sharding import sharded_bytes

    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"pool": {"max_requests": 2, "max_context": 128},
                               "graph": {"buckets": [2]}, "parallel": {"tp": 2}}))
    proc = _run(["bench", "--config", str(cfg), "--rounds", "2", "--repeats", "1",
                 "--warmup-rounds", "0", "--quiet", "--out", str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    one = sharded_bytes(load_checkpoint("builtin:tiny-trained"))
    ranks = report["parallel"]["weights_per_rank"]
    assert report["parallel"]["tp"] == 2 and len(ranks) == 2
    for r in ranks:
        assert 2 * r["split"] == one["split"] and r["replicated"] == one["replicated"]
    (bucket,) = report["buckets"]
    assert bucket["eager"]["collectives_per_round"] > 0
    assert bucket["graph"]["collectives_per_round"] == bucket["eager"]["collectives_per_round"]
    assert bucket["graph"]["control_messages_per_round"] == 1
    assert "eager coll" in proc.stdout and "tp 2 ranks" in proc.stdout
