"""The built-in torch engine (the embedded default): continuous batching over a paged KV
cache, sampling with per-token log-probs, sleep/wake with real memory release, and weight
updates by HF name. CPU and CUDA.

Threading: every tensor operation runs on one engine thread (``_step``); the asyncio side
only queues requests and resolves their futures. Requests join and leave the running batch
at every step. A request whose prompt does not fit in the free KV blocks waits; when decode
runs out of blocks, the newest running request is preempted (its blocks freed, recomputed
later), so exhaustion queues instead of failing.

A step is three calls: the :class:`.scheduler.Scheduler` plans it, the
:class:`.model_runner.ModelRunner` runs the model (and the :class:`.sampler.Sampler` picks
the tokens), the scheduler records the tokens and ends the finished requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time

import torch

from engines.builtin.block_manager import BlockManager
from engines.builtin.model_runner import ModelRunner
from engines.builtin.prompts import encode_prompt
from engines.builtin.sampler import Sampler
from engines.builtin.scheduler import Scheduler
from engines.builtin.sequence import Sequence
from engines.builtin.stepper import Stepper
from engines.interface import (
    CONSTRAINTS,
    Engine,
    EngineFailed,
    GenerateResult,
    RequestFault,
    check_tags,
    checked_sampling,
)
from engines.settings import settings as engines_settings

log = logging.getLogger("relay.engine")
STEP_FAILURE_LOG_EVERY = 60.0  # seconds between two log lines about failed engine steps


class TorchEngine(Engine):
    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        kv_cache_tokens: int | None = None,
        mem_fraction_static: float = 0.5,
        block_size: int = 16,
        max_running: int = 256,
        weights_mode: str = "discard",
        name: str = "engine",
        max_prefill_tokens: int | None = None,
        cuda_graph: bool = True,
        share_prefix: bool = True,
        cpu_threads: int | None = None,
        tp: tuple[str, int, int] | None = None,
        max_context_len: int | None = None,
        ep_size: int = 1,
        run_ahead: bool | None = None,
        lend_kv: bool = False,
    ):
        """``tp``: (address, port, size) of the tensor-parallel group whose rank 0 this engine
        is (engines/builtin/tp.py: :func:`~.tp.start_engine` starts the followers first).
        ``max_context_len``: prompt + max_new_tokens of a request at most (else it is refused
        with a ValueError naming the limit; the judge's ``engine_config.max_context_len``).
        ``ep_size``: a MoE model's experts in that many expert-parallel groups of the
        engine's ranks (``engine_config.ep_size``; engines/models/moe.py). ``run_ahead``: launch
        decode steps before the last one's tokens are read (engines/builtin/stepper.py); default:
        on CUDA (on CPU the device is the host: nothing to overlap). ``lend_kv``: a sleep hands
        the KV cache's tensors, whole, to the next engine of this process that wakes on the
        GPU (engines/kv_pool.py) instead of freeing them — memory freed and asked for
        again at once waits for the driver to clear it (~2.6 ms/GB on an H200); the launcher
        sets it for colocated engines, which share their worker with the GPU's trainer (which
        frees what is still lent before it trains). Not with ``tp``."""
        self.max_context_len = max_context_len
        if weights_mode not in ("discard", "backup"):
            raise ValueError("weights_mode must be 'discard' (rollout: re-synced after wake) "
                             "or 'backup' (judge: kept in CPU memory)")
        from transformers import AutoTokenizer

        self.name = name
        self.device = torch.device(device)
        if dtype is None:
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, dtype)
        self.block_size = block_size
        self.max_running = max_running
        self.blocks = BlockManager(block_size, max_running)
        self.tp = None
        if tp is not None and tp[2] > 1:
            from engines.builtin.tp_group import TPGroup

            self.tp = TPGroup(tp[0], tp[1], 0, tp[2], self.device)
        self.runner = ModelRunner(model_path, self.blocks, device=self.device, dtype=self.dtype,
                                  weights_mode=weights_mode, name=name, kv_cache_tokens=kv_cache_tokens,
                                  mem_fraction_static=mem_fraction_static, cuda_graph=cuda_graph, tp=self.tp,
                                  ep_size=ep_size, lend_kv=lend_kv)
        self.cfg = self.runner.cfg
        self.model = self.runner.model
        self.weights = self.runner.weights
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos.add(self.tokenizer.eos_token_id)
        self.sampler = Sampler(self.tokenizer, self.eos)
        # Prompts admitted in one step are prefilled together, padded to the longest: this
        # caps (prompts x longest prompt) so a burst of long prompts is prefilled over several
        # steps instead of exhausting memory (a single prompt is always admitted).
        max_prefill_tokens = max_prefill_tokens or (32768 if self.device.type == "cuda" else 8192)
        # Requests admitted together with identical tokens (the n samples of one prompt) are
        # prefilled once and share its full KV blocks (reference-counted); each gets its own
        # copy of the last, partial block, which its samples then write.
        self.scheduler = Scheduler(self.blocks, max_running=max_running, max_prefill_tokens=max_prefill_tokens,
                                   share_prefix=share_prefix)
        self._next_rid = 0  # request ids, in arrival order
        self._paused = False
        self._failed: BaseException | None = None
        self._step_failures = 0  # steps that raised and were recovered from
        self._step_failure_logged = -STEP_FAILURE_LOG_EVERY  # when the last one was logged
        self._exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-step")
        if self.device.type == "cpu":
            # Intra-op threads of the step thread only (OpenMP's setting is per calling
            # thread). A decode step is hundreds of small ops: forking and joining an OpenMP
            # team around each costs more than it saves, and colocated CPU workers already
            # share the cores.
            threads = cpu_threads or engines_settings().engine_cpu_threads
            self._exec.submit(torch.set_num_threads, threads).result()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self.stepper = Stepper(self.scheduler, self.runner, self.sampler, paused=lambda: self._paused,
                               run_ahead=self.device.type == "cuda" if run_ahead is None else run_ahead)
        self._requests_done = 0  # requests answered (any finish reason)
        self._requests_faulted = 0  # requests that failed a step on their own (RequestFault)
        self._t0 = time.monotonic()
        self.events: list[tuple] = []  # (monotonic time, event, detail): sleep/wake/sync log

    @property
    def weight_version(self) -> int:
        return self.weights.version

    # ------------------------------------------------------------------ requests (asyncio side)

    async def generate(self, prompt, sampling=None, chat_template_kwargs=None) -> GenerateResult:
        request_sampling = checked_sampling(sampling)
        constrained = [k for k in CONSTRAINTS if getattr(request_sampling, k) is not None]
        if constrained:
            raise ValueError(f"{constrained[0]} (constrained decoding) runs on SGLang engines only (--engine sglang): "
                             "the built-in engine cannot constrain its output")
        ids = encode_prompt(self.tokenizer, self.cfg.vocab_size, prompt, chat_template_kwargs)
        need = len(ids) + request_sampling.max_new_tokens
        capacity = self.blocks.num_blocks * self.block_size
        if need > capacity:
            raise ValueError(f"request needs {need} tokens of KV cache (prompt {len(ids)} + max_new_tokens "
                             f"{request_sampling.max_new_tokens}) but the engine holds {capacity}")
        if self.max_context_len is not None and need > self.max_context_len:
            raise ValueError(f"request of {need} tokens (prompt {len(ids)} + max_new_tokens "
                             f"{request_sampling.max_new_tokens}) exceeds the engine's max_context_len "
                             f"{self.max_context_len}")
        if need > self.cfg.max_position_embeddings:
            raise ValueError(f"request of {need} tokens exceeds the model's "
                             f"{self.cfg.max_position_embeddings} positions")
        if not self.weights.valid:
            raise RuntimeError(f"{self.name}: weights were discarded by sleep(); update_weights() before generating")
        if self.runner.k is None:
            raise RuntimeError(f"{self.name}: the KV cache is asleep; wake(['kv_cache']) before generating")
        if self._failed is not None:
            raise EngineFailed(f"{self.name}: the engine failed and serves no more requests: {self._failed!r}")
        loop = asyncio.get_running_loop()
        gen = None
        if request_sampling.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(request_sampling.seed)
        seq = Sequence(self._next_rid, ids, request_sampling, loop.create_future(), loop, gen,
                       weight_version=self.weight_version)
        self._next_rid += 1
        self.scheduler.add(seq)
        self._ensure_loop()
        self._wakeup.set()
        try:
            return await seq.future
        except asyncio.CancelledError:  # the caller left (its future is cancelled): free its place
            if seq.finish_reason is None:
                self.scheduler.request_abort(seq.request_id)
                self._wakeup.set()
            raise

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._paused or not self.scheduler.has_work():
                self._wakeup.clear()
                if not self._paused and self.scheduler.has_work():
                    continue
                await self._wakeup.wait()
                continue
            try:
                done = await loop.run_in_executor(self._exec, self.stepper.steps)
            except Exception as e:  # noqa: BLE001 (every caller gets the error; nothing waits forever)
                self._step_failures += 1
                broken = await loop.run_in_executor(self._exec, self._recover, e)
                if broken is not None:
                    self._fail_all(broken)
                    return
                continue
            for seq in done:
                self._resolve(seq)

    def _resolve(self, seq: Sequence) -> None:
        if seq.future.done():
            return
        text = seq.text_before_stop
        if text is None:
            text = self.tokenizer.decode(seq.output, skip_special_tokens=seq.sampling.skip_special_tokens)
        self._requests_done += 1
        seq.future.set_result(GenerateResult(list(seq.output), text, list(seq.logprobs), seq.finish_reason,
                                             len(seq.prompt), seq.weight_version))

    # ------------------------------------------------------------------ the step (engine thread)

    def _recover(self, exc: BaseException) -> BaseException | None:
        """Engine thread, after a step raised: rebuild the KV bookkeeping and block tables
        from scratch (every running request is recomputed later, like a preempted one),
        release a device's cached allocations (an out-of-memory step), then check the engine
        still computes (:meth:`ModelRunner.self_test`). The step's requests run again apart
        (the scheduler's quarantine: no innocent request fails); a request that failed a step
        alone, having failed one before, gets :class:`RequestFault`. Returns None when the engine computes (the
        requests run next), else the error that shows it cannot go on."""
        culprits = self.scheduler.reset_after_failure()
        now = time.monotonic()
        if now - self._step_failure_logged >= STEP_FAILURE_LOG_EVERY:  # a flood of failed steps logs a line a minute
            self._step_failure_logged = now
            log.error("%s: engine step failed (%d so far; a line per %g s at most); its requests run again apart, "
                      "a request that fails a step alone twice is refused: %r", self.name, self._step_failures,
                      STEP_FAILURE_LOG_EVERY, exc)
        self.runner.drop_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            self.runner.self_test()
        except Exception as e:  # noqa: BLE001 - reported as the reason the engine gives up
            error = EngineFailed(f"{self.name}: the engine failed and serves no more requests: {e!r}")
            broken = e
        else:
            error = RequestFault(f"this request failed the engine's steps, the last with no other request in it, "
                                 f"so on its own ({exc!r}); the requests that ran with it ran again without it")
            broken = None
        self._requests_faulted += len(culprits)
        for seq in culprits:
            seq.loop.call_soon_threadsafe(_settle_error, seq.future, error)
        return broken

    def _fail_all(self, exc: BaseException) -> None:
        """The engine cannot go on: fail every pending request, release their KV blocks and
        refuse new requests with :class:`EngineFailed`; ``health()`` reports unhealthy."""
        self._failed = exc
        log.error("%s: the engine cannot go on after a failed step (its self-test failed); "
                  "failing %d pending request(s): %r", self.name, self.scheduler.pending_count(), exc)
        message = f"{self.name}: the engine failed and serves no more requests: {exc!r}"
        for seq in self.scheduler.drop_all():
            if not seq.future.done():
                seq.future.set_exception(EngineFailed(message))

    # ------------------------------------------------------------------ control

    async def abort(self, request_ids=None) -> int:
        """Abort all (None) or the given requests; they finish with reason "abort"."""
        n = self.scheduler.pending_count()
        if request_ids is None:  # every request that exists now (not later arrivals)
            self.scheduler.request_abort(before=self._next_rid)
        else:
            for rid in request_ids:
                self.scheduler.request_abort(rid)
        self._ensure_loop()  # the step loop consumes the abort queue
        self._wakeup.set()
        if self._paused:  # aborts are processed even while paused
            done = await asyncio.get_running_loop().run_in_executor(self._exec, self.scheduler.apply_aborts)
            for seq in done:
                self._resolve(seq)
        return n

    async def pause(self) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False
        if self._wakeup is not None:
            self._wakeup.set()

    async def _drain(self, drain: str) -> None:
        if drain == "abort":
            await self.abort()
        elif drain != "finish":
            raise ValueError("drain must be 'abort' or 'finish'")
        while self.scheduler.has_work() and self._failed is None:
            if self._paused:
                await self.resume()
            await asyncio.sleep(0.005)

    async def sleep(self, tags=("weights", "kv_cache"), drain: str = "abort") -> None:
        tags = check_tags(tags)
        await self._drain(drain)
        await asyncio.get_running_loop().run_in_executor(self._exec, self.runner.sleep, tags)
        self.events.append((time.monotonic(), "sleep", tags))

    async def wake(self, tags=("weights", "kv_cache")) -> None:
        tags = check_tags(tags)
        await asyncio.get_running_loop().run_in_executor(self._exec, self.runner.wake, tags)
        self.events.append((time.monotonic(), "wake", tags))

    # ------------------------------------------------------------------ weights

    async def update_weights(self, buckets, version: int) -> None:
        """Copy HF-named tensors into the model (all names must be covered once the weights
        were discarded); generation afterwards uses them and reports ``version``."""
        await asyncio.get_running_loop().run_in_executor(self._exec, self.weights.update, buckets, version)
        self.events.append((time.monotonic(), "update_weights", version))

    def weight_sync_info(self) -> dict:
        """What a trainer needs to pick the transport (CUDA IPC needs the same physical GPU),
        and what waking takes: ``weights_bytes``, and ``wake_bytes`` (the free memory a wake of
        the weights and the KV cache needs: ``ModelRunner.wake_bytes``)."""
        return dict(self.weights.sync_info(), wake_bytes=self.runner.wake_bytes())

    async def update_weights_from_ipc(self, handle: dict | list, metas: list, version: int, last: bool = True) -> None:
        """Colocated weight sync by CUDA IPC: one flat bucket (``handle`` a dict) or the
        trainer's storages shared in place (a list of handles, ``metas`` views of them); see
        ``Weights.receive_ipc``. ``last`` completes ``version``."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._exec, self.weights.receive_ipc, handle, metas, version, last)
        if last:
            self.events.append((time.monotonic(), "update_weights", version))

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group", backend: str = "nccl",
                                        timeout_s: float = 600.0) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset`` (the trainer is rank 0);
        returns once every member joined, raises after ``timeout_s`` otherwise."""
        from engines.weight_sync import BroadcastGroup

        if group_name in self.weights.groups:
            raise ValueError(f"{self.name}: weight-update group {group_name!r} exists; destroy it first")
        group = await asyncio.to_thread(BroadcastGroup, master_address, master_port, rank_offset, world_size, backend,
                                        timeout_s, group_name)
        self.weights.groups[group_name] = group

    async def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list, version: int,
                                              group_name: str = "weight_update_group", last: bool = True) -> None:
        """Receive one bucket (the trainer broadcasts it as one flat buffer laid out by
        ``weight_sync.metas_for``) and copy it in. ``last`` completes ``version``."""
        group = self.weights.groups.get(group_name)
        if group is None:
            raise RuntimeError(f"{self.name}: no weight-update group {group_name!r}; init_weights_update_group() first")
        await asyncio.get_running_loop().run_in_executor(self._exec, self.weights.receive_broadcast, group, names,
                                                         dtypes, shapes, version, last)
        if last:
            self.events.append((time.monotonic(), "update_weights", version))

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        group = self.weights.groups.pop(group_name, None)
        if group is not None:
            group.close()

    # ------------------------------------------------------------------ state

    async def health(self) -> dict:
        task = self._loop_task
        ok = self._failed is None and (task is None or not task.done() or task.exception() is None)
        out = {"status": "healthy" if ok else "unhealthy", "name": self.name}
        if self._failed is not None:
            out["error"] = repr(self._failed)
        return out

    async def stats(self) -> dict:
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        graphs = self.runner.graphs
        kv_present = self.runner.k is not None
        return {
            "bytes": self.runner.memory_bytes(),
            "running": len(self.scheduler.running),
            "waiting": self.scheduler.waiting_count(),
            "tokens_per_s": self.stepper.tokens_out / elapsed,
            "tokens_generated": self.stepper.tokens_out,
            "requests_finished": self._requests_done,
            "step_failures": self._step_failures,
            "requests_faulted": self._requests_faulted,
            "steps_run_ahead": self.stepper.steps_ahead,
            "weight_version": self.weight_version,
            "kv_blocks_free": len(self.blocks.free_blocks),
            "prefill_tokens": self.runner.prefill_tokens,
            "kv_blocks_total": self.blocks.num_blocks if kv_present else 0,
            # the longest request (prompt + max_new_tokens) it takes: KV cache, positions, max_context_len
            "max_context_tokens": min(v for v in (self.blocks.num_blocks * self.block_size,
                                                  self.cfg.max_position_embeddings, self.max_context_len) if v),
            "paused": self._paused,
            "pid": os.getpid(),
            "device": str(self.device),
            "tp_size": 1 if self.tp is None else self.tp.size,
            "ep_size": self.cfg.ep_size,
            "cuda_graphs": graphs.batch_sizes() if graphs is not None else [],  # captured batch sizes
            # since start: every capture (a sleep and a wake drop the graphs) and its seconds
            "cuda_graph_captures": self.runner.graph_captures,
            "cuda_graph_capture_s": self.runner.graph_capture_s,
            "weight_update_groups": sorted(self.weights.groups),
            "asleep": [t for t, present in (("weights", self.weights.present), ("kv_cache", kv_present))
                       if not present],
        }

    async def close(self) -> None:
        """Abort what is in flight and release the KV cache and the weights."""
        await self.abort()
        loop = asyncio.get_running_loop()
        if self.tp is not None:
            self.tp.closing = True
        try:
            await loop.run_in_executor(self._exec, self.runner.sleep, ("kv_cache",))
            if self.tp is not None:
                await loop.run_in_executor(self._exec, self.runner.stop_followers)
        except Exception as e:  # noqa: BLE001 (closing: a tensor-parallel follower may be gone already)
            log.warning("%s: closing: %r", self.name, e)
        if self.tp is not None:
            self.tp.close()
        self.weights.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._exec.shutdown(wait=False, cancel_futures=True)


def _settle_error(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
