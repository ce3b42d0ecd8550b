"""The trainer group shared by GRPO and SFT: one ``TrainerActor`` per bundle of a claim
(tensor parallel within a DP rank, data parallel across), spawned from the config.

Per-DP calls: the TP ranks of one DP rank get the same arguments, and one result per DP
rank comes back (that of its first TP rank).
"""

from __future__ import annotations

import asyncio
import dataclasses

from engines.trainer.train_batch import StepStats, TrainBatch
from relay import ActorMesh, ProcMesh

from ..allocator import Plan
from . import timeouts
from .sample import shard_over_dp


def attach_claim(plan: Plan, claim, workers_by_bundle: dict, name: str) -> ProcMesh:
    """The worker processes of ``claim``'s bundles as one mesh (dimension ``ranks``)."""
    procs = [workers_by_bundle[b.index].proc for b in plan.bundles_of(claim)]
    return ProcMesh.attach(procs, name=name, dims={"ranks": claim.size})


def loss_options(cfg) -> dict:
    """The GRPO loss settings of the config, as ``TrainerActor(loss=...)`` takes them."""
    return dict(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
                kl_coef=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0, kl_type=cfg.kl_loss_type, use_tis=cfg.use_tis,
                tis_clip=cfg.tis_clip, tis_clip_low=cfg.tis_clip_low, entropy_coef=cfg.entropy_coef)


def _check_tp(cfg, size: int) -> None:
    if size % cfg.tensor_model_parallel_size:
        raise ValueError(f"--tensor-model-parallel-size {cfg.tensor_model_parallel_size} does not divide the "
                         f"{size} actor GPUs")
    dp = size // cfg.tensor_model_parallel_size
    if dp % cfg.expert_model_parallel_size:
        raise ValueError(f"--expert-model-parallel-size {cfg.expert_model_parallel_size} does not divide the "
                         f"trainer's data-parallel size {dp}")


def parallel_options(cfg) -> dict:
    """Tensor / expert parallel sizes and the MoE aux-loss coefficient, as ``TrainerActor`` takes them
    (the reference shares the policy's process groups: same sizes)."""
    return dict(tp=cfg.tensor_model_parallel_size, ep=cfg.expert_model_parallel_size,
                moe_aux_loss_coeff=cfg.moe_aux_loss_coeff)


def recompute_options(cfg) -> dict | None:
    """Megatron's activation recompute settings of ``--recompute-*`` (None: off)."""
    if cfg.recompute_granularity is None:
        return None
    return {"recompute_granularity": cfg.recompute_granularity, "recompute_method": cfg.recompute_method,
            "recompute_num_layers": cfg.recompute_num_layers}


