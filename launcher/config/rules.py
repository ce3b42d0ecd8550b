"""The rules of a job's configuration beyond each key's type: roles and their GPUs, judge
instances (the legacy single-judge flags and ``--genrm-instances``), sampling values any
engine can run. :mod:`launcher.config` applies them when it builds a config."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, get_args, get_origin

from reward.protocol import DEFAULT_ROUTE, SAMPLING_DEFAULTS

if TYPE_CHECKING:
    from launcher.config.schema import JobConfig

log = logging.getLogger("relay.config")

ROLES = ("actor", "rollout", "genrm", "reference")
#: Roles the original's launch lines name that have nothing to run here: accepted, with a
#: notice at start, and left out of the plan (no GPUs reserved for them).
NO_EFFECT_ROLES = {
    "actor_fwd": "the trainer computes the old log-probs itself",
    "advantages": "the controller computes GRPO advantages (a few numbers per group)",
}
RESERVED_INSTANCE = DEFAULT_ROUTE  # the instance of the legacy single-judge flags

#: The original's flags under another name here.
FLAG_ALIASES = {"num_gpus_per_node": "gpus_per_node", "apply_chat_template_kwargs": "chat_template_kwargs"}
#: The original's flags that change nothing here: accepted (a value when ``takes_value``,
#: else an optional true/false), with a notice once per process saying why.
NO_EFFECT_FLAGS: dict[str, tuple[bool, str]] = {
    "hybrid": (False, "the layout follows --resource, --colocate and --fully-async"),
    "offload_train": (False, "colocated layouts always offload the trainer while engines run"),
    "offload_rollout": (False, "colocated layouts always put the engines to sleep while the trainer trains"),
    "log_passrate": (False, "evaluation always logs eval/accuracy and eval/pass@k"),
    "reward_num_workers": (True, "rewards run as coroutines of the controller, bounded by --reward-max-concurrency"),
    "micro_batch_size": (True, "the trainer packs micro-batches by tokens: --micro-batch-tokens"),
    "save": (True, "checkpoints go to RUN_DIR/checkpoints: set --run-dir"),
    "sglang_config": (True, "the built-in engine takes no SGLang server YAML; SGLang engines take --sglang-* flags"),
    "train_memory_margin_bytes": (True, "engines size their KV cache from the memory left after the trainer offloads"),
    "selective_offload": (False, "the trainer offloads its whole state (weights, gradients, optimizer)"),
    "manual_offload": (False, "the trainer offloads its whole state (weights, gradients, optimizer)"),
    "megatron_to_hf_mode": (True, "the trainer converts its weights to the engines' HF layout itself"),
}
#: The original's flags for features not built here: refused, saying what to use instead.
REFUSED_FLAGS = {
    "reward_runtime": "--reward-runtime (the original's diffusion-reward scorer, not the LLM judge) is not built "
    "here; score with --rm-type or --custom-rm-path",
    "reward_endpoint": "--reward-endpoint (the original's remote diffusion-reward scorer) is not built here; a "
    "--custom-rm-path function can call any endpoint",
    "inference_defer_roles": "--inference-defer-roles (the framework defer variant) is not built here; defer the "
    "judge with --rm-type dummy --defer-reward-to-post-process --custom-reward-post-process-path HOOK (Defer-swap)",
}
_noticed_flags: set = set()


def notice_no_effect(name: str) -> None:
    """Say once per process that the original's flag ``--name`` has no effect here, and why."""
    if name not in _noticed_flags:
        _noticed_flags.add(name)
        log.warning("--%s has no effect here: %s", name.replace("_", "-"), NO_EFFECT_FLAGS[name][1])


class ConfigError(ValueError):
    """A configuration the user must change; the message says what."""


@dataclass
class GenRMInstance:
    """One judge deployment (``route_key`` -> this)."""

    name: str
    model_path: str
    num_gpus: int
    num_gpus_per_engine: int = 1
    engine_config: dict = field(default_factory=dict)
    sampling_config: dict = field(default_factory=dict)

    @property
    def mem_fraction_static(self) -> float | None:
        v = self.engine_config.get("mem_fraction_static")
        return None if v is None else float(v)


GENRM_ENGINE_DEFAULTS = {"max_context_len": 8192, "dp_size": 1, "pp_size": 1, "ep_size": 1}
GENRM_SAMPLING_DEFAULTS = {**SAMPLING_DEFAULTS, "chat_template_kwargs": {}}


