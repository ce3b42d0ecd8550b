#!/bin/bash
# Qwen3-4B, fully async: dedicated GPU pools per role, rollout and training overlapped.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/run-common.sh

GENRM_ARGS=(
   --genrm-model-path ${MODEL_DIR}/Qwen3-VL-30B-A3B-Instruct/
   --genrm-num-gpus-per-engine 1
   --genrm-engine-config '{"max_context_len": 10240}'
   --genrm-sampling-config '{"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 1024}'
)

${RELAY_LAUNCH:-relay train} \
   --hf-checkpoint ${MODEL_DIR}/Qwen3-4B \
   --resource '{"actor": [1, 2], "rollout": [1, 3], "reference": [1, 1], "actor_fwd": [1, 1], "advantages": [1, 0], "genrm": [1, 1]}' \
   --fully-async \
   --num-gpus-per-node 8 \
   "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${GENRM_ARGS[@]}" "$@"
