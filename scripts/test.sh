#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite (CPU; gpu-marked tests are
# deselected by pyproject's addopts). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
