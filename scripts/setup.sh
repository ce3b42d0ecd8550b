#!/usr/bin/env bash
# Sets up .venv with everything the project needs; safe to run again (it only adds what is missing).
# torch goes in first, within the tested range (launcher/versions.py TESTED), so that resolving
# megatron-core and transformers never pulls another one: on a machine without CUDA torch==2.13.0
# (the CPU build); with a GPU a CUDA build from RELAY_TORCH_INDEX (default: PyTorch's CUDA 12.8
# index; set it for another CUDA flavour).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.11,<2.14" --index-url "${RELAY_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}"
  else
    "$VPY" -m pip install -q "torch==2.13.0"
  fi
fi
stamp=.venv/.relay-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
  # within the tested matrix (scripts/constraints.txt): a new upstream release does not change a fresh setup
  "$VPY" -m pip install -q -c scripts/constraints.txt -e ".[dev]"
  touch "$stamp"
fi
