"""The GPU-bundle allocator: pure functions from a JobConfig to a Plan (no processes).

A *bundle* is one GPU (a virtual one with ``--device cpu``); bundles are numbered node by
node (``index = node * gpus_per_node + gpu``). A *pool* is a run of bundles owned by the
controller; a *claim* puts a role (and judge instance) on a slice of a pool for some
phases, split into engines of ``gpus_per_engine`` bundles.

Layouts (docs/launcher.md, "Layouts and relay plan"):
- colocate + GenRM, **Split**: rollout + genrm == actor total; disjoint slices of the actor pool.
- colocate + GenRM, **Shared**: rollout == genrm == actor total; the same bundles. Co-resident
  by default (both engines awake: their memory fractions must sum below 1.0), or
  **Defer-swap** with ``--rm-type dummy --defer-reward-to-post-process`` and a post-process
  hook (they take turns).
- colocate without GenRM: rollout on the actor's bundles.
- fully-async (or neither flag): a dedicated pool per role.
Anything else is rejected with an error that gives the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import ConfigError, JobConfig


class PlanError(ConfigError):
    """The layout cannot work; nothing has been started."""


@dataclass(frozen=True)
class Bundle:
    index: int
    node: int
    gpu: int


@dataclass
class Pool:
    name: str
    bundles: list[Bundle]


@dataclass
class Claim:
    role: str
    instance: str  # judge route_key, or "" for other roles
    pool: str
    start: int  # bundle offsets within the pool: [start, stop)
    stop: int
    phases: tuple[str, ...]
    gpus_per_engine: int
    mem_fraction: float | None = None

    @property
    def size(self) -> int:
        return self.stop - self.start

    def label(self) -> str:
        return f"{self.role}[{self.instance}]" if self.instance else self.role


@dataclass(frozen=True)
class Layout:
    """How a plan's roles share GPUs (its ``mode``), asked in one place. ``colocated``: the
    engines live on the trainer's GPUs and sleep while it trains (Split, Co-resident,
    Defer-swap, and colocate without a judge); ``judge_takes_turns``: Defer-swap, where the
    judge wakes only after the rollout slept and scores a whole batch at once (elsewhere it
    scores as samples come)."""

    mode: str  # colocate-split | colocate-shared | colocate-defer | colocate | fully-async | dedicated

    @property
    def colocated(self) -> bool:
        return self.mode.startswith("colocate")

    @property
    def judge_takes_turns(self) -> bool:
        return self.mode == "colocate-defer"

    def __str__(self) -> str:
        return self.mode


@dataclass
class Plan:
    mode: str  # colocate-split | colocate-shared | colocate-defer | colocate | fully-async | dedicated
    nnodes: int
    gpus_per_node: int
    device: str
    pools: dict[str, Pool]
    claims: list[Claim]
    warnings: list[str] = field(default_factory=list)

    @property
    def layout(self) -> Layout:
        return Layout(self.mode)
    memory: list[str] = field(default_factory=list)  # the engines' memory fit (launcher/memory_fit.py)

    def bundles_of(self, claim: Claim) -> list[Bundle]:
        return self.pools[claim.pool].bundles[claim.start : claim.stop]

    def engines_of(self, claim: Claim) -> list[list[Bundle]]:
        b = self.bundles_of(claim)
        g = claim.gpus_per_engine
        return [b[i : i + g] for i in range(0, len(b), g)]

    @property
    def total_bundles(self) -> int:
        return self.nnodes * self.gpus_per_node


MODE_TITLES = {
    "colocate-split": "colocate, Split (rollout and judge on disjoint slices of the actor's GPUs)",
    "colocate-shared": "colocate, Shared co-resident (rollout and judge awake together on the same GPUs)",
    "colocate-defer": "colocate, Shared defer-swap (rollout and judge take turns on the same GPUs)",
    "colocate": "colocate (rollout on the actor's GPUs)",
    "fully-async": "fully-async (a dedicated pool per role)",
    "dedicated": "dedicated pools (synchronous)",
    "train-only": "training only (relay sft: the actor's GPUs)",
}


def _nodes_needed(cfg: JobConfig, gpus: int) -> int:
    if cfg.nnodes is not None:
        return cfg.nnodes
    return max(1, math.ceil(gpus / cfg.gpus_per_node))


def _pool(name: str, start: int, size: int, gpus_per_node: int) -> Pool:
    return Pool(name, [Bundle(i, i // gpus_per_node, i % gpus_per_node) for i in range(start, start + size)])


def make_plan(cfg: JobConfig, train_only: bool = False) -> Plan:
    """Turn the config into a validated plan, or raise PlanError saying what to change.
    ``train_only`` (relay sft): only the actor's GPUs are placed; other roles are ignored."""
    if cfg.fully_async and cfg.colocate:
        raise PlanError(
            "--fully-async cannot be combined with --colocate: choose one (fully-async gives each role its own GPUs)"
        )
    if "actor" not in cfg.resource:
        raise PlanError(
            '--resource must give the actor (trainer) GPUs, e.g. --resource \'{"actor": [1, 8], "rollout": [1, 8]}\''
        )
    if train_only:
        plan = Plan("train-only", 1, cfg.gpus_per_node, cfg.device, {}, [])
        size = cfg.role_gpus("actor")
        plan.nnodes = cfg.nnodes or _nodes_needed(cfg, size)
        plan.pools["actor"] = _pool("actor", 0, size, cfg.gpus_per_node)
        plan.claims.append(Claim("actor", "", "actor", 0, size, ("train",), size))
        _check_physical(plan)
        return plan
    defer = cfg.defer_reward_to_post_process
    if cfg.colocate:
        plan = _colocate(cfg, defer)
    else:
        if defer:
            raise PlanError(
                "--defer-reward-to-post-process needs GenRM to share the actor placement group with rollout "
                "(--colocate with rollout == genrm == actor GPUs); it is not available with --fully-async or dedicated "
                "pools"
            )
        plan = _dedicated(cfg)
    _check_physical(plan)
    from .memory_fit import check_memory_fit

    try:
        plan.memory = check_memory_fit(cfg, plan)
    except ValueError as e:
        raise PlanError(str(e)) from None
    return plan