def resolve_genrm_instances(cfg: JobConfig) -> dict[str, GenRMInstance]:
    """Legacy ``--genrm-model-path`` -> the ``"__default__"`` instance; ``--genrm-instances``
    wins (with a warning) when both are given; ``model_path`` and ``num_gpus`` are required
    per instance (no implicit even split); missing optional keys fall back to the global
    flags; the ``genrm`` entry of ``--resource`` must equal the sum of ``num_gpus``."""
    instances: dict[str, GenRMInstance] = {}
    if cfg.genrm_instances:
        if cfg.genrm_model_path:
            log.warning("both --genrm-instances and --genrm-model-path are set: using --genrm-instances")
        if not isinstance(cfg.genrm_instances, dict):
            raise ConfigError("--genrm-instances must be a JSON object {route_key: {model_path, num_gpus, ...}}")
        for name, spec in cfg.genrm_instances.items():
            if name == RESERVED_INSTANCE:
                raise ConfigError(
                    f"--genrm-instances: the key '{RESERVED_INSTANCE}' is reserved for --genrm-model-path; choose "
                    f"another route_key"
                )
            if not isinstance(spec, dict):
                raise ConfigError(f"--genrm-instances[{name!r}] must be an object, got {type(spec).__name__}")
            for key in ("model_path", "num_gpus"):
                if key not in spec:
                    raise ConfigError(f"--genrm-instances[{name!r}]: missing required key '{key}'")
            unknown = set(spec) - {"model_path", "num_gpus", "num_gpus_per_engine", "engine_config", "sampling_config"}
            if unknown:
                raise ConfigError(f"--genrm-instances[{name!r}]: unknown keys {sorted(unknown)}")
            instances[name] = GenRMInstance(
                name,
                str(spec["model_path"]),
                positive_int(spec["num_gpus"], f"--genrm-instances[{name!r}].num_gpus"),
                positive_int(
                    spec.get("num_gpus_per_engine", cfg.genrm_num_gpus_per_engine),
                    f"--genrm-instances[{name!r}].num_gpus_per_engine",
                ),
                {**GENRM_ENGINE_DEFAULTS, **cfg.genrm_engine_config, **spec.get("engine_config", {})},
                {**GENRM_SAMPLING_DEFAULTS, **cfg.genrm_sampling_config, **spec.get("sampling_config", {})},
            )
    elif cfg.genrm_model_path:
        # the original's default: --resource's genrm entry, else --genrm-num-gpus, else 1
        num = cfg.genrm_num_gpus if cfg.genrm_num_gpus is not None else (cfg.role_gpus("genrm") or 1)
        instances[RESERVED_INSTANCE] = GenRMInstance(
            RESERVED_INSTANCE,
            cfg.genrm_model_path,
            num,
            cfg.genrm_num_gpus_per_engine,
            {**GENRM_ENGINE_DEFAULTS, **cfg.genrm_engine_config},
            {**GENRM_SAMPLING_DEFAULTS, **cfg.genrm_sampling_config},
        )
    if instances and "genrm" in cfg.resource:
        total = sum(i.num_gpus for i in instances.values())
        if cfg.role_gpus("genrm") != total:
            raise ConfigError(
                f"--resource genrm has {cfg.role_gpus('genrm')} GPUs, which must equal the sum of the "
                f"GenRM instances' num_gpus ({total}: "
                + ", ".join(f"{k}={v.num_gpus}" for k, v in instances.items())
                + ")"
            )
    for inst in instances.values():
        if inst.num_gpus % inst.num_gpus_per_engine:
            raise ConfigError(
                f"GenRM instance {inst.name!r}: num_gpus {inst.num_gpus} is not a multiple of num_gpus_per_engine "
                f"{inst.num_gpus_per_engine}"
            )
        mf = inst.mem_fraction_static
        if mf is not None and not 0 < mf < 1:
            raise ConfigError(
                f"GenRM instance {inst.name!r}: engine_config.mem_fraction_static must be in (0, 1), got {mf}"
            )
    return instances


def positive_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"{what} must be a positive integer, got {v!r}")
    return v


# ------------------------------------------------------------------ loading


_noticed: set = set()  # roles whose notice this process has given


def check_resource(resource: dict) -> None:
    """Validate ``--resource`` and drop the roles that have no effect here (a notice once
    per process for each)."""
    for role, spec in list(resource.items()):
        if role == "critic":
            raise ConfigError(
                "--resource: this system trains without a critic (GRPO advantages need none); remove 'critic'"
            )
        if role not in ROLES and role not in NO_EFFECT_ROLES:
            match = difflib.get_close_matches(role, [*ROLES, *NO_EFFECT_ROLES], n=1)
            hint = f"; did you mean '{match[0]}'?" if match else ""
            raise ConfigError(f"--resource: unknown role {role!r} (roles: {', '.join(ROLES)}){hint}")
        ok = (
            isinstance(spec, list)
            and len(spec) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in spec)
        )
        if not ok:
            raise ConfigError(
                f"--resource[{role!r}] must be [num_groups, gpus_per_group] (non-negative integers), got {spec!r}"
            )
        if role in NO_EFFECT_ROLES:
            del resource[role]
            if role not in _noticed:
                _noticed.add(role)
                log.warning(
                    "--resource %r has no effect here (%s): no GPUs are reserved for it", role, NO_EFFECT_ROLES[role]
                )
        elif spec[0] * spec[1] == 0:
            raise ConfigError(f"--resource[{role!r}] has 0 GPUs; give every role at least one")


