#!/bin/bash
# The path the original's documentation gives (Quick Start): the script itself is examples/run-qwen3-4B-8xgpu-dual-genrm-split.sh.
exec bash "$(dirname "$0")/../run-qwen3-4B-8xgpu-dual-genrm-split.sh" "$@"
