"""The GRPO training loop, run by the controller once every bundle has its worker.

Roles come from the allocator's plan: a ``TrainerActor`` on every actor bundle (TP within,
DP across), an ``EngineActor`` per rollout engine and per judge engine (on the first
bundle of its slice), the ``JudgeService`` in a process of its own on the controller's
host, serving the HTTP gateway from that process, and the reward function, which calls
the judge through the ZeroMQ client.

One colocated step (docs/training.md, "One step"; the order matters):
  rollout (+ inline rewards in Split / Co-resident)
  -> [Defer-swap: rollout sleeps, judge wakes, batch score, judge sleeps (in a finally)]
  -> engines sleep -> trainer onloads, trains, offloads
  -> rollout wakes weights -> weight sync (new version) -> rollout wakes kv_cache
  -> judge wakes (not in Defer-swap).
Fully-async: dedicated pools, a producer keeps generating (and scoring) groups while the
trainer trains; a group whose weight version lags the trainer by more than
``--max-staleness`` is dropped; every sample records its weight version.
A step whose rewards failed is not trained on: the job stops with the error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass

import relay
from relay import ActorError, ProcMesh

from .agent import WorkerInfo
from .allocator import Plan
from .config import JobConfig
from .data import PromptOrder, Row, load_rows, prompt_ids, question_text
from .metrics import MetricsLog

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "state.json"


class StoppedWithCheckpoint(Exception):
    """The loop stopped on request (SIGTERM, e.g. slurm preemption) after writing a
    checkpoint; ``--resume`` continues at ``next_step``."""

    def __init__(self, path: str, next_step: int):
        super().__init__(f"stopped on request after writing {path}; --resume continues at step {next_step}")
        self.path = path
        self.next_step = next_step


@dataclass
class Engine:
    role: str  # "rollout" or "genrm"
    instance: str
    mesh: relay.ActorMesh
    outstanding: int = 0


def _describe_sample(sample: dict) -> str:
    """Which sample, for error messages: its row, question and label."""
    q = question_text(sample.get("prompt", ""))
    return f"the sample of row {sample.get('index')} ({sample.get('dataset', 'train')} data; question {q[:80]!r}, label {sample.get('label')!r})"


def _correct(sample: dict) -> bool:
    """Whether a sample counts as correct, for ``reward/accuracy`` and ``eval/accuracy``
    alike: the reward's own ``acc`` when it returns a dict with one, else reward > 0."""
    info = sample.get("reward_info")
    if isinstance(info, dict) and "acc" in info:
        return bool(info["acc"])
    return sample["reward"] > 0


def _union_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the (start, end) spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _groups(xs: list, n: int) -> list[list]:
    return [xs[i : i + n] for i in range(0, len(xs), n)]


