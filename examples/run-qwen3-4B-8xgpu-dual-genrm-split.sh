#!/bin/bash
# Qwen3-4B policy + two GenRM instances (quality, safety) on 8 GPUs, colocate Split; the reward
# routes to them by route_key (examples/generate_reward_model/reward_dual_genrm_quality_safety.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/run-common.sh

# this script scores with its own reward function: ROLLOUT_ARGS without --rm-type dapo-genrm
args=()
for ((i = 0; i < ${#ROLLOUT_ARGS[@]}; i++)); do
   if [ "${ROLLOUT_ARGS[i]}" = --rm-type ]; then i=$((i + 1)); else args+=("${ROLLOUT_ARGS[i]}"); fi
done
ROLLOUT_ARGS=("${args[@]}")

${RELAY_LAUNCH:-relay train} \
   --hf-checkpoint ${MODEL_DIR}/Qwen3-4B \
   --genrm-instances '{
       "quality": {"model_path": "'${MODEL_DIR}'/quality-judge", "num_gpus": 2, "num_gpus_per_engine": 2,
                    "sampling_config": {"temperature": 0.1, "max_response_len": 64}},
       "safety":  {"model_path": "'${MODEL_DIR}'/safety-judge",  "num_gpus": 2, "num_gpus_per_engine": 2,
                    "sampling_config": {"temperature": 0.1, "max_response_len": 32,
                                         "chat_template_kwargs": {"enable_thinking": false}}}
   }' \
   --rollout-num-gpus 4 \
   --resource '{"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 4]}' \
   --colocate \
   --custom-rm-path examples.generate_reward_model.reward_dual_genrm_quality_safety.reward_func \
   --num-gpus-per-node 8 \
   "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "$@"
