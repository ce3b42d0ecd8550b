#!/bin/bash
# Qwen3.5-35B-A3B policy + a 397B FP8 GenRM on 16 GPUs (2 nodes x 8), colocate Shared /
# Defer-swap: shared bundles, the judge asleep while the rollout generates; the batch is scored
# by the post-process hook (examples/generate_reward_model/post_process_genrm_swap.py).
# Run it on every node (HEAD = the first node's address), or use `relay sbatch`.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/run-common.sh

# the inline reward is a dummy: the hook scores the whole batch with the judge
args=()
for ((i = 0; i < ${#ROLLOUT_ARGS[@]}; i++)); do
   if [ "${ROLLOUT_ARGS[i]}" = --rm-type ]; then i=$((i + 1)); else args+=("${ROLLOUT_ARGS[i]}"); fi
done
ROLLOUT_ARGS=("${args[@]}" --rm-type dummy --defer-reward-to-post-process
   --custom-reward-post-process-path examples.generate_reward_model.post_process_genrm_swap.custom_reward_post_process)

# The judge's dp_size 8 is SGLang's data-parallel attention inside one engine of 8 GPUs (TP = DP =
# EP = 8, as the original runs it): --engine sglang (the built-in engine refuses dp_size > 1).
GENRM_ARGS=(
   --engine sglang
   --genrm-model-path ${MODEL_DIR}/Qwen3.5-397B-A17B-FP8/
   --genrm-num-gpus-per-engine 8
   --genrm-engine-config '{"max_context_len": 10240, "dp_size": 8, "ep_size": 8, "mem_fraction_static": 0.85}'
   --genrm-sampling-config '{"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 32, "chat_template_kwargs": {"enable_thinking": false}}'
)

${RELAY_LAUNCH:-torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint ${HEAD:?set HEAD to the first node}:29500 -m launcher} \
   --hf-checkpoint ${MODEL_DIR}/Qwen3.5-35B-A3B \
   --resource '{"actor": [1, 16], "rollout": [1, 16], "genrm": [1, 16]}' \
   --colocate \
   --num-gpus-per-node 8 \
   --rollout-num-gpus-per-engine 8 \
   --sglang-mem-fraction-static 0.85 \
   "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${GENRM_ARGS[@]}" "$@"