def check_judge_audit(cfg: JobConfig) -> None:
    """The judge audit's shares are fractions."""
    for name in ("genrm_audit_rate", "genrm_audit_min_agreement", "genrm_audit_max_gap"):
        if not 0 <= getattr(cfg, name) <= 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be between 0 and 1, got {getattr(cfg, name)}")


def check_debug_rollout_path(cfg: JobConfig) -> None:
    """``--save-debug-rollout-path`` formats with ``{rollout_id}`` alone (checked before the
    first step, not when the first file is written)."""
    template = cfg.save_debug_rollout_path
    if template is None:
        return
    try:
        template.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"--save-debug-rollout-data / --save-debug-rollout-path {template!r}: a path template "
                          f"takes {{rollout_id}} only "
                          f"({type(e).__name__}: {e})") from None


def check_sampling(cfg: JobConfig) -> None:
    """Rollout, eval and judge sampling with the engines' own check (SamplingParams.validate):
    a value no engine can run fails at load time, naming the flag."""
    from engines.interface import SamplingParams

    for flags, values in (
        (
            "--rollout-temperature/--rollout-top-p/--rollout-max-response-len",
            {
                "temperature": cfg.rollout_temperature,
                "top_p": cfg.rollout_top_p,
                "max_new_tokens": cfg.rollout_max_response_len,
            },
        ),
        ("--eval-temperature/--eval-top-p", {"temperature": cfg.eval_temperature, "top_p": cfg.eval_top_p}),
    ):
        try:
            SamplingParams.from_dict(values)
        except ValueError as e:
            raise ConfigError(f"{flags}: {e}") from None
    for inst in cfg.genrm.values():  # normalizes the judge instances too: errors surface at load time
        try:
            if inst.sampling_config.get("n", 1) != 1:
                raise ValueError("n must be 1: the judge answers each request with one verdict")
            SamplingParams.from_dict(inst.sampling_config)
        except ValueError as e:
            raise ConfigError(f"GenRM instance {inst.name!r}: sampling_config (--genrm-sampling-config): {e}") from None


def coerce_value(f: dataclasses.Field, value: Any) -> Any:
    """Check (and convert) ``value`` for the config field ``f``; raise a ConfigError saying
    what is allowed."""
    name = f.name
    tp = f.type if not isinstance(f.type, str) else eval(f.type, {})  # noqa: S307 (our own annotations)
    optional = get_origin(tp) is not None and type(None) in get_args(tp)
    base = next((a for a in get_args(tp) if a is not type(None)), tp) if optional else tp
    flag = "--" + name.replace("_", "-")
    if value is None or (optional and base is str and value == ""):  # '--flag ""' unsets a YAML value
        if optional:
            return None
        raise ConfigError(f"{flag} cannot be empty")
    if base is bool:
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            value = value.lower() in ("true", "1", "yes", "on")
        if not isinstance(value, bool):
            raise ConfigError(f"{flag} must be true or false, got {value!r}")
    elif base in (int, float):
        kind, allowed = ("an integer", (int,)) if base is int else ("a number", (int, float))
        if isinstance(value, str):
            try:
                value = base(value)
            except ValueError:
                raise ConfigError(f"{flag} must be {kind}, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise ConfigError(f"{flag} must be {kind}, got {value!r}")
        value = base(value)
        if base is float and not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value!r}")
    elif base is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as e:
                raise ConfigError(f"{flag} must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{flag} must be a JSON object, got {type(value).__name__}")
    elif base is str:
        if not isinstance(value, str):
            value = str(value)
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        allowed = ", ".join(str(c) for c in choices if c is not None)
        raise ConfigError(f"{flag} must be one of: {allowed}; got {value!r}")
    minimum, maximum = f.metadata.get("min"), f.metadata.get("max")
    low = minimum is not None and isinstance(value, (int, float)) and value < minimum
    high = maximum is not None and isinstance(value, (int, float)) and value > maximum
    if low or high:
        allowed = (f"between {minimum:g} and {maximum:g}" if minimum is not None and maximum is not None
                   else f">= {minimum:g}" if low else f"<= {maximum:g}")
        raise ConfigError(f"{flag} must be {allowed}, got {value!r}")
    return value


#: HF model types of hybrid linear-attention models (the trainer trains them without tensor parallel)
HYBRID_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_text")


