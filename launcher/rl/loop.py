"""The GRPO loop: start here. The controller builds a :class:`GRPOLoop` once every bundle
has its worker, then calls ``start()``, ``run()`` and ``close()``.

Before the first step the judge is checked (launcher/rl/integrity.py: known pairs and
injection canaries; a judge that fails stops the job). One colocated step
(:meth:`GRPOLoop.train_step`; docs/training.md, "One step"; the order
matters because the roles share GPU memory):

    record the judge's counters
    generate groups (each scored as soon as it is done, except in Defer-swap; then, with
     --custom-reward-post-process-path, the hook gives the batch's rewards and advantages,
     as the original runs it on every batch; in the fully-async loop too)
    [Defer-swap: rollout sleeps, judge wakes, the batch is scored, judge sleeps (finally)]
    every --genrm-canary-interval steps, the canaries are scored again (judge awake)
    check that the judge did not fail on the whole batch
    compute advantages
    judge and rollout sleep, trainer onloads
    train
    rollout wakes its weights (beside the trainer's state when every GPU has room for
     them; otherwise the trainer offloads first: launcher/rl/swaps.py)
    push the new weights (version + 1) and check every engine has them
    trainer offloads (if it has not, and unless every GPU has room for the engines' wakes
     beside it: then it stays, and needs no onload next step), rollout wakes its KV cache,
     judge wakes
    record metrics (+ the judge's drift audit and the weight probe)

With dedicated pools the sleeping and waking are no-ops. Fully-async
(:meth:`GRPOLoop.run_fully_async`): a producer keeps generating and scoring groups while
the trainer trains; a group whose weights lag the trainer by more than ``--max-staleness``
versions is dropped. A step whose rewards failed is not trained on: the job stops with the
error. With ``--use-fault-tolerance``, engines whose worker dies are rebuilt while the
step goes on (launcher/rl/recovery.py). Around the steps (:meth:`GRPOLoop.run`): evaluation before training, every
``--eval-interval`` steps and after the last; checkpoints every ``--save-interval`` steps;
a stop request (SIGTERM) checkpoints after the step in progress.
"""

from __future__ import annotations

import asyncio
import os

from ..agent import WorkerInfo
from ..allocator import Plan
from ..config import JobConfig
from ..data import PromptOrder, Row, job_datasets
from ..metrics import MetricsLog
from ..trackers import Trackers
from . import timeouts
from .async_rollout import GroupProducer, is_stale, slot_bound
from .checkpoints import Checkpoints, StoppedWithCheckpoint, write_hf_checkpoint
from .engine_pool import PooledEngine, call_engines, live, of_role, write_event_log
from .evaluation import eval_lines, evaluate
from .integrity import JudgeIntegrity
from .judge import judge_deltas
from .recovery import EngineRecovery
from .rollout import group_seed, prompt_datasets, sampling_options
from .sample import Sample, flatten, rollout_metrics, write_samples
from .scoring import Scorer, check_judged, reward_metrics, training_batch
from .startup import Roles, ensure_models, prepare_controller, start_roles
from .swaps import GpuSwaps
from .timing import PhaseTimer, union_seconds

__all__ = ["GRPOLoop", "StoppedWithCheckpoint"]