class GRPOJob:
    def __init__(self, cfg: JobConfig, plan: Plan, workers: list[WorkerInfo], out):
        if not cfg.hf_checkpoint:
            raise ValueError("training needs a policy: set --hf-checkpoint (an HF checkpoint directory)")
        if not cfg.prompt_data:
            raise ValueError("training needs prompts: set --prompt-data (a JSONL file with 'prompt' and 'label')")
        if cfg.rollout_gpus == 0:
            raise ValueError("training needs rollout engines: give --resource a 'rollout' entry")
        self.cfg = cfg
        self.plan = plan
        self.out = out
        self.by_bundle = {w.bundle: w for w in workers}
        self.mode = plan.mode
        self.colocate = plan.mode.startswith("colocate")
        self.defer = plan.mode == "colocate-defer"
        self.rows = load_rows(cfg.prompt_data)
        self.order = PromptOrder(self.rows, cfg.seed)
        self.eval_rows = load_rows(cfg.eval_prompt_data, "--eval-prompt-data") if cfg.eval_prompt_data else None
        self.run_dir = os.path.abspath(cfg.run_dir)
        self.version = 0
        self.start_step = 0
        self.judge = None
        self.judge_procs = None  # the judge service's own process
        self.rollout: list[Engine] = []
        self.judges: list[Engine] = []
        self._reward_spans: list[tuple[float, float]] = []  # (start, end) of reward calls since the last step record
        self._training = False  # run() has begun: a stop request is answered with a checkpoint
        self._stop_requested = False

    # ------------------------------------------------------------------ start-up

    def _procs(self, bundles) -> list:
        return [self.by_bundle[b.index].proc for b in bundles]

    def _engine_kwargs(self, claim, weights_mode: str) -> dict:
        kw: dict = {"weights_mode": weights_mode}
        if self.cfg.device == "cpu":
            kw["kv_cache_tokens"] = self.cfg.kv_cache_tokens
        else:
            kw.update(device="cuda", mem_fraction_static=claim.mem_fraction or self.cfg.sglang_mem_fraction_static)
        return kw

    async def start(self) -> None:
        from engines.model_builder import ensure_model
        from engines.trainer.actor import TrainerActor
        from reward.judge import start_judge_service

        cfg = self.cfg
        t0 = time.monotonic()
        await asyncio.to_thread(ensure_model, cfg.hf_checkpoint, 1)
        for inst in cfg.genrm.values():
            await asyncio.to_thread(ensure_model, inst.model_path, 7)
        actor_claim = next(c for c in self.plan.claims if c.role == "actor")
        actor_procs = ProcMesh.attach(self._procs(self.plan.bundles_of(actor_claim)), name="trainer", dims={"ranks": actor_claim.size})
        if actor_claim.size % cfg.tensor_model_parallel_size:
            raise ValueError(f"--tensor-model-parallel-size {cfg.tensor_model_parallel_size} does not divide the {actor_claim.size} actor GPUs")
        self.dp = actor_claim.size // cfg.tensor_model_parallel_size
        loss = dict(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
                    kl_coef=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0, kl_type=cfg.kl_loss_type, use_tis=cfg.use_tis,
                    tis_clip=cfg.tis_clip, tis_clip_low=cfg.tis_clip_low, entropy_coef=cfg.entropy_coef)
        self.trainer = actor_procs.spawn(
            "trainer", TrainerActor, cfg.hf_checkpoint, tp=cfg.tensor_model_parallel_size, lr=cfg.lr, weight_decay=cfg.weight_decay,
            clip_grad=cfg.clip_grad, lr_decay_style=cfg.lr_decay_style, lr_warmup_iters=cfg.lr_warmup_iters,
            total_iters=max(1, cfg.num_rollout * max(1, cfg.rollout_batch_size * cfg.n_samples_per_prompt // cfg.global_batch_size)),
            seed=cfg.seed, loss=loss, micro_batch_tokens=cfg.micro_batch_tokens, bf16=cfg.bf16, optimizer=cfg.optimizer_impl,
        )
        self.reference = None
        if cfg.use_kl_loss and cfg.kl_loss_coef > 0:
            ref_claim = next((c for c in self.plan.claims if c.role == "reference"), actor_claim)
            ref_procs = actor_procs if ref_claim is actor_claim else ProcMesh.attach(self._procs(self.plan.bundles_of(ref_claim)), name="reference", dims={"ranks": ref_claim.size})
            # never steps: torch AdamW allocates no state until a step (Megatron's optimizer would
            # allocate grad buffers and master weights up front)
            self.reference = ref_procs.spawn("reference", TrainerActor, cfg.hf_checkpoint, tp=cfg.tensor_model_parallel_size, seed=cfg.seed, optimizer="torch")
        trainers = [self.trainer] + ([self.reference] if self.reference is not None else [])
        if self.colocate:
            # Colocated roles share GPU memory, so they start one after another: the trainer
            # loads, restores and offloads; in Defer-swap the judge loads and goes to sleep
            # (its weights kept in CPU memory); then the rollout engines (and co-resident
            # judges) load, each sizing its KV cache from the memory left.
            await self._init_all([m.initialized(900) for m in trainers])
            if cfg.resume:
                await self._load_checkpoint()
            await self._init_all([m.offload.call().result(600) for m in trainers])
            if self.defer:
                await self._init_all(self._spawn_engines(("genrm",)))
                await self._each(self.judges, "sleep", ["weights", "kv_cache"], "finish")
            await self._init_all(self._spawn_engines(("rollout",) if self.defer else ("rollout", "genrm")))
        else:
            await self._init_all([m.initialized(900) for m in trainers] + self._spawn_engines(("rollout", "genrm")))
            if cfg.resume:
                await self._load_checkpoint()
        if self.judges:
            specs: dict = {}
            for name, inst in cfg.genrm.items():
                specs[name] = {"model_path": inst.model_path, "num_gpus": inst.num_gpus, "sampling_config": inst.sampling_config,
                               "engines": [e.mesh for e in self.judges if e.instance == name]}
            self.judge, self.judge_procs = await start_judge_service(specs, 300)
            os.environ["RELAY_GENRM_ADDR"] = self.judge_procs.procs[0].addr
            try:
                port = await self.judge.serve_http.call_one("127.0.0.1", cfg.genrm_gateway_port, None, cfg.gateway_limits()).result(60)
            except ActorError as e:  # e.g. the port is taken: say which option to change
                raise RuntimeError(f"{e.exception} (--genrm-gateway-port; 0 picks a free one)") from None
            print(f"judge gateway: http://127.0.0.1:{port}/genrm/health", file=self.out, flush=True)
        from reward.rewards import load_post_process, make_reward_fn

        self.reward_fn = make_reward_fn(cfg)
        self.post_process = load_post_process(cfg)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.hf_checkpoint)
        # Keyed by the prompt itself, never by row index: train and eval rows share indices.
        self._prompt_ids: dict[tuple[str, str], list[int]] = {}
        if self.defer:
            for name in cfg.genrm:
                await self.judge.set_awake.call_one(name, False).result(60)
        if self.version:  # resumed: the rollout engines get the checkpoint's weights
            await self._push()
        print(f"started {len(self.rollout)} rollout engine(s), {len(self.judges)} judge engine(s) and a {self.dp}x{cfg.tensor_model_parallel_size} "
              f"(DP x TP) trainer in {time.monotonic() - t0:.1f} s ({self.mode})", file=self.out, flush=True)

    @staticmethod
    async def _init_all(waits: list) -> None:
        """Await every start-up step; on a failure, cancel (and retrieve) the others."""
        futs = [asyncio.ensure_future(w) for w in waits]
        try:
            await asyncio.gather(*futs)
        finally:
            for f in futs:
                f.cancel()
            await asyncio.gather(*futs, return_exceptions=True)

    def _spawn_engines(self, roles: tuple) -> list:
        """Spawn the engines of these roles; returns their initialization awaitables."""
        from engines.actor import EngineActor

        cfg = self.cfg
        pending = []
        for claim in self.plan.claims:
            if claim.role not in roles:
                continue
            for i, bundles in enumerate(self.plan.engines_of(claim)):
                proc = ProcMesh.attach(self._procs(bundles[:1]), name=f"{claim.label()}-e{i}")
                rollout = claim.role == "rollout"
                path = cfg.hf_checkpoint if rollout else cfg.genrm[claim.instance].model_path
                mode = "discard" if (rollout and self.colocate) else "backup"
                name = f"engine-{claim.role}-{claim.instance or 'policy'}-{i}".replace("_", "")
                mesh = proc.spawn(name, EngineActor, path, cfg.engine, **self._engine_kwargs(claim, mode))
                (self.rollout if rollout else self.judges).append(Engine(claim.role, claim.instance, mesh))
                pending.append(mesh.initialized(900))
        return pending

    async def close(self, graceful: bool = True) -> None:
        """Write the engines' sleep/wake/sync logs to ``RUN_DIR/engine_events.jsonl``, stop
        the judge service (and its gateway); with ``graceful``, also leave torch.distributed
        cleanly."""
        try:
            # after a failure an engine may be on a dead node: wait for its log only briefly
            await self._dump_events(timeout=30 if graceful else 3)
        except Exception as e:  # noqa: BLE001 (best effort)
            print(f"relay: engine event logs not written: {e}", file=self.out, flush=True)
        if self.judge_procs is not None:
            await self.judge_procs.stop()
            self.judge_procs = None
        if not graceful:
            return
        try:
            await self.trainer.shutdown.call().result(60)
        except Exception as e:  # noqa: BLE001 (best effort: the workers are stopped next anyway)
            print(f"relay: trainer shutdown: {type(e).__name__}: {e}", file=self.out, flush=True)

    async def _dump_events(self, timeout: float) -> None:
        """One line per engine event: engine, role, instance, t (monotonic, host-wide), event,
        detail. An engine that does not answer within ``timeout`` (dead) is left out."""
        engines = self.rollout + self.judges
        logs = await asyncio.gather(*(e.mesh.events.call_one().result(timeout) for e in engines), return_exceptions=True)
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "engine_events.jsonl"), "a") as f:
            for i, (e, events) in enumerate(zip(engines, logs)):
                if isinstance(events, BaseException):
                    print(f"relay: no event log from {e.role} engine {e.instance or i} ({type(events).__name__}: {events})", file=self.out, flush=True)
                    continue
                for t, what, detail in events:
                    f.write(json.dumps({"engine": f"{e.role}{i if e.role == 'rollout' else i - len(self.rollout)}", "role": e.role,
                                        "instance": e.instance, "t": t, "event": what, "detail": detail}) + "\n")

    # ------------------------------------------------------------------ engines

    async def _each(self, engines: list[Engine], method: str, *args, timeout: float = 600) -> list:
        return await asyncio.gather(*(getattr(e.mesh, method).call_one(*args).result(timeout) for e in engines))

    async def _judge_sleep(self) -> None:
        if not self.judges:
            return
        for name in self.cfg.genrm:
            await self.judge.set_awake.call_one(name, False).result(60)
        await self._each(self.judges, "sleep", ["weights", "kv_cache"], "finish")

    async def _judge_wake(self) -> None:
        if not self.judges:
            return
        await self._each(self.judges, "wake", ["weights", "kv_cache"])
        for name in self.cfg.genrm:
            await self.judge.set_awake.call_one(name, True).result(60)

    async def _gpu_used(self, phase: str, into: dict) -> None:
        """Bytes in use on each actor GPU (every process on it), as the driver reports; on
        GPU only. Recorded as ``mem/gpu_used_<phase>`` (one number per GPU)."""
        mem = (await self.trainer.gpu_memory.call().result(60)).values()
        if mem and mem[0]["total"]:
            into[f"mem/gpu_used_{phase}"] = [m["total"] - m["free"] for m in mem]

    async def _engine_bytes(self, engines: list[Engine]) -> int:
        stats = await self._each(engines, "stats")
        return int(sum(v for s in stats for k, v in s["bytes"].items() if k != "cpu_backup"))

    def _prompt(self, row: Row) -> list[int]:
        """The row's prompt token ids (cached by the prompt's content)."""
        key = ("text", row.prompt) if isinstance(row.prompt, str) else ("chat", json.dumps(row.prompt, sort_keys=True))
        ids = self._prompt_ids.get(key)
        if ids is None:
            ids = self._prompt_ids[key] = prompt_ids(self.tokenizer, row.prompt, self.cfg.apply_chat_template, self.cfg.chat_template_kwargs)
        return ids

    async def _generate_group(self, row: Row, n: int, sampling: dict, seed: int, score: bool, dataset: str = "train") -> list[dict]:
        """n samples of one prompt on the least-loaded rollout engine; scored inline if asked."""
        eng = min(self.rollout, key=lambda e: e.outstanding)
        eng.outstanding += n
        prompt_ids = self._prompt(row)
        try:
            calls = [eng.mesh.generate.call_one(prompt_ids, {**sampling, "seed": seed + j}).result(1800) for j in range(n)]
            results = await asyncio.gather(*calls)
        finally:
            eng.outstanding -= n
        samples = []
        for r in results:
            samples.append({
                "index": row.index, "dataset": dataset, "prompt": row.prompt, "label": row.label, "metadata": {**row.metadata, "label": row.label, "question": question_text(row.prompt)},
                "prompt_ids": prompt_ids, "response_ids": list(r.token_ids), "response": r.text, "rollout_logprobs": list(r.logprobs),
                "finish_reason": r.finish_reason, "weight_version": r.weight_version,
            })
        if score:
            await asyncio.gather(*(self._score(s) for s in samples))
        return samples

    def _reward_name(self) -> str:
        c = self.cfg
        return f"--custom-rm-path {c.custom_rm_path}" if c.custom_rm_path else f"--rm-type {c.rm_type}"

    async def _score(self, sample: dict) -> None:
        """The sample's reward; an error names the reward function and the sample."""
        from reward.rewards import reward_value

        t = time.monotonic()
        try:
            result = await self.reward_fn(sample)
            sample["reward_info"] = result
            sample["reward"] = reward_value(result, self.cfg.reward_key)
        except Exception as e:
            raise RuntimeError(f"the reward ({self._reward_name()}) failed on {_describe_sample(sample)}: {type(e).__name__}: {e}") from e
        finally:
            self._reward_spans.append((t, time.monotonic()))

    async def _score_deferred(self, samples: list[dict], group_size: int) -> float:
        """Defer-swap: rollout sleeps, the judge wakes, the batch is scored, the judge sleeps
        again whatever happened. The post-process hook sees ``args.n_samples_per_prompt ==
        group_size`` (the eval's k for an eval batch), so it groups the batch as it was
        generated. Returns the seconds spent swapping."""
        t = time.monotonic()
        await self._each(self.rollout, "sleep", ["weights", "kv_cache"])
        await self._judge_wake()
        swap = time.monotonic() - t
        try:
            if self.post_process is not None:
                args = self.cfg if group_size == self.cfg.n_samples_per_prompt else dataclasses.replace(self.cfg, n_samples_per_prompt=group_size)
                try:
                    raw, normalized = await self.post_process(args, samples)
                except Exception as e:
                    rows = sorted({s["index"] for s in samples})
                    raise RuntimeError(f"the post-process hook (--custom-reward-post-process-path {self.cfg.custom_reward_post_process_path}) "
                                       f"failed on a batch of {len(samples)} samples (rows {rows[:8]}{' ...' if len(rows) > 8 else ''}, "
                                       f"first: {_describe_sample(samples[0])}): {type(e).__name__}: {e}") from e
                if len(raw) != len(samples) or len(normalized) != len(samples):
                    raise ValueError(f"the post-process hook returned {len(raw)}/{len(normalized)} rewards for {len(samples)} samples")
                for s, r, a in zip(samples, raw, normalized):
                    s["reward"], s["advantage"] = float(r), float(a)
            else:
                await asyncio.gather(*(self._score(s) for s in samples))
        finally:
            t = time.monotonic()
            await self._judge_sleep()
            swap += time.monotonic() - t
        return swap

    # ------------------------------------------------------------------ steps

    def _sampling(self, evaluation: bool = False) -> dict:
        c = self.cfg
        if evaluation:
            return {"temperature": c.eval_temperature, "top_p": c.eval_top_p, "max_new_tokens": c.eval_max_response_len or c.rollout_max_response_len}
        return {"temperature": c.rollout_temperature, "top_p": c.rollout_top_p, "max_new_tokens": c.rollout_max_response_len}

    def _seed(self, step: int, k: int) -> int:
        return random.Random(f"{self.cfg.seed}:{step}:{k}").randrange(1 << 30)

    async def _rollout(self, step: int, score_inline: bool) -> list[dict]:
        rows = self.order.batch(step, self.cfg.rollout_batch_size)
        n = self.cfg.n_samples_per_prompt
        groups = await asyncio.gather(*(self._generate_group(r, n, self._sampling(), self._seed(step, k) * 64, score_inline) for k, r in enumerate(rows)))
        return [s for g in groups for s in g]

    @staticmethod
    def _check_judged(samples: list[dict], what: str) -> None:
        """A batch whose every reward is a judge failure is not trained on: stop with why."""
        infos = [s.get("reward_info") for s in samples]
        if infos and all(isinstance(i, dict) and i.get("format_error") == "judge_error" for i in infos):
            raise RuntimeError(f"{what}: the judge failed on all {len(samples)} samples (after retries); not training on this batch. "
                               "Check the judge engines' health (GET /genrm/health) and the job log")

    def _advantages(self, samples: list[dict]) -> list[float]:
        import torch

        from engines.trainer.loss import group_advantages

        if all("advantage" in s for s in samples):
            return [s["advantage"] for s in samples]
        rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float32)
        return group_advantages(rewards, self.cfg.n_samples_per_prompt).tolist()

    async def _train(self, samples: list[dict], advantages: list[float]) -> dict:
        """Optimizer steps over ``--global-batch-size`` chunks (whole groups), each chunk split
        across the DP ranks (TP ranks of one DP rank get the same shard)."""
        cfg = self.cfg
        seqs = [s["prompt_ids"] + s["response_ids"] for s in samples]
        masks = [[0] * (len(s["prompt_ids"]) - 1) + [1] * len(s["response_ids"]) for s in samples]
        rollout_lp = [[0.0] * (len(s["prompt_ids"]) - 1) + s["rollout_logprobs"] for s in samples]
        order = list(range(len(samples)))
        stats_all: list[dict] = []
        tp = cfg.tensor_model_parallel_size
        for chunk in _groups(order, cfg.global_batch_size):
            shards = [chunk[d :: self.dp] for d in range(self.dp)]
            if any(not s for s in shards):
                shards = [chunk] * self.dp  # fewer samples than DP ranks: every rank takes all
            ref = None
            if self.reference is not None:
                if self.colocate:
                    await self.reference.onload.call().result(600)
                ref = await self._call_ranks(self.reference, "compute_logprobs", [([seqs[i] for i in sh],) for sh in shards], tp)
                if self.colocate:
                    await self.reference.offload.call().result(600)
            args = []
            for d, sh in enumerate(shards):
                a = ([seqs[i] for i in sh], [masks[i] for i in sh], [advantages[i] for i in sh], [rollout_lp[i] for i in sh])
                args.append(a + ((ref[d],) if ref is not None else ()))
            stats = await self._call_ranks(self.trainer, "train_step", args, tp)
            stats_all.append(stats[0])
        out: dict = {}
        for k in stats_all[0]:
            vals = [s[k] for s in stats_all if isinstance(s.get(k), (int, float))]
            if vals:
                out[k] = sum(vals) / len(vals)
        return out

    async def _call_ranks(self, mesh: relay.ActorMesh, method: str, per_dp_args: list[tuple], tp: int) -> list:
        n = len(per_dp_args) * tp
        calls = [getattr(mesh.slice(ranks=r), method).call_one(*per_dp_args[r // tp]).result(3600) for r in range(n)]
        results = await asyncio.gather(*calls)
        return [results[d * tp] for d in range(len(per_dp_args))]

    async def _sync(self) -> dict:
        """Push the trainer's weights to every rollout engine under a new version, then
        check it: each engine reports the version, and a fixed greedy probe's log-prob
        (recorded per step) shows the weights really changed."""
        self.version += 1
        await self._push()
        versions = [s["weight_version"] for s in await self._each(self.rollout, "stats")]
        if versions != [self.version] * len(versions):
            raise RuntimeError(f"weight sync: engines report versions {versions}, expected {self.version}")
        return {"sync/engine_versions": versions}

    async def _push(self) -> None:
        """The trainer's weights, under ``self.version``, into every rollout engine."""
        await self.trainer.push_weights.call([e.mesh for e in self.rollout], self.version, self.cfg.update_weight_buffer_size).result(1800)

    async def _probe(self) -> dict:
        """Greedy one-token answers of every rollout engine to the first prompt: their
        log-probs change when the weights do (and agree across engines)."""
        ids = self._prompt(self.rows[0])
        res = await asyncio.gather(*(e.mesh.generate.call_one(ids, {"temperature": 0.0, "max_new_tokens": 1}).result(300) for e in self.rollout))
        return {"sync/probe_logprobs": [r.logprobs[0] for r in res], "sync/probe_versions": [r.weight_version for r in res]}

    def _reward_metrics(self, samples: list[dict], prefix: str = "reward") -> dict:
        rewards = [s["reward"] for s in samples]
        mean = sum(rewards) / len(rewards)
        std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
        accs = [_correct(s) for s in samples]
        infos = [s["reward_info"] for s in samples if isinstance(s.get("reward_info"), dict)]
        errs = sum(1 for i in infos if i.get("format_error"))
        judged = sum(1 for i in infos if i.get("judge_response"))  # samples whose reward is a judge's verdict
        return {f"{prefix}/mean": mean, f"{prefix}/std": std, f"{prefix}/accuracy": sum(accs) / len(accs), f"{prefix}/format_errors": errs,
                f"{prefix}/judged": judged}

    async def _judge_counts(self) -> dict:
        if self.judge is None:
            return {}
        snap = await self.judge.metrics_snapshot.call_one().result(60)
        stats = await self._each(self.judges, "stats")
        tot: dict = {"requests": 0, "cache_hits": 0, "parse_failures": 0, "latency_sum": 0.0, "latency_count": 0,
                     "engine_requests": sum(s.get("requests_finished", 0) for s in stats)}
        for inst in snap.values():
            for k in ("requests", "cache_hits", "parse_failures"):
                tot[k] += inst.get(k, 0)
            hist = inst.get("latency_s") or {}  # cumulative since start
            tot["latency_sum"] += hist.get("sum", 0.0)
            tot["latency_count"] += hist.get("count", 0)
        return tot

    @staticmethod
    def _judge_deltas(judge0: dict, judge1: dict) -> dict:
        """The judge's work between two :meth:`_judge_counts` snapshots, as ``judge/*`` metrics."""
        if not judge1:
            return {}
        calls = judge1["requests"] - judge0["requests"]
        hits = judge1["cache_hits"] - judge0["cache_hits"]
        lat_n = judge1["latency_count"] - judge0["latency_count"]
        return {"judge/requests": calls, "judge/cache_hits": hits, "judge/engine_calls": calls - hits,
                "judge/cache_hit_rate": hits / calls if calls else 0.0,
                "judge/parse_failures": judge1["parse_failures"] - judge0["parse_failures"],
                "judge/latency_mean": (judge1["latency_sum"] - judge0["latency_sum"]) / lat_n if lat_n else 0.0,
                "judge/engine_requests": judge1["engine_requests"] - judge0["engine_requests"]}

    # ------------------------------------------------------------------ evaluation

    async def evaluate(self, step: int) -> dict:
        """Pass rate and pass@k on the eval prompts (engines must be awake). The configured
        reward scores them; ``eval/exact_accuracy`` is a rule-based check that needs no judge:
        the response's final answer (text after the last "Answer:", else the whole reply)
        equals the label exactly, after stripping whitespace."""
        from reward.dapo_genrm import final_answer

        k = self.cfg.n_samples_per_eval_prompt
        t = time.monotonic()
        groups = await asyncio.gather(*(self._generate_group(r, k, self._sampling(True), self._seed(-1, r.index) * 64, score=not self.defer, dataset="eval")
                                         for r in self.eval_rows))
        samples = [s for g in groups for s in g]
        if self.defer:
            await self._score_deferred(samples, k)
            await self._each(self.rollout, "wake", ["weights", "kv_cache"])
            await self._push()
        correct = [_correct(s) for s in samples]
        exact = [final_answer(s["response"]).strip() == s["label"].strip() for s in samples]
        rec = {
            "kind": "eval", "step": step, "eval/accuracy": sum(correct) / len(correct),
            "eval/pass@k": sum(any(g) for g in _groups(correct, k)) / len(groups), "eval/k": k,
            "eval/exact_accuracy": sum(exact) / len(exact), "eval/samples": len(samples), "time/eval": time.monotonic() - t,
        }
        return rec

    # ------------------------------------------------------------------ checkpoints

    def _ckpt_dir(self, step: int) -> str:
        return os.path.join(self.run_dir, CHECKPOINT_DIR, f"step_{step:06d}")

    async def _save(self, step: int) -> None:
        """All trainer ranks write their shard; ``state.json`` is written last, so a
        checkpoint without it is incomplete and ignored by ``--resume``."""
        path = self._ckpt_dir(step)
        if self.colocate:
            await self.trainer.onload.call().result(600)
        await self.trainer.save_checkpoint.call(path).result(1800)
        if self.colocate:
            await self.trainer.offload.call().result(600)
        tmp = os.path.join(path, STATE_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"next_step": step + 1, "weight_version": self.version}, f)
        os.replace(tmp, os.path.join(path, STATE_FILE))
        if self.cfg.keep_checkpoints:
            self._prune_checkpoints(self.cfg.keep_checkpoints)

    def _complete_checkpoints(self) -> list[str]:
        """Complete checkpoints (those with ``state.json``), oldest first."""
        root = os.path.join(self.run_dir, CHECKPOINT_DIR)
        if not os.path.isdir(root):
            return []
        return [os.path.join(root, d) for d in sorted(os.listdir(root)) if os.path.exists(os.path.join(root, d, STATE_FILE))]

    def _prune_checkpoints(self, keep: int) -> None:
        """``--keep-checkpoints``: delete all but the newest ``keep`` complete checkpoints
        (the newest one is complete before any older one goes)."""
        import shutil

        for path in self._complete_checkpoints()[:-keep]:
            os.remove(os.path.join(path, STATE_FILE))  # incomplete first, so a crash mid-delete is never resumed from
            shutil.rmtree(path, ignore_errors=True)

    def latest_checkpoint(self) -> str | None:
        done = self._complete_checkpoints()
        return done[-1] if done else None

    async def _load_checkpoint(self) -> None:
        """``--resume``: the newest complete checkpoint into the trainer (the rollout engines
        get its weights once they exist); sets the next step and the weight version."""
        path = self.latest_checkpoint()
        if path is None:
            print(f"--resume: no complete checkpoint under {self.run_dir}/{CHECKPOINT_DIR}; starting from step 0", file=self.out, flush=True)
            return
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        await self.trainer.load_checkpoint.call(path).result(1800)
        self.start_step = state["next_step"]
        self.version = state["weight_version"]
        print(f"resumed from {path}: next step {self.start_step}, weight version {self.version}", file=self.out, flush=True)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> dict:
        cfg = self.cfg
        log = MetricsLog(self.run_dir, cfg.num_rollout, self.out)
        last: dict = {}
        try:
            self._training = True
            if self.eval_rows and not cfg.skip_eval_before_train and self.start_step == 0:
                rec = await self.evaluate(0)
                log.write(rec)
                print(f"eval before training: accuracy {rec['eval/accuracy']:.3f} (exact {rec['eval/exact_accuracy']:.3f})", file=self.out, flush=True)
            if cfg.fully_async:
                last = await self._run_async(log)
            else:
                for step in range(self.start_step, cfg.num_rollout):
                    last = await self._step(step)
                    await self._after_step(step, last, log)
        finally:
            log.close()
        return last

    def request_stop(self) -> bool:
        """Ask the loop to checkpoint after the step in progress and stop (raising
        :class:`StoppedWithCheckpoint`); False when the loop has not started training yet
        (nothing to save: the caller stops at once)."""
        if not self._training:
            return False
        self._stop_requested = True
        return True

    async def _after_step(self, step: int, rec: dict, log: MetricsLog) -> None:
        log.write(rec)
        log.progress(step, rec)
        cfg = self.cfg
        last = step + 1 == cfg.num_rollout
        saved = bool(cfg.save_interval) and (step + 1) % cfg.save_interval == 0
        if saved or self._stop_requested:
            await self._save(step)
        if self._stop_requested and not last:
            raise StoppedWithCheckpoint(self._ckpt_dir(step), step + 1)
        periodic = bool(cfg.eval_interval) and (step + 1) % cfg.eval_interval == 0
        if self.eval_rows and (periodic or last):  # the last step is always evaluated
            ev = await self.evaluate(step + 1)
            log.write(ev)
            print(f"eval after step {step + 1}: accuracy {ev['eval/accuracy']:.3f} (exact {ev['eval/exact_accuracy']:.3f}, pass@{ev['eval/k']} {ev['eval/pass@k']:.3f})",
                  file=self.out, flush=True)

    async def _step(self, step: int) -> dict:
        t_step = time.monotonic()
        self._reward_spans.clear()  # e.g. the evaluation's, before this step
        phases: dict[str, float] = {}
        judge0 = await self._judge_counts()
        t = time.monotonic()
        samples = await self._rollout(step, score_inline=not self.defer)
        phases["rollout"] = time.monotonic() - t
        if not self.defer:
            self._check_judged(samples, f"step {step}")
        mem = {"mem/rollout_bytes_generating": await self._engine_bytes(self.rollout)}
        await self._gpu_used("generating", mem)
        swap = 0.0
        if self.defer:
            t = time.monotonic()
            swap += await self._score_deferred(samples, self.cfg.n_samples_per_prompt)
            phases["reward"] = time.monotonic() - t - swap
            self._check_judged(samples, f"step {step}")
        judge1 = await self._judge_counts()
        advantages = self._advantages(samples)
        t = time.monotonic()
        if self.colocate:
            if not self.defer:
                await self._judge_sleep()
                await self._each(self.rollout, "sleep", ["weights", "kv_cache"])
            # (defer-swap: rollout went to sleep before scoring and the judge after it)
            mem["mem/engine_bytes_training"] = await self._engine_bytes(self.rollout + self.judges)
            await self.trainer.onload.call().result(600)
        swap += time.monotonic() - t
        t = time.monotonic()
        train_stats = await self._train(samples, advantages)
        phases["train"] = time.monotonic() - t
        await self._gpu_used("training", mem)
        if self.colocate:
            mem["mem/trainer"] = (await self.trainer.slice(ranks=0).gpu_memory.call_one().result(60))["allocated"]
            t = time.monotonic()
            await self.trainer.offload.call().result(600)
            await self._each(self.rollout, "wake", ["weights"])
            swap += time.monotonic() - t
        t = time.monotonic()
        synced = await self._sync()
        phases["sync"] = time.monotonic() - t
        if self.colocate:
            t = time.monotonic()
            await self._each(self.rollout, "wake", ["kv_cache"])
            if not self.defer:
                await self._judge_wake()
            swap += time.monotonic() - t
        phases["swap"] = swap
        total = time.monotonic() - t_step
        await self._gpu_used("synced", mem)
        rec = self._record(step, samples, train_stats, phases, mem, judge0, judge1, total)
        rec.update(synced)
        rec.update(await self._probe())
        return rec

    def _record(self, step, samples, train_stats, phases, mem, judge0, judge1, total) -> dict:
        rec: dict = {"kind": "train", "step": step, "weight_version": self.version, "samples": len(samples)}
        rec.update(self._reward_metrics(samples))
        lens = [len(s["response_ids"]) for s in samples]
        rec["rollout/response_len"] = sum(lens) / len(lens)
        rec["rollout/tokens_per_s"] = sum(lens) / max(phases.get("rollout", 0.0), 1e-9)
        rec["rollout/truncated"] = sum(s["finish_reason"] == "length" for s in samples) / len(samples)
        versions = [s["weight_version"] for s in samples]
        rec["rollout/min_weight_version"] = min(versions)
        rec.update(self._judge_deltas(judge0, judge1))
        rec.update({f"train/{k}": v for k, v in train_stats.items()})
        rec.update({f"time/{k}": v for k, v in phases.items()})
        if "reward" not in phases:
            # inline rewards overlap the rollout: the seconds during which any reward call ran
            # (not a phase of its own, so not in the orchestration sum below)
            rec["time/reward"] = _union_seconds(self._reward_spans)
        self._reward_spans.clear()
        rec["time/step"] = total
        rec["time/orchestration"] = max(0.0, total - sum(phases.values()))
        rec.update(mem)
        return rec

    # ------------------------------------------------------------------ fully-async

    async def _run_async(self, log: MetricsLog) -> dict:
        """A producer generates and scores groups in data order without waiting for the
        trainer; the trainer takes ``--rollout-batch-size`` groups per step, drops any group
        older than ``--max-staleness`` weight versions, then syncs the new weights.

        Bound (invariant): a group holds one of ``(max_staleness + 1) * rollout_batch_size``
        slots from the moment its generation starts until it has been trained on and the
        weights synced (or it was dropped), so a group starts at most ``max_staleness``
        versions before the step that trains it, and stale drops are rare. Each step record
        counts all judge work since the previous record; a final ``summary`` record counts
        the rest (the producer is drained first), so the records' ``judge/requests`` add up
        to the judge service's own counter."""
        cfg = self.cfg
        n = cfg.n_samples_per_prompt
        bound = cfg.rollout_batch_size * (cfg.max_staleness + 1)
        slots = asyncio.Semaphore(bound)
        queue: asyncio.Queue = asyncio.Queue()
        flow = {"in_flight": 0, "in_flight_max": 0, "generated": 0, "dropped": 0}
        stopping = asyncio.Event()
        inflight: set = set()

        def release(groups: int) -> None:
            flow["in_flight"] -= groups
            for _ in range(groups):
                slots.release()

        async def one(k: int) -> None:
            try:
                row = self.order.batch(k, 1)[0]
                item = await self._generate_group(row, n, self._sampling(), self._seed(k, 0) * 64, score=True)
                flow["generated"] += 1
            except Exception as e:  # noqa: BLE001 (handed to the trainer loop, which stops the job)
                item = e
            queue.put_nowait(item)

        async def produce() -> None:
            k = self.start_step * cfg.rollout_batch_size  # group index in data order
            while not stopping.is_set():
                await slots.acquire()
                if stopping.is_set():
                    break
                flow["in_flight"] += 1
                flow["in_flight_max"] = max(flow["in_flight_max"], flow["in_flight"])
                task = asyncio.ensure_future(one(k))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                k += 1

        producer = asyncio.ensure_future(produce())
        judge_prev = await self._judge_counts()
        last: dict = {}
        try:
            for step in range(self.start_step, cfg.num_rollout):
                t_step = time.monotonic()
                batch, stale = [], 0
                t = time.monotonic()
                while len(batch) < cfg.rollout_batch_size:
                    get = asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait({get, producer}, return_when=asyncio.FIRST_COMPLETED)
                    if get not in done:
                        get.cancel()
                        producer.result()  # the producer failed: raise its error
                        raise RuntimeError("fully-async: the group producer stopped")
                    item = get.result()
                    if isinstance(item, BaseException):
                        raise item
                    if min(s["weight_version"] for s in item) < self.version - cfg.max_staleness:
                        stale += 1
                        flow["dropped"] += 1
                        release(1)
                        continue
                    batch.append(item)
                wait = time.monotonic() - t
                samples = [s for g in batch for s in g]
                t = time.monotonic()
                train_stats = await self._train(samples, self._advantages(samples))
                train_s = time.monotonic() - t
                t = time.monotonic()
                synced = await self._sync()
                sync_s = time.monotonic() - t
                in_flight_max = flow["in_flight_max"]
                release(len(batch))  # trained on and synced: these groups' slots go to new groups
                flow["in_flight_max"] = flow["in_flight"]
                judge_now = await self._judge_counts()
                phases = {"rollout": wait, "train": train_s, "sync": sync_s}
                last = self._record(step, samples, train_stats, phases, {}, judge_prev, judge_now, time.monotonic() - t_step)
                judge_prev = judge_now
                last.update(synced)
                last["rollout/stale_groups_dropped"] = stale
                last["rollout/groups_in_flight_max"] = in_flight_max
                last["rollout/groups_in_flight_bound"] = bound
                last["rollout/staleness_max"] = self.version - 1 - last["rollout/min_weight_version"]
                await self._after_step(step, last, log)
        except BaseException:
            stopping.set()
            producer.cancel()
            for task in list(inflight):
                task.cancel()
            await asyncio.gather(producer, *inflight, return_exceptions=True)
            raise
        stopping.set()
        slots.release()  # wake a producer waiting for a slot, so it sees ``stopping``
        await producer
        # drain: in-flight generations end at once ("abort") and are still scored
        await self._each(self.rollout, "abort", timeout=60)
        await asyncio.wait_for(asyncio.gather(*inflight, return_exceptions=True), 120)
        judge_now = await self._judge_counts()
        summary = {"kind": "summary", "step": cfg.num_rollout, "rollout/groups_generated": flow["generated"],
                   "rollout/groups_dropped": flow["dropped"], "rollout/groups_unused": queue.qsize(),
                   "judge/requests_total": judge_now.get("requests", 0)}
        summary.update(self._judge_deltas(judge_prev, judge_now))
        log.write(summary)
        return last
