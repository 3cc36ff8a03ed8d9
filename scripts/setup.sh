#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtual environment in .venv with torch,
# this package and its test tools. Safe to run again: it returns at once when
# nothing changed. Never installs torch_npu (it breaks `import torch` on machines
# without the CANN toolkit); on Ascend, install torch_npu yourself, matching CANN.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.nextn_graph_setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]] && .venv/bin/python -c "import torch, nextn_graph" 2>/dev/null; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install torch            # a CUDA build for the GPU that is present
  else
    pip install torch==2.13.0    # the CPU build
  fi
fi
pip install -e '.[test]'
echo "$want" > "$stamp"
