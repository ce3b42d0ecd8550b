"""What a job needs beyond well-formed config values, checked by every entry point before
any process starts."""

from __future__ import annotations

from .config import FIELDS, ConfigError, JobConfig


def user_code_flags() -> list[str]:
    """The fields whose value is a ``module.func`` path (imported by :func:`check_job`)."""
    return [name for name, f in FIELDS.items() if f.metadata.get("user_code")]


def check_job(cfg: JobConfig, sft: bool = False) -> None:
    """What a job needs beyond well-formed values, checked by every entry point (``relay
    plan / train / sbatch``, ``python -m launcher``) before any process starts: a judge for
    ``--rm-type dapo-genrm``, a reward when it trains, readable self-check pairs
    (``--genrm-self-check-data``), and every ``module.func`` flag
    importable now (from ``sys.path``: the entry points put the working directory first, as
    ``python -m`` does). ``sft``: only the trainer runs, so rewards and hooks are not used."""
    if sft:
        return
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
