"""perf/device_check.py, dry-run on the CPU configs: one JSON with versions and every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # perf/device_check.py in a subprocess

REPO = Path(__file__).resolve().parents[1]


def test_device_check_dry_run_writes_one_json(tmp_path):
    """The script a CUDA machine runs works end to end here on the CPU bench step:
    its JSON holds the versions, the step's exit code and the bench report."""
    proc = subprocess.run([sys.executable, str(REPO / "perf" / "device_check.py"), "--device",
                           "cpu", "--skip", "tests", "flash", "--rounds", "2", "--repeats", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["versions"]["torch"] and report["device"] == "cpu"
    bench = report["steps"]["bench"]
    assert bench["rc"] == 0 and set(report["steps"]) == {"bench", "kernels_bf16", "kernels_fp32"}
    for dtype in ("bf16", "fp32"):  # every fused op ran against its reference
        kernels = report["steps"][f"kernels_{dtype}"]
        # part 1's 10 ops, 2 quantized GEMMs, 4 sparse cases at each of 2 contexts
        assert kernels["rc"] == 0 and len(kernels["report"]["ops"]) == 20
        assert all(0 <= op["rel_err"] < 2e-2 for op in kernels["report"]["ops"])
    buckets = bench["report"]["buckets"]
    assert [b["bucket"] for b in buckets] == [1, 2, 4, 8]
    assert all(b["graph"]["submissions_per_round"] == 2 for b in buckets)  # fused rounds
