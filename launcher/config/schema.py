"""The job's typed configuration: YAML (torchrun_configs/*.yaml) plus command-line overrides
that use the original system's flag names (``--resource``, ``--genrm-instances``, ...).

Precedence: dataclass defaults < YAML < flags. ``${VAR}`` (or ``${VAR:-default}``) in YAML
strings is replaced from the environment. An unknown key or flag is an error naming the
closest valid one; a bad value says which key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from launcher.config.rules import (
    GenRMInstance,
    resolve_genrm_instances,
)

log = logging.getLogger("relay.config")

def _opt(
    default: Any = None,
    *,
    help: str = "",
    choices: tuple | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    user_code: bool = False,
    **kw,
):
    """A config field; ``user_code``: its value is a ``module.func`` path imported at validation."""
    meta = {"help": help, "choices": choices, "min": minimum, "max": maximum, "user_code": user_code}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: json.loads(json.dumps(d)), metadata=meta)
    return field(default=default, metadata=meta, **kw)


@dataclass
class JobConfig:
    # ---- layout and hardware
    log_level: str = _opt("warning", help="the level of the relay.* logs on the console and in the workers' log files",
                          choices=("debug", "info", "warning", "error"))
    resource: dict = _opt(
        {}, help='JSON {role: [num_groups, gpus_per_group]}, e.g. {"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 4]}'
    )
    colocate: bool = _opt(
        False, help="actor, rollout and judge share the actor's GPUs, swapping memory around training"
    )
    fully_async: bool = _opt(
        False, help="dedicated GPU pools per role; rollout keeps generating while the trainer trains"
    )
    device: str = _opt(
        "cuda", help="cuda, or cpu (virtual GPU bundles; every layout runs on a laptop)", choices=("cuda", "cpu")
    )
    gpus_per_node: int = _opt(8, help="GPU bundles per node (on cpu: virtual bundles)", minimum=1)
    gpu_memory_gb: float | None = _opt(None, help="GiB of one GPU, for the plan's memory fit (default: this machine's "
                                       "GPU 0; without one the fit is not checked)", minimum=1)
    nnodes: int | None = _opt(
        None, help="number of nodes (default: torchrun's, or the fewest that fit --resource)", minimum=1
    )
    engine: str = _opt("torch", help="inference engine backend", choices=("torch", "sglang"))
    network_interface: str | None = _opt(
        None,
        help="network interface (e.g. ib0) for relay's sockets (RELAY_HOST) and NCCL/Gloo (NCCL_SOCKET_IFNAME, "
             "GLOO_SOCKET_IFNAME) on every node",
    )
    # ---- rollout
    rollout_num_gpus: int | None = _opt(None, help="GPUs for rollout engines (default: from --resource)", minimum=0)
    rollout_num_gpus_per_engine: int = _opt(1, help="GPUs per rollout engine (tensor parallel size)", minimum=1)
    sglang_mem_fraction_static: float = _opt(
        0.5, help="share of GPU memory a rollout engine reserves for weights + KV cache", minimum=0.0
    )
    n_samples_per_prompt: int = _opt(1, help="samples per prompt (the GRPO group size)", minimum=1)
    rollout_batch_size: int = _opt(32, help="prompts per rollout step", minimum=1)
    global_batch_size: int | None = _opt(
        None, help="samples per optimizer step (default: a rollout's, --rollout-batch-size x "
        "--n-samples-per-prompt: one step per rollout, as the original); relay sft: rows per step", minimum=1)
    rollout_max_response_len: int = _opt(1024, help="max new tokens per rollout sample", minimum=1)
    rollout_temperature: float = _opt(1.0, help="rollout sampling temperature", minimum=0.0)
    rollout_top_p: float = _opt(1.0, help="rollout nucleus sampling", minimum=0.0)
    max_staleness: int = _opt(0, help="fully-async: how many weight versions a sample may lag", minimum=0)
    num_rollout: int = _opt(1, help="training steps (rollout + train) to run", minimum=0)
    kv_cache_tokens: int = _opt(
        16384, help="cpu engines: KV-cache capacity in tokens (on GPU it comes from the memory fraction)", minimum=16
    )
    update_weight_buffer_size: int = _opt(512 << 20, help="weight-sync bucket size in bytes", minimum=1)
    # ---- GenRM (the judge)
    genrm_model_path: str | None = _opt(None, help="legacy single judge: becomes the '__default__' instance")
    genrm_num_gpus: int | None = _opt(None, help="GPUs of the legacy judge (default: from --resource)", minimum=0)
    genrm_num_gpus_per_engine: int = _opt(1, help="GPUs per judge engine", minimum=1)
    genrm_engine_config: dict = _opt(
        {}, help="JSON: max_context_len, dp_size, pp_size, ep_size, mem_fraction_static, ..."
    )
    genrm_sampling_config: dict = _opt(
        {}, help="JSON: temperature, top_p, top_k, max_response_len, chat_template_kwargs"
    )
    genrm_instances: dict = _opt(
        {}, help="JSON {route_key: {model_path, num_gpus, num_gpus_per_engine?, engine_config?, sampling_config?}}"
    )
    # ---- rewards
    rm_type: str | None = _opt(
        None, help="reward type", choices=(None, "dapo", "dapo-genrm", "dummy", "math-verify"))
    reward_key: str | None = _opt(None, help="key of the reward dict to train on")
    custom_generate_function_path: str | None = _opt(
        None, help="module.func: an async rollout (args, sample, sampling_params) -> sample, slime's contract "
        "(multi-turn, tools; generating through args.sglang_router_ip:port)", user_code=True)
    custom_rm_path: str | None = _opt(
        None,
        help="module.func of a custom reward (args, sample) -> float | dict; imported from the working directory first",
        user_code=True,
    )
    custom_reward_post_process_path: str | None = _opt(
        None,
        help="module.func hook (args, samples) -> (raw, normalized), used by defer-swap; imported from the working "
             "directory first",
        user_code=True,
    )
    defer_reward_to_post_process: bool = _opt(
        False, help="score the whole batch after rollout (Shared layout: defer-swap)"
    )
    reward_max_concurrency: int = _opt(64, help="reward calls in flight at most", minimum=1)
    genrm_prompt_template: str | None = _opt(
        None,
        help="dapo-genrm judge prompt: a format string with {question}, {label}, {answer} (default: the dapo-genrm "
             "prompt)",
    )
    genrm_gateway_port: int = _opt(
        8000, help="port of the judge's HTTP gateway on 127.0.0.1 (0: any free port)", minimum=0, maximum=65535
    )
    genrm_gateway_header_timeout: float = _opt(
        10.0, help="judge gateway: seconds a client may take to send a request's headers (then 408)", minimum=0.001
    )
    genrm_gateway_body_timeout: float = _opt(
        30.0, help="judge gateway: seconds a client may take to send a request's body (then 408)", minimum=0.001
    )
    genrm_gateway_idle_timeout: float = _opt(
        60.0, help="judge gateway: seconds a connection may stay open without a request", minimum=0.001
    )
    genrm_gateway_max_connections: int = _opt(
        512, help="judge gateway: open connections at most (one more gets 503 and is closed)", minimum=1
    )
    genrm_gateway_max_body: int = _opt(
        1 << 20,
        help="judge gateway: request body bytes at most (a larger declared length gets 413 at once)",
        minimum=1024,
    )
    genrm_gateway_unhealthy_503: bool = _opt(
        False, help="GET /genrm/health answers 503 when an instance cannot serve (default: 200 and the body saying "
        "so, as the original)")
    genrm_parse: str = _opt(
        "strict",
        help="dapo-genrm verdict parsing: strict (only an exact '1' scores) or loose",
        choices=("strict", "loose"),
    )
    genrm_reward_variant: str = _opt(
        "documented",
        help="dapo-genrm: documented (the original's documented reward: text after the last 'Answer:', strict "
             "verdict) or boxed (its newer revision: last \\boxed{}, answer gating, in-context examples, loose "
             "verdict)",
        choices=("documented", "boxed"),
    )
    genrm_answer_guard: bool = _opt(
        True, help="dapo-genrm: the judge sees only the final answer region, cut before judge-prompt markers and "
        "chat-template tokens (false: the original's extraction, verbatim; docs/judge-reliability.md)"
    )
    genrm_skip_self_check: bool = _opt(
        False, help="do not check the judge before the first step on known pairs and injection canaries (the job "
        "warns that its judge is unchecked)"
    )
    genrm_self_check_data: str | None = _opt(
        None, help="JSONL of self-check pairs {question, label, response, expected: 1|0} used instead of the "
        "built-in ones (made from --prompt-data)"
    )
    genrm_canary_interval: int = _opt(
        10, help="score the injection canaries again every N steps (0: only before the first step)", minimum=0
    )
    genrm_audit_rate: float = _opt(
        0.1, help="share of judged samples with a numeric label that the rule grader also grades (0: no audit)",
        minimum=0.0, maximum=1.0,
    )
    genrm_audit_grader: str = _opt(
        "rule", help="the drift audit's grader: rule (numbers only: the built-in rule grader), dapo (the DAPO "
        "reference grader) or math-verify (the math-verify package: any label)",
        choices=("rule", "dapo", "math-verify"),
    )
    genrm_audit_min_agreement: float = _opt(
        0.8, help="drift alarm: judge and rule grader agree on fewer than this share of audited samples", minimum=0.0,
        maximum=1.0,
    )
    genrm_audit_max_gap: float = _opt(
        0.2, help="drift alarm: judge accuracy and rule accuracy on the audited samples differ by more", minimum=0.0
    )
    # ---- GRPO
    advantage_estimator: str = _opt("grpo", help="advantage estimator", choices=("grpo",))
    use_kl_loss: bool = _opt(False, help="add a KL loss against the reference model")
    kl_loss_coef: float = _opt(0.0, help="KL loss coefficient", minimum=0.0)
    kl_loss_type: str = _opt("k1", help="KL estimator", choices=("k1", "k2", "k3", "low_var_kl"))
    eps_clip: float = _opt(0.2, help="PPO clip (low side)", minimum=0.0)
    eps_clip_high: float | None = _opt(None, help="PPO clip (high side; default: --eps-clip)", minimum=0.0)
    eps_clip_c: float | None = _opt(None, help="dual-clip constant (> 1)", minimum=1.0)
    use_tis: bool = _opt(False, help="truncated importance sampling against rollout log-probs")
    tis_clip: float = _opt(2.0, help="TIS upper clamp", minimum=0.0)
    tis_clip_low: float = _opt(0.0, help="TIS lower clamp", minimum=0.0)
    entropy_coef: float = _opt(0.0, help="entropy bonus coefficient (train/entropy is logged whatever it is)",
                               minimum=0.0)
    calculate_per_token_loss: bool = _opt(
        False, help="the loss is the mean over the step's response tokens (default: each sample's token-mean, "
        "averaged over the step's samples, as the original)")
    disable_rewards_normalization: bool = _opt(False, help="advantages are the raw rewards (no group mean or std)")
    disable_grpo_std_normalization: bool = _opt(
        False, help="advantages are rewards minus their group's mean, not divided by its std (Dr. GRPO)")
    micro_batch_tokens: int | None = _opt(
        None,
        help="trainer: padded tokens per forward/backward pass (gradients accumulate over micro-batches; the "
        "gradient is the same whatever it is). Default: sized by the trainer on its GPU, the most (up to 32,768) "
        "whose activations fit in 80% of it beside the trainer's state; 8,192 on CPU",
        minimum=1,
    )
    tensor_model_parallel_size: int = _opt(
        1, help="trainer tensor parallel size (the rest of the actor GPUs is data parallel)", minimum=1
    )
    expert_model_parallel_size: int = _opt(
        1,
        help="trainer expert parallel size (MoE models): the experts split over this many data-parallel ranks; "
        "divides the experts and the data-parallel size",
        minimum=1,
    )
    moe_aux_loss_coeff: float = _opt(
        0.0, help="trainer (MoE): coefficient of the router's load-balancing loss (Switch aux loss; 0 = off)",
        minimum=0.0,
    )
    # ---- optimizer
    optimizer: str = _opt("adam", help="optimizer", choices=("adam", "adamw"))
    lr: float = _opt(1e-6, help="learning rate", minimum=0.0)
    lr_decay_style: str = _opt("constant", help="learning-rate schedule", choices=("constant", "cosine"))
    lr_warmup_iters: int = _opt(0, help="warm-up steps", minimum=0)
    weight_decay: float = _opt(0.0, help="weight decay (norms and biases are exempt, as in Megatron)", minimum=0.0)
    adam_beta1: float = _opt(0.9, help="Adam beta1", minimum=0.0, maximum=1.0)
    adam_beta2: float = _opt(0.999, help="Adam beta2", minimum=0.0, maximum=1.0)
    adam_eps: float = _opt(1e-8, help="Adam epsilon", minimum=0.0)
    clip_grad: float = _opt(1.0, help="gradient-norm clip", minimum=0.0)
    bf16: bool = _opt(False, help="trainer: bf16 params with fp32 master weights (Megatron's optimizer); default fp32")
    optimizer_impl: str = _opt(
        "auto",
        help="trainer optimizer: auto = Megatron's distributed optimizer when DP > 1 or --bf16, else torch AdamW",
        choices=("auto", "torch", "megatron"),
    )
    # ---- data and model
    prompt_data: str | None = _opt(None, help="training prompts (JSONL)")
    eval_prompt_data: str | None = _opt(
        None, help="evaluation prompts (JSONL); the original's --eval-prompt-data NAME FILE [NAME FILE ...] works too")
    eval_prompt_name: str = _opt("eval", help="the evaluation set's name (the original's --eval-prompt-data NAME FILE)")
    eval_prompt_sets: dict = _opt({}, help="JSON {name: file}: more evaluation sets (metrics eval/<name>/...)")
    eval_interval: int | None = _opt(
        None,
        help="evaluate every N steps (0 or unset: no periodic evaluation; with --eval-prompt-data the job still "
             "evaluates before training and after the last step)",
        minimum=0,
    )
    n_samples_per_eval_prompt: int = _opt(1, help="samples per evaluation prompt", minimum=1)
    eval_max_response_len: int | None = _opt(
        None, help="max new tokens per evaluation sample (default: --rollout-max-response-len)", minimum=1
    )
    eval_temperature: float | None = _opt(
        None, help="evaluation sampling temperature (default: --rollout-temperature, as the original; 0: greedy)",
        minimum=0.0)
    eval_top_p: float = _opt(1.0, help="evaluation nucleus sampling", minimum=0.0)
    skip_eval_before_train: bool = _opt(False, help="do not evaluate before the first step")
    apply_chat_template: bool = _opt(
        False, help="prompts go through the tokenizer's chat template (text prompts become one user turn); default: "
        "off, as the original (a chat prompt's last user turn, as text)")
    chat_template_kwargs: dict = _opt(
        {}, help='JSON passed to the policy\'s chat template, e.g. {"enable_thinking": false}'
    )
    input_key: str = _opt("prompt", help="the prompt's key in --prompt-data / --eval-prompt-data rows")
    label_key: str = _opt("label", help="the reference answer's key in the data rows")
    metadata_key: str = _opt("metadata", help="the key of a data row's metadata object (its entries: sample.metadata)")
    rollout_shuffle: bool = _opt(False, help="prompts in a seeded random order each epoch (default: file order, as the "
                                 "original)")
    rollout_seed: int | None = _opt(None, help="seed of the prompt order and of rollout sampling (default: --seed)")
    recompute_granularity: str | None = _opt(None, help="activation recompute: full (whole layers) or selective "
                                             "(core attention)", choices=(None, "full", "selective"))
    recompute_method: str | None = _opt(None, help="with full recompute: uniform or block",
                                       choices=(None, "uniform", "block"))
    recompute_num_layers: int | None = _opt(None, help="with full recompute: layers per group (uniform) or "
                                            "recomputed layers (block)", minimum=1)
    use_dynamic_batch_size: bool = _opt(False, help="micro-batches of up to --max-tokens-per-gpu tokens, packed "
                                        "without padding")
    max_tokens_per_gpu: int | None = _opt(None, help="with --use-dynamic-batch-size: sets --micro-batch-tokens",
                                          minimum=1)
    eval_reward_key: str | None = _opt(None, help="the reward dict's key for evaluation (default: --reward-key)")
    hf_checkpoint: str | None = _opt(None, help="policy checkpoint directory (HF format)")
    save_interval: int | None = _opt(None, help="save a checkpoint every N steps", minimum=1)
    keep_checkpoints: int = _opt(
        0, help="keep only the newest N complete checkpoints in RUN_DIR/checkpoints (0: keep all)", minimum=0
    )
    resume: bool = _opt(
        False, help="continue from the latest checkpoint in --run-dir (same data order and step numbers)"
    )
    allow_config_changes: bool = _opt(
        False, help="with --resume: continue although keys that change the training differ from RUN_DIR/config.yaml"
    )
    use_fault_tolerance: bool = _opt(
        False,
        help="survive failures: a dead rollout or judge engine is rebuilt (rollout engines with the trainer's current "
        "weights) and the step goes on; a dead trainer worker, node agent or controller restarts the job from its "
        "last checkpoint, at most --max-global-restart times (docs/failures.md)",
    )
    use_health_check: bool = _opt(
        False,
        help="the original system's switch for restarting the job after a failure: here the same as "
        "--use-fault-tolerance (heartbeats are always on: RELAY_HEARTBEAT_*)",
    )
    max_global_restart: int = _opt(
        3, help="with --use-fault-tolerance: restarts of the whole job from its last checkpoint before it stops",
        minimum=0,
    )
    sft_steps: int | None = _opt(
        None, help="relay sft: optimizer steps (default: one pass over --prompt-data)", minimum=1
    )
    save_hf: str | None = _opt(
        None, help="write HF checkpoints here: relay sft the trained model (default: RUN_DIR/hf); relay train "
        "DIR/step_NNNNNN at each checkpoint (--save-interval) and after the last step"
    )
    run_dir: str = _opt("runs/latest", help="where metrics, plots and checkpoints go")
    save_debug_rollout_data: bool = _opt(
        False, help="write each step's samples (prompt, response, reward, the judge's verdict, advantage) to "
        "RUN_DIR/samples/step_NNNNNN.jsonl; the original's form --save-debug-rollout-data PATH sets "
        "--save-debug-rollout-path")
    save_debug_rollout_path: str | None = _opt(
        None, help="where --save-debug-rollout-data writes instead: a path template formatted with {rollout_id} "
        "(the 0-based step); a .pt path gets torch.save({'rollout_id', 'samples': [dict]}) as the original's, "
        "else JSONL")
    use_tensorboard: bool = _opt(False, help="also write the metrics as TensorBoard event files (needs tensorboard)")
    tensorboard_dir: str | None = _opt(None, help="where the TensorBoard event files go (default: RUN_DIR/tb)")
    use_wandb: bool = _opt(False, help="also log the metrics and the resolved config to Weights & Biases (needs wandb)")
    wandb_project: str | None = _opt(None, help="the wandb project")
    wandb_group: str | None = _opt(None, help="the wandb group of the run")
    wandb_run_name: str | None = _opt(None, help="the wandb run's name")
    wandb_team: str | None = _opt(None, help="the wandb entity (team or user)")
    wandb_mode: str | None = _opt(None, help="wandb's mode (default: wandb's own, WANDB_MODE)",
                                  choices=(None, "online", "offline", "disabled"))
    seed: int = _opt(1234, help="random seed")

    # ------------------------------------------------------------------ derived values

    @property
    def eval_sets(self) -> list[tuple[str, str]]:
        """Every evaluation set as (name, file): ``--eval-prompt-data`` (under
        ``--eval-prompt-name``) first, then ``--eval-prompt-sets``."""
        first = [(self.eval_prompt_name, self.eval_prompt_data)] if self.eval_prompt_data else []
        return first + [(name, str(path)) for name, path in self.eval_prompt_sets.items()]

    @property
    def sampling_seed(self) -> int:
        """The seed of the prompt order and of rollout sampling: ``--rollout-seed``, else ``--seed``."""
        return self.seed if self.rollout_seed is None else self.rollout_seed

    @property
    def fault_tolerant(self) -> bool:
        """Failures are survived (see ``use_fault_tolerance``)."""
        return self.use_fault_tolerance or self.use_health_check

    def role_gpus(self, role: str) -> int:
        """GPUs of ``role`` from --resource (num_groups * gpus_per_group); 0 if absent."""
        spec = self.resource.get(role)
        return 0 if spec is None else spec[0] * spec[1]

    @property
    def actor_total(self) -> int:
        return self.role_gpus("actor")

    @property
    def rollout_gpus(self) -> int:
        return self.rollout_num_gpus if self.rollout_num_gpus is not None else self.role_gpus("rollout")

    @property
    def genrm(self) -> dict[str, GenRMInstance]:
        """Judge instances, normalized as the original system does (see :func:`resolve_genrm_instances`)."""
        cached = self.__dict__.get("_genrm")
        if cached is None:
            cached = resolve_genrm_instances(self)
            self.__dict__["_genrm"] = cached
        return cached

    @property
    def genrm_gpus(self) -> int:
        return sum(i.num_gpus for i in self.genrm.values())

    def gateway_limits(self) -> dict:
        """The judge gateway's HTTP limits (:class:`reward.httpd.HttpLimits` fields)."""
        return {k: getattr(self, f"genrm_gateway_{k}")
                for k in ("header_timeout", "body_timeout", "idle_timeout", "max_connections", "max_body")}


FIELDS = {f.name: f for f in dataclasses.fields(JobConfig)}


def _topics() -> dict[str, list[str]]:
    """The config's topics, as JobConfig's ``# ---- topic`` sections give them, in order."""
    import inspect
    import re

    topics: dict[str, list[str]] = {}
    current = "general"
    for line in inspect.getsource(JobConfig).splitlines():
        heading = re.match(r"\s+# ---- (.+)$", line)
        if heading:
            current = heading.group(1).strip()
            continue
        name = re.match(r"    (\w+): ", line)
        if name and name.group(1) in FIELDS:
            topics.setdefault(current, []).append(name.group(1))
    return topics


#: topic -> its keys (help groups the flags by these)
TOPICS = _topics()
