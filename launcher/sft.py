"""``relay sft``: supervised fine-tuning with the same Megatron trainer (cross-entropy on the
response tokens), driven by the controller on the plan's actor bundles.

Data: JSONL rows with ``prompt`` (text or chat messages) and ``response`` (the target); the
prompt goes through the chat template like a rollout prompt and the response is followed
by the end-of-turn token. ``--global-batch-size`` rows per step (split across DP ranks),
``--sft-steps`` steps (default: one pass). With ``--eval-prompt-data`` (same schema) the
held-out exact-match accuracy (teacher forced: every response token is the argmax) is
measured every ``--eval-interval`` steps and at the end. The trained model is written as an
HF checkpoint to ``--save-hf`` (default RUN_DIR/hf).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

from .agent import WorkerInfo
from .allocator import Plan
from .config import JobConfig
from .data import PromptOrder, Row, load_rows, prompt_ids, row_keys
from .metrics import MetricsLog
from .rl.checkpoints import write_hf_checkpoint
from .rl.timing import PhaseTimer
from .rl.trainer_group import TrainerGroup, attach_claim
from .trackers import Trackers


class SFTJob:
    def __init__(self, cfg: JobConfig, plan: Plan, workers: list[WorkerInfo], out):
        if not cfg.hf_checkpoint:
            raise ValueError("relay sft needs a model: set --hf-checkpoint")
        if not cfg.prompt_data:
            raise ValueError("relay sft needs data: set --prompt-data (JSONL rows with 'prompt' and 'response')")
        self.cfg, self.plan, self.out = cfg, plan, out
        self.by_bundle = {w.bundle: w for w in workers}
        self.rows = load_rows(cfg.prompt_data, need_response=True, **row_keys(cfg))
        self.eval_rows = None
        if cfg.eval_prompt_data:
            self.eval_rows = load_rows(cfg.eval_prompt_data, "--eval-prompt-data", need_response=True,
                                       **row_keys(cfg))
        self.steps = cfg.sft_steps or max(1, len(self.rows) // cfg.global_batch_size)
        self.run_dir = os.path.abspath(cfg.run_dir)
        self.save_to = os.path.abspath(cfg.save_hf or os.path.join(self.run_dir, "hf"))
        self._encoded: dict[int, tuple[list[int], list[int]]] = {}  # id(row) -> _encode(row)
        self._encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sft-encode")  # the tokenizer's

    async def start(self) -> None:
        from transformers import AutoTokenizer

        cfg = self.cfg
        claim = next((c for c in self.plan.claims if c.role == "actor"), None)
        if claim is None:
            raise ValueError("relay sft trains on the 'actor' GPUs: give --resource an 'actor' entry")
        procs = attach_claim(self.plan, claim, self.by_bundle, "trainer")
        # the ranks have the cores to themselves (no engines): share them out
        threads = max(1, (os.cpu_count() or 1) // claim.size)
        self.trainer = TrainerGroup.spawn_policy(cfg, procs, claim.size, total_iters=self.steps, cpu_threads=threads)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.hf_checkpoint)
        await self.trainer.initialized()

    def _encode(self, row: Row) -> tuple[list[int], list[int]]:
        """(token ids, response mask) of ``row``, tokenized once: the rows come back every
        epoch and every evaluation (tokenizing a batch of 128 chat rows took ~35 ms, a fifth
        of the demo judge's step)."""
        got = self._encoded.get(id(row))  # (the rows live as long as the job: their ids are theirs)
        if got is None:
            got = self._encoded[id(row)] = self._tokenize(row)
        return got

    def _tokenize(self, row: Row) -> tuple[list[int], list[int]]:
        prompt = prompt_ids(self.tokenizer, row.prompt, self.cfg.apply_chat_template, self.cfg.chat_template_kwargs)
        response = self.tokenizer(row.response, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return prompt + response, [0] * (len(prompt) - 1) + [1] * len(response)

    def _shards(self, rows: list[Row]) -> list[tuple[list, list]]:
        """``rows`` split across DP ranks (a DP rank whose shard would be empty takes all
        rows), encoded: (token ids, response masks) per DP rank. Runs on :attr:`_encoder`."""
        dp = self.trainer.dp
        encoded = [[self._encode(r) for r in rows[d::dp] or rows] for d in range(dp)]
        return [([e[0] for e in enc], [e[1] for e in enc]) for enc in encoded]

    def _encode_ahead(self, rows: list[Row]) -> asyncio.Future:
        """:meth:`_shards` of ``rows`` on the one thread that tokenizes (it runs while the ranks
        train: the controller waits then)."""
        return asyncio.get_running_loop().run_in_executor(self._encoder, self._shards, rows)

    async def evaluate(self) -> float:
        hits = []
        for i in range(0, len(self.eval_rows), 256):
            shards = await self._encode_ahead(self.eval_rows[i : i + 256])
            for shard in await self.trainer.call_per_dp("greedy_match", shards):
                hits += shard
        return sum(hits) / len(hits)

    async def run(self) -> dict:
        cfg = self.cfg
        order = PromptOrder(self.rows, cfg.seed)
        log = MetricsLog(self.run_dir, self.steps, self.out, Trackers(self.cfg, self.run_dir))
        rec: dict = {}
        timer = PhaseTimer()
        t0 = timer.clock()
        ahead = self._encode_ahead(order.batch(0, cfg.global_batch_size))  # each step's batch, encoded the step before
        try:
            for step in range(self.steps):
                timer.begin_step()
                with timer.phase("train"):
                    shards = await ahead
                    if step + 1 < self.steps:
                        ahead = self._encode_ahead(order.batch(step + 1, cfg.global_batch_size))
                    stats = await self.trainer.call_per_dp("sft_step", shards)
                rec = {"kind": "sft", "step": step + 1, "train/loss": sum(s["loss"] for s in stats) / len(stats),
                       "train/grad_norm": stats[0]["grad_norm"], "train/lr": stats[0]["lr"], **timer.metrics()}
                last = step == self.steps - 1
                if self.eval_rows and (last or (cfg.eval_interval and (step + 1) % cfg.eval_interval == 0)):
                    rec["eval/accuracy"] = await self.evaluate()
                log.write(rec)
                if last or step % max(1, self.steps // 20) == 0 or "eval/accuracy" in rec:
                    log.progress(step, rec)
        finally:
            log.close()
            if not ahead.cancel() and not ahead.cancelled():  # done: its error (if any) was read or is moot
                ahead.exception()
        await self.save()
        rec["time/total"] = timer.clock() - t0
        accuracy = f"; held-out accuracy {rec['eval/accuracy']:.3f}" if "eval/accuracy" in rec else ""
        print(f"sft: {self.steps} steps in {rec['time/total']:.1f} s; wrote {self.save_to}{accuracy}",
              file=self.out, flush=True)
        return rec

    async def save(self) -> None:
        """The trained weights as an HF checkpoint (launcher/rl/checkpoints.py)."""
        await write_hf_checkpoint(self.trainer, self.cfg.hf_checkpoint, self.save_to)

    async def close(self, graceful: bool = True) -> None:
        self._encoder.shutdown(wait=False, cancel_futures=True)
        if graceful:
            await self.trainer.shutdown(self.out)
