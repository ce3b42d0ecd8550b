"""Loading a job's configuration: YAML (torchrun_configs/*.yaml, shipped, or a path) plus
command-line overrides that use the original system's flag names (``--resource``,
``--genrm-instances``, ...), validated into a :class:`~launcher.config.schema.JobConfig`.

Precedence: dataclass defaults < YAML < flags. ``${VAR}`` (or ``${VAR:-default}``) in YAML
strings is replaced from the environment. An unknown key or flag is an error naming the
closest valid one; a bad value says which key and what is allowed.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from launcher.config.rules import (
    FLAG_ALIASES,
    NO_EFFECT_FLAGS,
    REFUSED_FLAGS,
    ConfigError,
    check_debug_rollout_path,
    check_expert_parallel,
    check_judge_audit,
    check_resource,
    check_sampling,
    coerce_value,
    expand_env,
    notice_no_effect,
    settle_defaults,
    two_values,
)
from launcher.config.schema import FIELDS, JobConfig

#: the shipped configs (``--config NAME``): package data (the checkout's top-level
#: ``torchrun_configs`` is a link to them)
SHIPPED_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrun_configs")


def _closest(name: str) -> str:
    match = difflib.get_close_matches(name, list(FIELDS), n=1, cutoff=0.8)
    return f"; did you mean '{match[0]}' (--{match[0].replace('_', '-')})?" if match else ""


def build_config(values: dict[str, Any]) -> JobConfig:
    """A JobConfig from a mapping of field (or flag) names to values, validated."""
    clean: dict[str, Any] = {}
    for key, value in values.items():
        name = key.lstrip("-").replace("-", "_")
        name = FLAG_ALIASES.get(name, name)
        if name in REFUSED_FLAGS:
            raise ConfigError(REFUSED_FLAGS[name])
        if name in NO_EFFECT_FLAGS:
            notice_no_effect(name)
            continue
        if name not in FIELDS:
            raise ConfigError(f"unknown config key {key!r}{_closest(name)}")
        clean[name] = coerce_value(FIELDS[name], value)
    cfg = JobConfig(**clean)
    check_resource(cfg.resource)
    settle_defaults(cfg)
    if cfg.genrm_prompt_template is not None:
        from reward.dapo_genrm import check_template

        try:
            check_template(cfg.genrm_prompt_template)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    check_sampling(cfg)
    check_judge_audit(cfg)
    check_debug_rollout_path(cfg)
    check_expert_parallel(cfg)
    return cfg


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """``--flag value`` / ``--flag=value`` / bare ``--bool-flag`` pairs -> {field: raw value}.
    The original system's flags are taken too: its names for ours (``FLAG_ALIASES``), the
    ones without effect here (kept for :func:`build_config`'s notice), ``--eval-prompt-data
    NAME FILE``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --name value")
        key, eq, val = arg[2:].partition("=")
        name = FLAG_ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name in REFUSED_FLAGS:
            raise ConfigError(REFUSED_FLAGS[name])
        if name == "eval_prompt_data" and not eq and two_values(argv, i):
            out["eval_prompt_name"], out[name] = argv[i + 1], argv[i + 2]  # the original's NAME FILE form
            i += 3
            more = {}
            while two_values(argv, i - 1):  # NAME FILE NAME FILE ...: the sets after the first
                more[argv[i]] = argv[i + 1]
                i += 2
            if more:
                out["eval_prompt_sets"] = more
            continue
        if name not in FIELDS and name not in NO_EFFECT_FLAGS:
            raise ConfigError(f"unknown flag --{key}{_closest(name)}")
        is_bool = name in NO_EFFECT_FLAGS and not NO_EFFECT_FLAGS[name][0]
        if name in FIELDS:
            is_bool = FIELDS[name].type in (bool, "bool")
        if name == "save_debug_rollout_data" and debug_rollout_template(val if eq else _next(argv, i)):
            out[name], out["save_debug_rollout_path"] = True, val if eq else argv[i + 1]  # the original's PATH form
            i += 1 if eq else 2
            continue
        if eq:
            out[name] = val
            i += 1
        elif is_bool and (i + 1 >= len(argv) or argv[i + 1].startswith("--")):
            out[name] = True
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value")
            out[name] = argv[i + 1]
            i += 2
    return out


def _next(argv: list[str], i: int) -> str | None:
    return argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None


def debug_rollout_template(value: str | None) -> bool:
    """Whether ``--save-debug-rollout-data``'s value is the original's path template rather
    than a boolean."""
    return value is not None and value.lower() not in ("true", "1", "yes", "on", "false", "0", "no", "off")


def load_config(path: str | list[str] | tuple | None, overrides: list[str] | dict | None = None) -> JobConfig:
    """Load a YAML config, or several layered in order (a later file's keys over an earlier's;
    ``path`` may be None), and apply command-line overrides."""
    values: dict[str, Any] = {}
    for one in ([path] if isinstance(path, str) else list(path or [])):
        values.update(_read_yaml(one))
    if isinstance(overrides, dict):
        values.update(overrides)
    elif overrides:
        values.update(parse_overrides(overrides))
    return build_config(values)


def _read_yaml(path: str) -> dict:
    import yaml

    if not os.path.exists(path):
        candidate = os.path.join(SHIPPED_CONFIGS, path if path.endswith(".yaml") else path + ".yaml")
        if os.path.exists(candidate):
            path = candidate
        else:
            raise ConfigError(f"config file {path!r} not found (the shipped configs are in torchrun_configs/)")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return expand_env(data)


def config_yaml(cfg: JobConfig) -> str:
    """``cfg`` as a YAML config that loads back to it (every key set, in schema order; unset
    keys left out): what ``RUN_DIR/config.yaml`` and ``relay train --print-config`` hold."""
    import yaml

    values = {name: getattr(cfg, name) for name in FIELDS if getattr(cfg, name) is not None}
    return yaml.safe_dump(values, sort_keys=False, default_flow_style=None, width=100)