class GRPOLoop:
    """GRPO training with rollout engines, a judge and a Megatron trainer (see the module
    docstring). ``run()`` returns the last step's metrics record."""

    def __init__(self, cfg: JobConfig, plan: Plan, out, respawn=None):
        """Checks and loads the job's data; the workers come with :meth:`start`.
        ``respawn(node, bundle)``: start a bundle's worker again (the node agent's
        ``respawn_worker``); without it, no engine is rebuilt."""
        if not cfg.hf_checkpoint:
            raise ValueError("training needs a policy: set --hf-checkpoint (an HF checkpoint directory)")
        if not cfg.prompt_data:
            raise ValueError("training needs prompts: set --prompt-data (a JSONL file with 'prompt' and 'label')")
        if cfg.rollout_gpus == 0:
            raise ValueError("training needs rollout engines: give --resource a 'rollout' entry")
        self.cfg = cfg
        self.plan = plan
        self.out = out
        self.workers_by_bundle: dict[int, WorkerInfo] = {}
        self.layout = plan.layout  # colocated? does the judge take turns with the rollout?
        self.rows, self.eval_sets = job_datasets(cfg)  # eval sets: (name, rows) each
        self.order = PromptOrder(self.rows, cfg.sampling_seed, cfg.rollout_shuffle)
        self.eval_names = [name for name, _ in self.eval_sets]
        self.run_dir = os.path.abspath(cfg.run_dir)
        self.checkpoints = Checkpoints(self.run_dir)
        self.timer = PhaseTimer(span_names=("reward",))
        self._reward_spans: dict[int, tuple[float, float]] = {}  # fully-async: group index -> its scoring
        self.roles = Roles()
        self.version = 0  # the weight version the trainer holds (each sync adds one)
        self.start_step = 0
        self._training = False  # run() has begun: a stop request is answered with a checkpoint
        self._stop_requested = False
        self.respawn = respawn
        self.recovery: EngineRecovery | None = None
        self._weights_lock = asyncio.Lock()  # held from training until the new weights are synced
        self.swaps = GpuSwaps(self.roles, self.timer, self.layout)
        self._prepared: asyncio.Future | None = None

    def prepare(self) -> None:
        """Start what needs no worker, so that it runs while the workers start (the
        controller calls it before placing them; :meth:`start` waits for it, and calls it when
        nobody did): the tiny configs' missing models, then, in a thread, the controller's own
        imports and every prompt's token ids (:func:`prepare_controller`)."""
        if self._prepared is None:
            self._prepared = asyncio.ensure_future(self._prepare())
            self._prepared.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failed start reads it

    async def _prepare(self) -> tuple:
        await ensure_models(self.cfg)
        return await asyncio.to_thread(prepare_controller, self.cfg,
                                       prompt_datasets(self.cfg, self.rows, self.eval_sets))

    # ------------------------------------------------------------------ start and close

    async def start(self, workers: list[WorkerInfo]) -> None:
        """Start every role on ``workers`` (launcher/rl/startup.py) once :meth:`prepare`'s
        work is done; a resumed run's rollout engines get the checkpoint's weights."""
        cfg = self.cfg
        started = self.timer.clock()
        self.workers_by_bundle = {w.bundle: w for w in workers}
        self.prepare()
        tokenizer, prompt_ids = await self._prepared
        await start_roles(self.roles, cfg, self.plan, self.workers_by_bundle,
                          self._restore, tokenizer, self.out)
        await self.roles.rollout.check_context(prompt_ids, prompt_datasets(cfg, self.rows, self.eval_sets))
        self.trainer, self.reference = self.roles.trainer, self.roles.reference
        self.rollout, self.judge = self.roles.rollout, self.roles.judge
        self.scorer = Scorer(cfg, self.roles.reward_fn, self.roles.post_process, self.timer)
        self.integrity = JudgeIntegrity(cfg, self.judge, self.rows, self.run_dir, self.out)
        if self.respawn is not None:
            self.recovery = EngineRecovery(cfg, self.plan, self.roles.engines, self.judge, self.respawn,
                                           self._push_to_successor, self.out)
        if self.version:
            await self._push_weights()
        print(f"started {len(self.rollout.engines)} rollout engine(s), {len(self.judge.engines)} judge engine(s) and a "
              f"{self.trainer.dp}x{self.trainer.tp} (DP x TP) trainer in {self.timer.clock() - started:.1f} s "
              f"({self.layout})", file=self.out, flush=True)

    async def _restore(self, trainer) -> None:
        """``--resume``: the newest complete checkpoint sets the next step and weight version."""
        if not self.cfg.resume:
            return
        state = await self.checkpoints.restore(trainer, self.out)
        if state is not None:
            self.start_step, self.version = state["next_step"], state["weight_version"]

    def recover_worker(self, node: int, bundle: int, failure) -> bool:
        """The controller's question when a worker died: True when its engines are being
        rebuilt and the job goes on (``--use-fault-tolerance``, an engine-only worker)."""
        return self.recovery is not None and self.recovery.worker_died(node, bundle, failure)

    async def close(self, graceful: bool = True) -> None:
        """Write the engines' sleep/wake/sync logs to ``RUN_DIR/engine_events.jsonl``, stop
        the judge service (and its gateway); with ``graceful``, also leave torch.distributed
        cleanly. Works after a failed start too."""
        if self.recovery is not None:
            await self.recovery.close()
        engines = self.roles.engines
        wait = timeouts.EVENT_LOG if graceful else timeouts.EVENT_LOG_AFTER_FAILURE
        try:
            await write_event_log(os.path.join(self.run_dir, "engine_events.jsonl"), of_role(engines, "rollout"),
                                  of_role(engines, "genrm"), wait, self.out)
        except Exception as e:  # noqa: BLE001 (best effort)
            print(f"relay: engine event logs not written: {e}", file=self.out, flush=True)
        if self.roles.rollout is not None and self.roles.rollout.custom is not None:
            await self.roles.rollout.custom.close()
        if self.roles.judge is not None:
            await self.roles.judge.stop()
        if graceful:
            await self.roles.trainer.shutdown(self.out)

    def request_stop(self) -> bool:
        """Ask the loop to checkpoint after the step in progress and stop (raising
        :class:`StoppedWithCheckpoint`); False when the loop has not started training yet
        (nothing to save: the caller stops at once)."""
        if not self._training:
            return False
        self._stop_requested = True
        return True

    # ------------------------------------------------------------------ the loop

    async def run(self) -> dict:
        cfg = self.cfg
        log = MetricsLog(self.run_dir, cfg.num_rollout, self.out, Trackers(cfg, self.run_dir))
        last: dict = {}
        try:
            self._training = True
            check = await self.integrity.self_check(self.start_step,
                                                    lambda work: self.judge_window(work, resume_rollout=True))
            if check is not None:
                log.write(check)
            if self.eval_sets and not cfg.skip_eval_before_train and self.start_step == 0:
                record = await self.evaluate(0)
                log.write(record)
                print("\n".join(eval_lines(record, self.eval_names, "before training")), file=self.out, flush=True)
            if cfg.fully_async:
                last = await self.run_fully_async(log)
            else:
                for step in range(self.start_step, cfg.num_rollout):
                    last = await self.train_step(step)
                    await self._after_step(step, last, log)
            if self.recovery is not None and (self.recovery.tasks or self.recovery.rebuilt):
                log.write(await self.recovery.record(self.rollout, cfg.num_rollout, self.version, self.rows[0]))
        finally:
            log.close()
        return last

    async def train_step(self, step: int) -> dict:
        """One step of the colocated or dedicated-pool loop; returns its metrics record."""
        cfg, timer = self.cfg, self.timer
        timer.begin_step()
        judge_before = await self.judge.counts()
        _, captured_before = await self.rollout.usage()
        with timer.phase("rollout"):
            samples = await self._generate_batch(step, score_inline=not self.layout.judge_takes_turns)
        held, captured_after = await self.rollout.usage()
        memory = {"mem/rollout_bytes_generating": held}
        # an engine rebuilt meanwhile counts again from 0: never below 0
        captures = {"rollout/graph_capture_s": max(0.0, captured_after - captured_before)}
        await self._record_gpu_use("generating", memory)

        async def judge_work() -> dict:  # the judge is awake (Defer-swap: woken for this)
            if self.layout.judge_takes_turns:
                with timer.phase("reward"):
                    await self.scorer.score_batch(samples, cfg.n_samples_per_prompt)
            return await self.integrity.canaries_due(step)

        canaries = await self.judge_window(judge_work)
        check_judged(samples, f"step {step + 1}")
        judge_after = await self.judge.counts()
        batch = training_batch(samples, cfg, cfg.n_samples_per_prompt)
        if cfg.save_debug_rollout_data:
            await asyncio.to_thread(write_samples, self.run_dir, step + 1, samples, batch.advantages,
                                    cfg.save_debug_rollout_path)
        async with self._weights_lock:  # an engine rebuilt meanwhile gets the new weights, not these
            await self.swaps.free_for_training(memory)
            with timer.phase("train"):
                train_stats = await self.trainer.train_rl(batch, cfg.global_batch_size, self.reference,
                                                          self.layout.colocated)
            await self._record_gpu_use("training", memory)
            if self.layout.colocated:
                memory["mem/trainer"] = await self.trainer.allocated_bytes()
            trainer_resident = await self.swaps.wake_rollout_weights()
            with timer.phase("sync"):
                synced = await self._sync_weights()
            if trainer_resident:  # offloads unless the engines' wakes fit beside it
                await self.swaps.offload_trainer_unless_room(memory)
        await self.swaps.resume_generation()
        timer.end_step()
        await self._record_gpu_use("synced", memory)
        record = self._record(step, samples, train_stats, judge_before, judge_after)
        record.update(canaries)
        record.update(memory)
        record.update(synced)
        record.update(captures)
        record.update(await self.rollout.probe(self.rows[0]))
        return record

    async def _after_step(self, step: int, record: dict, log: MetricsLog) -> None:
        """Log the step; checkpoint (every ``--save-interval`` steps, or on a stop request,
        then stop unless it was the last step); evaluate every ``--eval-interval`` steps and
        after the last."""
        cfg = self.cfg
        log.write(record)
        log.progress(step, record)
        last = step + 1 == cfg.num_rollout
        periodic_save = bool(cfg.save_interval) and (step + 1) % cfg.save_interval == 0
        if periodic_save or self._stop_requested:
            await self.checkpoints.save(self.trainer, step + 1, self.version, self.layout.colocated,
                                        cfg.keep_checkpoints)
        if cfg.save_hf and (periodic_save or self._stop_requested or last):
            path = await write_hf_checkpoint(self.trainer, cfg.hf_checkpoint,
                                             os.path.join(os.path.abspath(cfg.save_hf), f"step_{step + 1:06d}"))
            print(f"wrote the HF checkpoint of step {step + 1} to {path}", file=self.out, flush=True)
        if self._stop_requested and not last:
            raise StoppedWithCheckpoint(self.checkpoints.path(step + 1), step + 1)
        periodic_eval = bool(cfg.eval_interval) and (step + 1) % cfg.eval_interval == 0
        if self.eval_sets and (periodic_eval or last):
            ev = await self.evaluate(step + 1)
            log.write(ev)
            print("\n".join(eval_lines(ev, self.eval_names, f"after step {step + 1}")), file=self.out, flush=True)

    # ------------------------------------------------------------------ the step's parts

    async def _generate_batch(self, step: int, score_inline: bool) -> list[Sample]:
        """``--rollout-batch-size`` groups of the step's rows in data order; scored and post-processed if asked."""
        cfg = self.cfg
        rows = self.order.batch(step, cfg.rollout_batch_size)
        groups = await asyncio.gather(*(
            self.group(row, cfg.n_samples_per_prompt, sampling_options(cfg), group_seed(cfg.sampling_seed, step, k),
                        step * cfg.rollout_batch_size + k, score_inline)
            for k, row in enumerate(rows)))
        return await self.scorer.post_process_batch(flatten(groups), cfg.n_samples_per_prompt, skip=not score_inline)

    async def evaluate(self, step: int) -> dict:
        """The eval record of the policy now (launcher/rl/evaluation.py)."""
        return await evaluate(self.cfg, self.eval_sets, step, timer=self.timer, layout=self.layout, group=self.group,
                              scorer=self.scorer, judge_window=self.judge_window)

    async def group(self, row: Row, size: int, sampling: dict, seed: int, group_index: int, score: bool,
                     dataset: str = "train") -> list[Sample]:
        """One group from the rollout pool, scored as soon as it is done when ``score``."""
        samples = await self.rollout.generate_group(row, size, sampling, seed, group_index, dataset)
        if score:
            await self.scorer.score_all(samples)
        return samples

    async def judge_window(self, work, resume_rollout: bool = False):
        """``await work()`` with the judge awake. Defer-swap: the rollout sleeps and the judge
        wakes first, and the judge sleeps again whatever happened; with ``resume_rollout`` the
        rollout then wakes and gets its weights back. Elsewhere the judge is awake already."""
        if not self.layout.judge_takes_turns:
            return await work()
        await self.swaps.open_judge_window()
        try:
            return await work()
        finally:
            await self.swaps.close_judge_window()
            if resume_rollout:
                await self.rollout.wake()
                await self._push_weights()

    async def _sync_weights(self) -> dict:
        """Push the trainer's weights to every rollout engine under a new version, then check
        that each engine reports it."""
        self.version += 1
        await self._push_weights()
        versions = await self.rollout.weight_versions()
        if versions != [self.version] * len(versions):
            raise RuntimeError(f"weight sync: engines report versions {versions}, expected {self.version}")
        return {"sync/engine_versions": versions}

    async def _push_weights(self) -> None:
        """The trainer's weights, under ``self.version``, into every rollout engine (those
        being rebuilt get them with :meth:`_push_to_successor`)."""
        while True:
            engines = live(self.rollout.engines)
            try:
                await self.trainer.push_weights([e.mesh for e in engines], self.version,
                                                self.cfg.update_weight_buffer_size)
                return
            except Exception:
                if not self.cfg.fault_tolerant:
                    raise
                await call_engines(engines, "stats", timeout=timeouts.CONTROL)  # marks the dead ones down
                if all(e.down is None for e in engines):
                    raise

    async def _push_to_successor(self, engine: PooledEngine, mesh) -> None:
        """A rebuilt rollout engine gets the trainer's current weights and version, then
        takes ``engine``'s place; no weight sync runs in between."""
        async with self._weights_lock:
            await self.trainer.push_weights([mesh], self.version, self.cfg.update_weight_buffer_size)
            engine.replaced(mesh)

    async def _record_gpu_use(self, phase: str, into: dict) -> None:
        """Bytes in use on each actor GPU (every process on it), as the driver reports; on
        GPU only. Recorded as ``mem/gpu_used_<phase>`` (one number per GPU)."""
        figures = await self.trainer.gpu_memory()
        if figures and figures[0]["total"]:
            into[f"mem/gpu_used_{phase}"] = [m["total"] - m["free"] for m in figures]

    def _record(self, step: int, samples: list[Sample], train_stats: dict, judge_before: dict,
                judge_after: dict) -> dict:
        """The step's metrics: reward, rollout, judge, train and ``time/*`` (which ends the
        timer's step)."""
        # steps are numbered from 1 in records, plots, the console and checkpoint names: step = steps done
        record: dict = {"kind": "train", "step": step + 1, "weight_version": self.version, "samples": len(samples)}
        record.update(reward_metrics(samples))
        record.update(rollout_metrics(samples, self.timer.seconds("rollout")))
        record.update(judge_deltas(judge_before, judge_after))
        record.update(self.integrity.audit_step(step + 1, samples))
        record.update({f"train/{k}": v for k, v in train_stats.items()})
        record.update(self.timer.metrics())
        return record

    # ------------------------------------------------------------------ fully-async

    async def run_fully_async(self, log: MetricsLog) -> dict:
        """Train on groups a producer generates and scores without waiting for the trainer
        (launcher/rl/async_rollout.py states the bound). Each step record counts all judge
        work since the previous record; a final ``summary`` record counts the rest (the
        producer is drained first), so the records' ``judge/requests`` add up to the judge
        service's own counter."""
        cfg, timer = self.cfg, self.timer
        producer = GroupProducer(self._async_group, self.start_step * cfg.rollout_batch_size,
                                 slot_bound(cfg.rollout_batch_size, cfg.max_staleness))
        producer.start()
        judge_before = await self.judge.counts()
        last: dict = {}
        try:
            for step in range(self.start_step, cfg.num_rollout):
                timer.begin_step()
                with timer.phase("rollout"):
                    batch, stale = await self._take_fresh_groups(producer)
                samples = await self.scorer.post_process_batch(flatten(batch), cfg.n_samples_per_prompt)
                train_batch = training_batch(samples, cfg, cfg.n_samples_per_prompt)
                if cfg.save_debug_rollout_data:
                    await asyncio.to_thread(write_samples, self.run_dir, step + 1, samples,
                                            train_batch.advantages, cfg.save_debug_rollout_path)
                async with self._weights_lock:
                    with timer.phase("train"):
                        train_stats = await self.trainer.train_rl(train_batch, cfg.global_batch_size,
                                                                  self.reference, self.layout.colocated)
                    with timer.phase("sync"):
                        synced = await self._sync_weights()
                in_flight_max = producer.release(len(batch))
                judge_now = await self.judge.counts()
                timer.end_step()
                last = self._record(step, samples, train_stats, judge_before, judge_now)
                # the batch was scored in the background, mostly during earlier steps: its own reward seconds
                last["time/reward"] = union_seconds([self._reward_spans.pop(g[0].group_index) for g in batch])
                judge_before = judge_now
                last.update(synced)
                last.update(await self.integrity.canaries_due(step))
                last.update({"rollout/stale_groups_dropped": stale, "rollout/groups_in_flight_max": in_flight_max,
                             "rollout/groups_in_flight_bound": producer.bound,
                             "rollout/staleness_max": self.version - 1 - last["rollout/min_weight_version"]})
                await self._after_step(step, last, log)
        except BaseException:
            await producer.cancel()
            raise
        unused = await producer.finish(self.rollout.abort, timeouts.DRAIN)
        judge_now = await self.judge.counts()
        summary = {"kind": "summary", "step": cfg.num_rollout, "rollout/groups_generated": producer.generated,
                   "rollout/groups_dropped": producer.dropped, "rollout/groups_unused": unused,
                   "judge/requests_total": judge_now.get("requests", 0)}
        summary.update(judge_deltas(judge_before, judge_now))
        log.write(summary)
        return last

    async def _async_group(self, k: int) -> list[Sample]:
        """Group ``k`` in data order, scored; the seconds its scoring ran are kept for the
        record of the step that trains on it (``_reward_spans``)."""
        cfg = self.cfg
        row = self.order.batch(k, 1)[0]
        samples = await self.group(row, cfg.n_samples_per_prompt, sampling_options(cfg),
                                    group_seed(cfg.sampling_seed, k, 0), k, score=False)
        started = self.timer.clock()
        await self.scorer.score_all(samples)
        self._reward_spans[k] = (started, self.timer.clock())
        return samples

    async def _take_fresh_groups(self, producer: GroupProducer) -> tuple[list[list[Sample]], int]:
        """``--rollout-batch-size`` groups within ``--max-staleness``, and how many stale
        groups were dropped on the way."""
        batch: list[list[Sample]] = []
        stale = 0
        while len(batch) < self.cfg.rollout_batch_size:
            group = await producer.next_group()
            if is_stale(group, self.version, self.cfg.max_staleness):
                stale += 1
                producer.drop()
                self._reward_spans.pop(group[0].group_index, None)
                continue
            batch.append(group)
        return batch, stale