class TrainerGroup:
    """A ``TrainerActor`` mesh of ``dp * tp`` ranks."""

    def __init__(self, mesh: ActorMesh, dp: int, tp: int):
        self.mesh = mesh
        self.dp = dp
        self.tp = tp

    @classmethod
    def spawn_policy(cls, cfg, procs: ProcMesh, size: int, total_iters: int, loss: dict | None = None,
                     cpu_threads: int | None = None, reference_beside: bool = False) -> TrainerGroup:
        """The trained model, with the config's optimizer and LR schedule over
        ``total_iters`` optimizer steps (``loss``: GRPO's loss settings; None for SFT).
        ``cpu_threads``: each rank's intra-op threads on CPU (default 1). ``reference_beside``:
        the KL's reference model will share its GPUs (an automatic micro-batch size leaves room
        for its weights)."""
        from engines.trainer.actor import TrainerActor

        _check_tp(cfg, size)
        tp = cfg.tensor_model_parallel_size
        options = dict(**parallel_options(cfg), lr=cfg.lr, weight_decay=cfg.weight_decay, clip_grad=cfg.clip_grad,
                       lr_decay_style=cfg.lr_decay_style, lr_warmup_iters=cfg.lr_warmup_iters, total_iters=total_iters,
                       seed=cfg.seed, micro_batch_tokens=cfg.micro_batch_tokens, bf16=cfg.bf16,
                       optimizer=cfg.optimizer_impl, cpu_threads=cpu_threads,
                       adam=(cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps), recompute=recompute_options(cfg),
                       pack=cfg.use_dynamic_batch_size, reference_beside=reference_beside)
        if loss is not None:
            options["loss"] = loss
        mesh = procs.spawn("trainer", TrainerActor, cfg.hf_checkpoint, **options)
        return cls(mesh, size // tp, tp)

    @classmethod
    def spawn_reference(cls, cfg, procs: ProcMesh, size: int) -> TrainerGroup:
        """A frozen copy of the initial policy for reference log-probs, in the policy's
        precision (``--bf16``: bf16, as the original's reference). It never steps: torch AdamW
        allocates no state until a step (Megatron's optimizer would allocate grad buffers and
        master weights up front)."""
        from engines.trainer.actor import TrainerActor

        tp = cfg.tensor_model_parallel_size
        mesh = procs.spawn("reference", TrainerActor, cfg.hf_checkpoint, **parallel_options(cfg), seed=cfg.seed,
                           optimizer="torch", bf16=cfg.bf16, frozen=True,
                           micro_batch_tokens=cfg.micro_batch_tokens, pack=cfg.use_dynamic_batch_size)
        return cls(mesh, size // tp, tp)

    def initialized(self):
        return self.mesh.initialized(timeouts.MODEL_LOAD)

    async def call_per_dp(self, method: str, per_dp_args: list[tuple]) -> list:
        """``method(*per_dp_args[d])`` on every TP rank of DP rank d; one result per DP rank."""
        calls = [getattr(self.mesh.slice(ranks=rank), method).call_one(*per_dp_args[rank // self.tp])
                 .result(timeouts.TRAIN_CALL) for rank in range(len(per_dp_args) * self.tp)]
        results = await asyncio.gather(*calls)
        return [results[d * self.tp] for d in range(len(per_dp_args))]

    async def onload(self) -> None:
        await self.mesh.onload.call().result(timeouts.MEMORY_MOVE)

    async def offload(self) -> None:
        await self.mesh.offload.call().result(timeouts.MEMORY_MOVE)

    async def train_rl(self, batch: TrainBatch, global_batch_size: int, reference: TrainerGroup | None = None,
                       colocate: bool = False) -> dict:
        """Optimizer steps over ``global_batch_size`` runs of the batch's samples (whole
        groups), each sharded over the DP ranks with the step's denominator
        (:meth:`TrainBatch.shard`); with a ``reference``, its log-probs of each shard (at the
        batch's temperature) go into the loss (onloaded around the call when ``colocate``).
        With more than one step, the policy's log-probs of every sample are computed before
        the first (PPO's old policy for the later steps; the first step's own forward gives
        its). Returns each step's figures summed over DP (``StepStats.combine``), averaged
        over the optimizer steps."""
        steps = batch.optimizer_steps(global_batch_size)
        old = await self._logprobs_of(batch.tokens, batch.temperature) if len(steps) > 1 else None
        per_step: list[dict] = []
        for k, step in enumerate(steps):
            if k > 0:
                start = k * global_batch_size
                step.old_logprobs = old[start:start + len(step)]
            shards = step.shard(self.dp)
            if reference is not None:
                if colocate:
                    await reference.onload()
                ref = await reference.call_per_dp("compute_logprobs",
                                                  [(shard.tokens, batch.temperature) for shard in shards])
                if colocate:
                    await reference.offload()
                shards = [dataclasses.replace(shard, ref_logprobs=r) for shard, r in zip(shards, ref)]
            stats = await self.call_per_dp("train_step", [(shard,) for shard in shards])
            per_step.append(StepStats.combine(stats).as_dict())
        return {key: sum(s[key] for s in per_step) / len(per_step) for key in per_step[0]}

    async def _logprobs_of(self, seqs: list, temperature: float) -> list:
        """The policy's per-token log-probs of every sequence at ``temperature`` (sharded over
        the DP ranks)."""
        shards = shard_over_dp(list(range(len(seqs))), self.dp)
        parts = await self.call_per_dp("compute_logprobs",
                                       [([seqs[i] for i in shard], temperature) for shard in shards])
        out: list = [None] * len(seqs)
        for shard, part in zip(shards, parts):
            for i, lp in zip(shard, part):
                out[i] = lp
        return out

    async def push_weights(self, engine_meshes: list, version: int, bucket_bytes: int) -> None:
        """The current weights, under ``version``, into every engine."""
        await self.mesh.push_weights.call(engine_meshes, version, bucket_bytes).result(timeouts.PUSH_WEIGHTS)

    async def save_checkpoint(self, path: str) -> None:
        """Every rank writes its shard under ``path``."""
        await self.mesh.save_checkpoint.call(path).result(timeouts.CHECKPOINT)

    async def load_checkpoint(self, path: str) -> None:
        await self.mesh.load_checkpoint.call(path).result(timeouts.CHECKPOINT)

    async def export_hf(self) -> list[dict]:
        """The whole model as HF-named tensors (rank 0's gathered export), in buckets."""
        return (await self.mesh.export_hf.call(1 << 62).result(timeouts.CHECKPOINT)).values()[0]

    async def gpu_memory(self, release_cache: bool = False) -> list[dict]:
        """Every rank's ``gpu_memory()`` figures (``release_cache``: after emptying its
        allocator's cache)."""
        return (await self.mesh.gpu_memory.call(release_cache).result(timeouts.CONTROL)).values()

    async def allocated_bytes(self) -> int:
        """Device bytes rank 0's process has allocated."""
        return (await self.mesh.slice(ranks=0).gpu_memory.call_one().result(timeouts.CONTROL))["allocated"]

    async def shutdown(self, out) -> None:
        """Leave torch.distributed cleanly (best effort: the workers are stopped next anyway)."""
        try:
            await self.mesh.shutdown.call().result(timeouts.CONTROL)
        except Exception as e:  # noqa: BLE001
            print(f"relay: trainer shutdown: {type(e).__name__}: {e}", file=out, flush=True)