def _check_defer_flags(cfg: JobConfig) -> bool:
    flags = (cfg.rm_type == "dummy", cfg.defer_reward_to_post_process, bool(cfg.custom_reward_post_process_path))
    if cfg.defer_reward_to_post_process and not all(flags):
        missing = []
        if cfg.rm_type != "dummy":
            missing.append("--rm-type dummy (no inline reward while generating)")
        if not cfg.custom_reward_post_process_path:
            missing.append("--custom-reward-post-process-path module.func (the batch scoring hook)")
        raise PlanError("defer-swap needs " + " and ".join(missing))
    return all(flags)


def _colocate(cfg: JobConfig, defer: bool) -> Plan:
    actor = cfg.actor_total
    rollout = cfg.rollout_gpus
    nnodes = _nodes_needed(cfg, actor)
    if actor > nnodes * cfg.gpus_per_node:
        raise PlanError(
            f"Insufficient GPU resources: the actor needs {actor} GPUs but {nnodes} node(s) x {cfg.gpus_per_node} give "
            f"{nnodes * cfg.gpus_per_node}"
        )
    pools = {"actor": _pool("actor", 0, actor, cfg.gpus_per_node)}
    claims = [Claim("actor", "", "actor", 0, actor, ("train",), 1)]
    warnings: list[str] = []
    genrm = cfg.genrm
    if not genrm:
        if defer:
            raise PlanError(
                "--defer-reward-to-post-process needs a GenRM judge (--genrm-model-path or --genrm-instances)"
            )
        if rollout != actor:
            raise PlanError(
                f"In colocated mode, rollout must use the actor's GPUs: --rollout-num-gpus ({rollout}) must equal the "
                f"actor total ({actor})"
            )
        claims.append(_rollout_claim(cfg))
        return Plan("colocate", nnodes, cfg.gpus_per_node, cfg.device, pools, claims, warnings)

    judge = cfg.genrm_gpus
    if rollout == judge == actor:
        mode = "shared"
    elif rollout + judge == actor:
        mode = "split"
    else:
        raise PlanError(
            "In colocated mode with genRM enabled, GPU allocation must satisfy one of:\n"
            f" (1) split: --rollout-num-gpus + --genrm-num-gpus == actor total ({actor}), or\n"
            f" (2) shared: --rollout-num-gpus == --genrm-num-gpus == actor total ({actor}).\n"
            f"Got rollout={rollout}, genrm={judge}, actor total={actor}"
        )
    if mode == "split" and defer:
        raise PlanError(
            "--defer-reward-to-post-process needs GenRM to share the actor placement group with rollout "
            f"(Shared: rollout == genrm == actor total); this layout is Split (rollout={rollout}, genrm={judge}, actor "
            f"total={actor})"
        )
    deferred = mode == "shared" and _check_defer_flags(cfg)
    claims.append(_rollout_claim(cfg))
    offset = rollout if mode == "split" else 0
    for inst in genrm.values():  # instances by prefix sums
        claims.append(
            Claim(
                "genrm",
                inst.name,
                "actor",
                offset,
                offset + inst.num_gpus,
                ("score",) if deferred else ("generate",),
                inst.num_gpus_per_engine,
                inst.mem_fraction_static,
            )
        )
        offset += inst.num_gpus
    if mode == "shared" and not deferred:
        warnings += _co_resident_fractions(cfg)
    name = {"split": "colocate-split", "shared": "colocate-defer" if deferred else "colocate-shared"}[mode]
    return Plan(name, nnodes, cfg.gpus_per_node, cfg.device, pools, claims, warnings)


