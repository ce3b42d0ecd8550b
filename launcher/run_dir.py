"""A run directory's own record of its run: ``RUN_DIR/config.yaml``, the resolved config
(every key; ``relay train --config RUN_DIR/config.yaml`` runs it again), written when a
training job starts; and the rules that keep one directory one run: a directory that holds
a run (its ``metrics.jsonl``) takes only ``--resume``, and ``--resume`` names the keys that
change the training (:data:`TRAINING_KEYS`) that differ from the saved config, and refuses
unless ``--allow-config-changes``."""

from __future__ import annotations

import os

from launcher.config import JobConfig, load_config
from launcher.config.loading import config_yaml
from launcher.metrics import METRICS_FILE

CONFIG_FILE = "config.yaml"
#: keys whose change makes a resumed run another training than the one saved (the data and its
#: order, the sampling, the reward, the loss and the optimizer); layout, timeouts, evaluation,
#: saving and the number of steps may change on resume
TRAINING_KEYS = (
    "hf_checkpoint", "prompt_data", "input_key", "label_key", "apply_chat_template", "chat_template_kwargs",
    "rollout_shuffle", "rollout_seed", "seed", "n_samples_per_prompt", "rollout_batch_size", "global_batch_size",
    "rollout_max_response_len", "rollout_temperature", "rollout_top_p", "max_staleness",
    "custom_generate_function_path", "rm_type", "reward_key", "custom_rm_path", "custom_reward_post_process_path",
    "genrm_model_path", "genrm_instances", "genrm_sampling_config", "genrm_prompt_template", "genrm_parse",
    "genrm_reward_variant", "genrm_answer_guard", "advantage_estimator", "use_kl_loss", "kl_loss_coef",
    "kl_loss_type", "eps_clip", "eps_clip_high", "eps_clip_c", "use_tis", "tis_clip", "tis_clip_low", "entropy_coef",
    "calculate_per_token_loss", "disable_rewards_normalization", "disable_grpo_std_normalization", "optimizer", "lr",
    "lr_decay_style", "lr_warmup_iters", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "bf16",
)


def write_config(cfg: JobConfig, run_dir: str) -> str:
    """Write ``RUN_DIR/config.yaml`` (atomically); returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CONFIG_FILE)
    with open(path + ".tmp", "w") as f:
        f.write(config_yaml(cfg))
    os.replace(path + ".tmp", path)
    return path


def holds_a_run(run_dir: str) -> bool:
    path = os.path.join(run_dir, METRICS_FILE)
    return os.path.isfile(path) and os.path.getsize(path) > 0


def run_dir_problem(cfg: JobConfig, run_dir: str) -> str | None:
    """Why this job may not start in ``run_dir`` (None: it may): a directory that holds a run
    without ``--resume``; with ``--resume``, training keys changed since the saved config
    (unless ``--allow-config-changes``)."""
    if not cfg.resume:
        if holds_a_run(run_dir):
            return (f"{run_dir} already holds a run (its {METRICS_FILE}): pass --resume to continue it, or choose "
                    f"another --run-dir for a new run (a second run there would mix its records with the first's)")
        return None
    saved = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(saved) or cfg.allow_config_changes:
        return None
    try:
        before = load_config(saved)
    except ValueError as e:
        return f"--resume: the saved {saved} cannot be read ({e}); pass --allow-config-changes to resume anyway"
    changed = [f"{key} ({getattr(before, key)!r} -> {getattr(cfg, key)!r})" for key in TRAINING_KEYS
               if getattr(before, key) != getattr(cfg, key)]
    if not changed:
        return None
    return (f"--resume: the training differs from the run saved in {saved}: {'; '.join(changed)}. Resume with the "
            f"saved config (relay train --config {saved} --resume), or pass --allow-config-changes to continue with "
            f"these")
