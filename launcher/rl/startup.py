"""Starting the RL job's roles on the plan's bundles, in the order the layout needs.

Colocated roles share GPU memory, so they start one after another: the trainer loads,
restores a checkpoint (``--resume``) and offloads; in Defer-swap the judge engines load and
go to sleep (weights kept in CPU memory); then the rollout engines (and co-resident judge
engines) load, each sizing its KV cache from the memory left. With dedicated pools every
role loads at once. Then the judge service starts over the judge engines, and the reward
function, the post-process hook and the tokenizer are loaded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..allocator import Plan
from .engine_pool import PooledEngine, all_or_cancel, of_role, spawn_engines
from .judge import Judge, judge_process
from .rollout import RolloutPool, auto_tokenizer, tokenize_prompts
from .trainer_group import TrainerGroup, attach_claim, loss_options


@dataclass
class Roles:
    """What the loop drives. :func:`start_roles` fills it in as each part starts, so that a
    job whose start failed half-way can still be closed (event logs, judge service)."""

    trainer: TrainerGroup | None = None
    reference: TrainerGroup | None = None  # frozen policy for the KL loss (``--use-kl-loss``)
    engines: list[PooledEngine] = field(default_factory=list)  # every engine spawned so far
    judge: Judge | None = None
    rollout: RolloutPool | None = None
    reward_fn: Callable | None = None  # the per-sample reward (reward/rewards.py)
    post_process: Callable | None = None  # ``--custom-reward-post-process-path``


async def ensure_models(cfg) -> None:
    """Build the tiny configs' random models when they are missing (no-op for real paths)."""
    from engines.models.model_builder import ensure_model

    await asyncio.to_thread(ensure_model, cfg.hf_checkpoint, 1)
    for instance in cfg.genrm.values():
        await asyncio.to_thread(ensure_model, instance.model_path, 7)


def prepare_controller(cfg, datasets: list) -> tuple:
    """What the controller needs before the roles start and can do while the workers start
    (in a thread): the trainer actor's module (torch), the reward code, and the policy's
    tokenizer. Returns (the tokenizer, every prompt's token ids keyed as
    :class:`RolloutPool` keeps them)."""
    import engines.trainer.actor  # noqa: F401 (the trainer's spawn names its class)
    import reward.rewards  # noqa: F401

    tokenizer = auto_tokenizer().from_pretrained(cfg.hf_checkpoint)
    return tokenizer, tokenize_prompts(cfg, tokenizer, datasets)


def total_optimizer_steps(cfg) -> int:
    """Optimizer steps of the whole run, for the LR schedule."""
    per_rollout = max(1, cfg.rollout_batch_size * cfg.n_samples_per_prompt // cfg.global_batch_size)
    return max(1, cfg.num_rollout * per_rollout)


def _spawn_trainers(cfg, plan: Plan, workers_by_bundle: dict) -> tuple[TrainerGroup, TrainerGroup | None]:
    actor_claim = next(c for c in plan.claims if c.role == "actor")
    actor_procs = attach_claim(plan, actor_claim, workers_by_bundle, "trainer")
    reference_claim = next((c for c in plan.claims if c.role == "reference"), actor_claim)
    trainer = TrainerGroup.spawn_policy(cfg, actor_procs, actor_claim.size, total_optimizer_steps(cfg),
                                        loss_options(cfg),
                                        reference_beside=cfg.use_kl_loss and reference_claim is actor_claim)
    if not cfg.use_kl_loss:  # with a coefficient of 0 the KL is still computed and logged, as the original
        return trainer, None
    if reference_claim is actor_claim:
        reference_procs = actor_procs
    else:
        reference_procs = attach_claim(plan, reference_claim, workers_by_bundle, "reference")
    return trainer, TrainerGroup.spawn_reference(cfg, reference_procs, reference_claim.size)


async def start_roles(roles: Roles, cfg, plan: Plan, workers_by_bundle: dict,
                      restore: Callable[[TrainerGroup], Awaitable[None]], tokenizer, out) -> None:
    """Spawn and initialize every role into ``roles`` (see the module docstring for the
    order); ``restore(trainer)`` runs once the trainer is up and before it offloads;
    ``tokenizer``: the policy's. The judge service's process starts first, so that it
    imports its libraries meanwhile."""
    service_procs = judge_process() if cfg.genrm else None
    colocate, defer = plan.layout.colocated, plan.layout.judge_takes_turns

    def procs_of(bundles: list) -> list:
        return [workers_by_bundle[b.index].proc for b in bundles]

    def spawn(role_names: tuple[str, ...]) -> list[Awaitable]:
        engines, pending = spawn_engines(cfg, plan, procs_of, role_names, colocate)
        roles.engines += engines
        return pending

    roles.trainer, roles.reference = _spawn_trainers(cfg, plan, workers_by_bundle)
    trainers = [t for t in (roles.trainer, roles.reference) if t is not None]
    if colocate:
        await all_or_cancel([t.initialized() for t in trainers])
        await restore(roles.trainer)
        await all_or_cancel([t.offload() for t in trainers])
        if defer:
            await all_or_cancel(spawn(("genrm",)))
            await Judge(cfg, of_role(roles.engines, "genrm")).sleep_engines()
        await all_or_cancel(spawn(("rollout",) if defer else ("rollout", "genrm")))
    else:
        await all_or_cancel([t.initialized() for t in trainers] + spawn(("rollout", "genrm")))
        await restore(roles.trainer)
    for engine in roles.engines:
        if engine.place.get("pids") and len(engine.place["pids"]) > 1:
            p = engine.place
            print(f"{engine.role}{'[' + engine.instance + ']' if engine.instance else ''} engine {engine.index}: "
                  f"tensor parallel {p['tp']}, ranks on bundles {p['bundles']} (node {p['node']}, GPUs {p['gpus']}; "
                  f"pids {p['pids']}, devices {p['devices']})", file=out, flush=True)
    roles.judge = Judge(cfg, of_role(roles.engines, "genrm"))
    await roles.judge.start_service(out, service_procs)
    from reward.rewards import load_post_process, make_reward_fn

    roles.reward_fn = make_reward_fn(cfg, judge_address=roles.judge.address)
    roles.post_process = load_post_process(cfg)
    roles.rollout = RolloutPool(cfg, of_role(roles.engines, "rollout"), tokenizer)
    if cfg.custom_generate_function_path:  # slime's custom rollout, generating over HTTP
        from .custom_rollout import CustomRollout

        roles.rollout.custom = CustomRollout(cfg, roles.rollout)
        await roles.rollout.custom.start()
    if defer:
        await roles.judge.set_admission(False)
