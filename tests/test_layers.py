"""The packages form one-way layers: ``lint-imports`` keeps the contracts written in
``pyproject.toml`` (``[tool.importlinter]``, run by ``.ci/run`` too), and they have
teeth: an upward import, an import between independent siblings, the server's HTTP
front reaching the engine, or a new top-level module with no layer, each in a copy of
the package, breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")  # installed by the `test` extra


def lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports puts its working directory first on sys.path: ``root``'s package."""
    return subprocess.run([str(LINT), "--config", "pyproject.toml", "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=120)


def package_copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "nextn_graph", tmp_path / "nextn_graph",
                    ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path / "nextn_graph"


@pytest.mark.process
def test_the_layers_contract_is_kept():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    contracts = (ROOT / "pyproject.toml").read_text().count("[[tool.importlinter.contracts]]")
    assert f"Contracts: {contracts} kept, 0 broken." in proc.stdout


@pytest.mark.parametrize("module, line, broken", [
    # the pools may not name the model's config class (memory is below model)
    ("memory/pool.py", "from ..model.config import ModelConfig",
     "nextn_graph.memory is not allowed to import nextn_graph.model"),
    # the sampling kernels are below the runtime
    ("sampling.py", "from .runtime.request import Request",
     "nextn_graph.sampling is not allowed to import nextn_graph.runtime"),
    # the engine does not reach up to the followers' loop
    ("runtime/stats.py", "from ..launch.follower import serve",
     "nextn_graph.runtime is not allowed to import nextn_graph.launch"),
    # checkpoint and graph are independent siblings
    ("checkpoint/weights.py", "from ..graph.runner import RoundRunner",
     "nextn_graph.checkpoint is not allowed to import nextn_graph.graph"),
    # the server's HTTP front talks to the engine's side through serve.messages only
    ("serve/front/app.py", "from ..engine.loop import EngineLoop",
     "nextn_graph.serve.front is not allowed to import nextn_graph.serve.engine"),
    # ... and reads of the runtime only its plain request data
    ("serve/front/session.py", "from ...runtime.scheduler import Scheduler",
     "nextn_graph.serve.front is not allowed to import nextn_graph.runtime.scheduler"),
    # no import cycle inside the front (prompts read ModelInfo, protocol reads prompts)
    ("serve/front/prompts.py", "from .protocol import GenRequest",
     "- nextn_graph.serve.front.prompts -> nextn_graph.serve.front.protocol"),
])
@pytest.mark.process
def test_an_upward_import_breaks_the_contract(tmp_path, module, line, broken):
    pkg = package_copy(tmp_path)
    with open(pkg / module, "a") as f:
        f.write(f"\n{line}\n")
    proc = lint(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert broken in proc.stdout, proc.stdout


@pytest.mark.process
def test_a_module_without_a_layer_breaks_the_contract(tmp_path):
    pkg = package_copy(tmp_path)
    (pkg / "helpers.py").write_text("from .errors import InputError\n")
    proc = lint(tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "- nextn_graph.helpers" in proc.stdout, proc.stdout
