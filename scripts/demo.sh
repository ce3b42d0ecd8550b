#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the main demo (`relay demo`). Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/relay demo "$@"