def _rollout_claim(cfg: JobConfig) -> Claim:
    """Colocated rollout engines on the actor's GPUs from 0."""
    return Claim("rollout", "", "actor", 0, cfg.rollout_gpus, ("generate",), cfg.rollout_num_gpus_per_engine,
                 cfg.sglang_mem_fraction_static)


def _co_resident_fractions(cfg: JobConfig) -> list[str]:
    """Co-resident (shared, not deferred): the rollout's and each judge's memory fractions
    must sum below 1.0 (PlanError with the arithmetic); warnings past 0.9."""
    warnings = []
    for inst in cfg.genrm.values():
        judge_mf = inst.mem_fraction_static
        given = "mem_fraction_static"
        if judge_mf is None:  # the original's default: the rollout's fraction
            judge_mf, given = cfg.sglang_mem_fraction_static, "no mem_fraction_static: the rollout's, by default"
        total = cfg.sglang_mem_fraction_static + judge_mf
        if total >= 1.0:
            raise PlanError(
                f"Shared co-resident layout: rollout (--sglang-mem-fraction-static "
                f"{cfg.sglang_mem_fraction_static}) and judge "
                f"{inst.name!r} ({given} {judge_mf}) reserve {total:.2f} of each GPU; they must sum "
                f"below 1.0 (<= 0.9 leaves room for activations): set the judge's "
                "engine_config.mem_fraction_static (e.g. 0.5 + 0.3), or use defer-swap"
            )
        if total > 0.9:
            warnings.append(
                f"rollout + judge {inst.name!r} memory fractions sum to {total:.2f} (> 0.9): little room is left "
                f"for activations and CUDA graphs"
            )
    return warnings


def _dedicated(cfg: JobConfig) -> Plan:
    order = ["actor", "rollout", "genrm", "reference"]
    sizes: dict[str, int] = {}
    for role in order:
        if role == "rollout":
            if cfg.rollout_gpus:
                sizes[role] = cfg.rollout_gpus
        elif role == "genrm":
            if cfg.genrm:
                sizes[role] = cfg.genrm_gpus
        elif role in cfg.resource:
            sizes[role] = cfg.role_gpus(role)
    if "rollout" not in sizes:
        raise PlanError('--resource must give rollout GPUs (e.g. "rollout": [1, 4]) outside --colocate')
    total = sum(sizes.values())
    nnodes = _nodes_needed(cfg, total)
    have = nnodes * cfg.gpus_per_node
    if total > have:
        detail = ", ".join(f"{r}={n}" for r, n in sizes.items())
        raise PlanError(
            f"Insufficient GPU resources: the roles need {total} GPUs ({detail}) but {nnodes} node(s) x "
            f"{cfg.gpus_per_node} give {have}"
        )
    pools: dict[str, Pool] = {}
    claims: list[Claim] = []
    start = 0
    for role, n in sizes.items():
        pools[role] = _pool(role, start, n, cfg.gpus_per_node)
        start += n
        if role == "genrm":
            offset = 0
            for inst in cfg.genrm.values():  # instances by prefix sums within the genrm pool
                claims.append(
                    Claim(
                        "genrm",
                        inst.name,
                        "genrm",
                        offset,
                        offset + inst.num_gpus,
                        ("generate",),
                        inst.num_gpus_per_engine,
                        inst.mem_fraction_static,
                    )
                )
                offset += inst.num_gpus
        elif role == "rollout":
            claims.append(
                Claim(
                    "rollout",
                    "",
                    "rollout",
                    0,
                    n,
                    ("generate",),
                    cfg.rollout_num_gpus_per_engine,
                    cfg.sglang_mem_fraction_static,
                )
            )
        else:
            phases = {"actor": ("train",), "reference": ("forward",)}[role]
            claims.append(Claim(role, "", role, 0, n, phases, 1))
    return Plan(
        "fully-async" if cfg.fully_async else "dedicated", nnodes, cfg.gpus_per_node, cfg.device, pools, claims, []
    )


