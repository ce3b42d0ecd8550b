"""What a job needs beyond well-formed config values, checked by every entry point before
any process starts."""

from __future__ import annotations

import importlib.util
import logging

from launcher.config.rules import ConfigError
from launcher.config.schema import FIELDS, JobConfig

log = logging.getLogger("relay.config")


def user_code_flags() -> list[str]:
    """The fields whose value is a ``module.func`` path (imported by :func:`check_job`)."""
    return [name for name, f in FIELDS.items() if f.metadata.get("user_code")]


def check_training_math(cfg: JobConfig) -> None:
    """GRPO settings that would train on something else than asked: a rollout temperature of
    0 (greedy groups are identical: every advantage is 0, nothing is learned), and a global
    batch size that does not divide the rollout (a short last optimizer step, and an LR
    schedule counting steps that never run)."""
    if cfg.rollout_temperature == 0:
        raise ConfigError("--rollout-temperature 0 samples every answer of a group greedily, so they are identical, "
                          "every advantage is 0 and nothing is learned: train with a temperature > 0 (the original's "
                          "scripts use 1.0); evaluate greedily with --eval-temperature 0")
    rollout = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    if rollout % cfg.global_batch_size:
        raise ConfigError(f"--global-batch-size {cfg.global_batch_size} does not divide the {rollout} samples of a "
                          f"rollout (--rollout-batch-size {cfg.rollout_batch_size} x --n-samples-per-prompt "
                          f"{cfg.n_samples_per_prompt}): every optimizer step must take the same number of samples; "
                          f"use a divisor of {rollout}")


def check_job(cfg: JobConfig, sft: bool = False) -> None:
    """What a job needs beyond well-formed values, checked by every entry point (``relay
    plan / train / sbatch``, ``python -m launcher``) before any process starts: a judge for
    ``--rm-type dapo-genrm``, a reward when it trains, readable self-check pairs
    (``--genrm-self-check-data``), and every ``module.func`` flag
    importable now (from ``sys.path``: the entry points put the working directory first, as
    ``python -m`` does). ``sft``: only the trainer runs, so rewards and hooks are not used."""
    check_trackers(cfg)
    if sft:
        return
    check_training_math(cfg)
    if cfg.rm_type == "dapo-genrm" and not cfg.custom_rm_path and not cfg.genrm:
        raise ConfigError(
            "--rm-type dapo-genrm scores every sample with a judge, and this config has none: add a genrm model "
            "(--genrm-model-path PATH with a 'genrm' entry in --resource or --genrm-num-gpus N) or judge instances "
            '(--genrm-instances \'{"route_key": {"model_path": ..., "num_gpus": N}}\'), '
            "or use a reward without a judge (--rm-type dapo)"
        )
    if cfg.rm_type == "dapo-genrm" and not cfg.custom_rm_path and len(cfg.genrm) > 1:
        raise ConfigError(
            f"--rm-type dapo-genrm asks one judge without a route_key, and this config has {len(cfg.genrm)} judge "
            f"instances ({', '.join(sorted(cfg.genrm))}): it cannot pick one. Score with a --custom-rm-path "
            "function that passes route_key=... to the judge client (docs/judge.md, 'Client for reward code'), "
            "or keep one instance"
        )
    if cfg.engine == "torch":
        check_builtin_engine_config(cfg)
    if cfg.prompt_data and not cfg.custom_rm_path and cfg.rm_type is None:
        raise ConfigError(
            "training needs a reward: set --rm-type (dapo, dapo-genrm, dummy) or --custom-rm-path module.func"
        )
    if cfg.genrm_self_check_data:
        from reward.integrity import load_checks

        try:
            load_checks(cfg.genrm_self_check_data)
        except OSError as e:
            raise ConfigError(f"--genrm-self-check-data {cfg.genrm_self_check_data}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigError(str(e)) from None
    from reward.rewards import load_callable

    for name in user_code_flags():
        path = getattr(cfg, name)
        if path is not None:
            try:
                load_callable(path, "--" + name.replace("_", "-"))
            except ValueError as e:
                raise ConfigError(str(e)) from None


def check_builtin_engine_config(cfg: JobConfig) -> None:
    """What the built-in engine does with a judge's ``engine_config``: ``ep_size`` groups of
    each engine's GPUs share out a MoE model's experts (where it divides them; otherwise, and
    for a dense model, it is not used: a warning says so); ``dp_size`` (SGLang's data-parallel
    attention inside one tensor-parallel engine) is refused, naming ``--engine sglang``;
    ``pp_size`` (SGLang's) is not used: a warning says so."""
    for name, inst in cfg.genrm.items():
        where = f"GenRM instance {name!r} (engine_config)"
        dp, pp, ep = (inst.engine_config.get(k, 1) for k in ("dp_size", "pp_size", "ep_size"))
        for key, value in (("dp_size", dp), ("pp_size", pp), ("ep_size", ep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {key} must be a positive integer, got {value!r}")
        if dp > 1:
            raise ConfigError(
                f"{where}: dp_size {dp} is SGLang's data-parallel attention inside one tensor-parallel engine of "
                f"{inst.num_gpus_per_engine} GPUs; the built-in engine does not run it. Use --engine sglang, or drop "
                "dp_size (for more judge engines, give each fewer GPUs: --genrm-num-gpus-per-engine)")
        if pp > 1:
            log.warning("%s: pp_size %s is for --engine sglang; the built-in engine runs each engine "
                        "tensor-parallel over its GPUs", where, pp)
        if inst.num_gpus_per_engine % ep:
            log.warning("%s: ep_size %s does not divide the engine's %s GPUs: the built-in engine runs it without "
                        "expert parallelism", where, ep, inst.num_gpus_per_engine)


def check_trackers(cfg: JobConfig) -> None:
    """ConfigError naming the flag and what to install, for a tracker whose package is missing."""
    for flag, wanted, module in (("--use-tensorboard", cfg.use_tensorboard, "tensorboard"),
                                 ("--use-wandb", cfg.use_wandb, "wandb")):
        if wanted and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} needs the {module} package, which is not installed: pip install "
                              f"'relay-rl[trackers]' (or pip install {module})")