def check_expert_parallel(cfg: JobConfig) -> None:
    """``--expert-model-parallel-size`` must divide the trainer's data-parallel size (actor
    GPUs / tensor parallel size) and, where the policy checkpoint's config.json is readable
    now, its expert count (a dense checkpoint takes only 1); a MoE or hybrid (Qwen3.5)
    policy trains with TP 1. A clear ConfigError otherwise."""
    import os

    ep, tp = cfg.expert_model_parallel_size, cfg.tensor_model_parallel_size
    path = os.path.join(cfg.hf_checkpoint or "", "config.json")
    if cfg.hf_checkpoint and os.path.isfile(path) and tp > 1:
        with open(path) as f:
            model_type = json.load(f).get("model_type")
        if model_type in HYBRID_TYPES:
            raise ConfigError(f"{cfg.hf_checkpoint} is a {model_type} hybrid model (Gated DeltaNet linear attention): "
                              f"the Megatron trainer trains it without tensor parallel (its TP layers serve "
                              f"log-probs and export; training them needs sequence parallelism); use "
                              f"--tensor-model-parallel-size 1 (got {tp}), data and expert parallel work")
    if ep == 1 and tp == 1:
        return
    actor = cfg.actor_total
    if actor and actor % tp == 0 and (actor // tp) % ep:
        raise ConfigError(
            f"--expert-model-parallel-size {ep} must divide the trainer's data-parallel size {actor // tp} "
            f"({actor} actor GPUs / --tensor-model-parallel-size {tp}): experts split over data-parallel ranks"
        )
    if not cfg.hf_checkpoint or not os.path.isfile(path):
        return  # built on first use, or checked when the trainer loads it
    with open(path) as f:
        d = json.load(f)
    d = d.get("text_config", d)
    experts = d.get("num_experts", d.get("num_local_experts", 0)) or 0
    if experts and tp > 1:
        from engines.trainer.actor import MOE_TP_TRAINING

        raise ConfigError(f"{cfg.hf_checkpoint} is a mixture-of-experts model: {MOE_TP_TRAINING}")
    if ep == 1:
        return
    if not experts:
        raise ConfigError(
            f"--expert-model-parallel-size {ep}: {cfg.hf_checkpoint} is a dense model (no experts); use 1"
        )
    if experts % ep:
        raise ConfigError(
            f"--expert-model-parallel-size {ep} must divide the {experts} experts of {cfg.hf_checkpoint}"
        )


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: Any) -> Any:
    """``${VAR}`` / ``${VAR:-default}`` in a YAML config's strings, from the environment."""
    if isinstance(value, str):
        return _VAR.sub(
            lambda m: os.environ.get(m.group(1), m.group(2) if m.group(2) is not None else m.group(0)), value
        )
    if isinstance(value, list):
        return [expand_env(v) for v in value]
    if isinstance(value, dict):
        return {k: expand_env(v) for k, v in value.items()}
    return value


def two_values(argv: list[str], i: int) -> bool:
    """``argv[i]`` is followed by two values (not flags): the original's ``--eval-prompt-data NAME FILE``."""
    return i + 2 < len(argv) and not argv[i + 1].startswith("--") and not argv[i + 2].startswith("--")


def settle_defaults(cfg) -> None:
    """The defaults that depend on other flags, as the original derives them; ConfigError
    where they contradict."""
    if cfg.eps_clip_high is None:
        cfg.eps_clip_high = cfg.eps_clip
    if cfg.eval_temperature is None:  # the original evaluates at the rollout temperature unless told otherwise
        cfg.eval_temperature = cfg.rollout_temperature
    if not 0 < cfg.sglang_mem_fraction_static < 1:
        raise ConfigError(f"--sglang-mem-fraction-static must be in (0, 1), got {cfg.sglang_mem_fraction_static}")
    if cfg.use_dynamic_batch_size:  # the original's names for a token budget per micro-batch
        if cfg.max_tokens_per_gpu is None:
            raise ConfigError("--use-dynamic-batch-size needs --max-tokens-per-gpu N (tokens per micro-batch)")
        cfg.micro_batch_tokens = cfg.max_tokens_per_gpu
    if cfg.global_batch_size is None:  # the original: one optimizer step per rollout
        cfg.global_batch_size = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    if cfg.global_batch_size % cfg.n_samples_per_prompt:
        raise ConfigError(
            f"--global-batch-size ({cfg.global_batch_size}) must be a multiple of --n-samples-per-prompt "
            f"({cfg.n_samples_per_prompt}): GRPO groups are never split across optimizer steps"
        )
    if cfg.recompute_granularity == "full" and (cfg.recompute_method is None or cfg.recompute_num_layers is None):
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform|block and "
                          "--recompute-num-layers N (Megatron's rule: uniform recomputes groups of N layers, block "
                          "the first N layers of each stage)")