def _check_physical(plan: Plan) -> None:
    """Every engine's bundles sit on one node with contiguous GPU ids (trainer claims may
    span nodes: Megatron groups span nodes over NCCL)."""
    for claim in plan.claims:
        if claim.role == "actor":
            continue
        if claim.size % claim.gpus_per_engine:
            raise PlanError(
                f"{claim.label()}: {claim.size} GPUs cannot be split into engines of {claim.gpus_per_engine} GPUs; "
                "make the GPU count a multiple of the GPUs per engine"
            )
        for i, engine in enumerate(plan.engines_of(claim)):
            nodes = sorted({b.node for b in engine})
            if len(nodes) > 1:
                raise PlanError(
                    f"{claim.label()} engine {i} (bundles {engine[0].index}..{engine[-1].index}) would cross a node "
                    f"boundary "
                    f"(nodes {nodes}, {plan.gpus_per_node} GPUs per node): an engine's GPUs must be on one node; "
                    "change the GPU counts or GPUs per engine so engines align with nodes"
                )
            gpus = [b.gpu for b in engine]
            if gpus != list(range(gpus[0], gpus[0] + len(gpus))):
                raise PlanError(f"{claim.label()} engine {i}: GPU ids {gpus} are not contiguous")


# ------------------------------------------------------------------ presentation


def render_plan(plan: Plan) -> str:
    """A readable table: bundle -> node/GPU -> roles and instances, phases, memory fractions."""
    lines = [
        f"layout: {MODE_TITLES[plan.mode]}",
        f"nodes: {plan.nnodes} x {plan.gpus_per_node} {'virtual bundles (cpu)' if plan.device == 'cpu' else 'GPUs'}",
        "",
    ]
    per_bundle: dict[int, list[str]] = {}
    for claim in plan.claims:
        for e, engine in enumerate(plan.engines_of(claim)):
            for rank, b in enumerate(engine):
                engine_txt = "" if claim.role == "actor" else f" e{e}"
                if claim.role != "actor" and len(engine) > 1:
                    engine_txt += f" rank {rank}/{len(engine)}"
                mf = (
                    f" mem={claim.mem_fraction:g}"
                    if claim.mem_fraction is not None and claim.role in ("rollout", "genrm")
                    else ""
                )
                per_bundle.setdefault(b.index, []).append(f"{claim.label()}{engine_txt} ({'/'.join(claim.phases)}{mf})")
    width = max([len(" / ".join(v)) for v in per_bundle.values()] + [10])
    lines.append(f"{'bundle':>6}  {'node':>4}  {'gpu':>3}  {'roles (phases, memory fraction)':<{width}}")
    lines.append(f"{'-' * 6}  {'-' * 4}  {'-' * 3}  {'-' * width}")
    for idx in sorted(per_bundle):
        node, gpu = divmod(idx, plan.gpus_per_node)
        lines.append(f"{idx:>6}  {node:>4}  {gpu:>3}  {' / '.join(per_bundle[idx])}")
    lines.append("")
    for claim in plan.claims:
        if claim.size:
            lines.append(
                f"{claim.label():<22} pool={claim.pool:<10} bundles [{plan.bundles_of(claim)[0].index}, "
                f"{plan.bundles_of(claim)[-1].index + 1}) "
                f"engines={len(plan.engines_of(claim)) if claim.role != 'actor' else 1} x "
                f"{claim.gpus_per_engine if claim.role != 'actor' else claim.size} GPU"
                + (" (tensor parallel: a rank per GPU)" if claim.role != "actor" and claim.gpus_per_engine > 1 else "")
            )
    lines += plan.memory
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
