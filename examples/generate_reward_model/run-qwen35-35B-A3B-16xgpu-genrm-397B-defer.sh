#!/bin/bash
# The path the original's documentation gives (Quick Start): the script itself is examples/run-qwen35-35B-A3B-16xgpu-genrm-397B-defer.sh.
exec bash "$(dirname "$0")/../run-qwen35-35B-A3B-16xgpu-genrm-397B-defer.sh" "$@"
