# Shared by the examples/run-*.sh scripts: the original system's argument arrays, unchanged
# (its GenRM documentation, "Script Walkthrough"). MODEL_DIR / DATA_DIR point at the models
# and data (default: exps/, as in the original). RELAY_LAUNCH replaces the launcher (e.g.
# RELAY_LAUNCH="relay plan" prints the placement without starting anything).
MODEL_DIR=${MODEL_DIR:-exps}
DATA_DIR=${DATA_DIR:-exps}

ROLLOUT_ARGS=(
   --prompt-data ${DATA_DIR}/dapo-math-17k/dapo-math-17k.jsonl
   --input-key prompt
   --label-key label
   --rm-type dapo-genrm        # Use GenRM for reward scoring
   --reward-key score           # Key for reward in output dict
   --n-samples-per-prompt 8     # Generate 8 responses per prompt
   --rollout-max-response-len 8192
   --rollout-temperature 1
)

EVAL_ARGS=(
   --eval-interval 20
   --eval-prompt-data aime ${DATA_DIR}/aime-2024/aime-2024.jsonl
   --n-samples-per-eval-prompt 8
   --log-passrate
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --eps-clip 0.2
   --eps-clip-high 0.28
   --use-tis                    # Truncated importance sampling
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
)
