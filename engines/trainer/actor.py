"""``TrainerActor``: one Megatron-core training shard per worker process (sync endpoints:
they run on the actor's thread, so the process's event loop and heartbeats stay free).

Expects torch.distributed's env (MASTER_ADDR, RANK, WORLD_SIZE, ...) from
``relay.setup_torch_distributed``. Tensor parallel size ``tp`` divides the world; the rest is
data parallel. Mixture-of-experts models (qwen3_moe) split their experts over ``ep`` expert-
parallel ranks within data parallel (``ep`` divides the DP size and the expert count). CPU
(gloo) and CUDA (NCCL).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading

import torch

from engines import kv_pool, weight_sync
from engines.settings import settings as engines_settings
from engines.trainer import batching, checkpoint_io
from engines.trainer.batching import micro_batches  # noqa: F401 (re-exported: its home was this module)
from engines.trainer.dist_init import _init_process_group
from engines.trainer.loss import LossConfig, policy_loss, token_weights
from engines.trainer.train_batch import StepStats, TrainBatch, check_response_masks
from engines.weight_sync.sender import WeightSender
from relay import Actor, endpoint

MOE_TP_TRAINING = (
    "training a mixture-of-experts model with tensor parallelism needs Megatron's sequence parallelism, which "
    "needs TransformerEngine or Apex norms (the local spec's torch norm refuses it): train MoE models with "
    "--tensor-model-parallel-size 1 and --expert-model-parallel-size instead (TP > 1 serves log-probs and export)"
)

#: torch.distributed and Megatron's parallel state are per process; two trainers in one
#: process (policy and reference) must not create groups concurrently (group creation is a
#: collective: the order must be the same on every rank).
_PROCESS_SETUP = threading.Lock()


def _cpu_threads(requested: int | None) -> int:
    """A CPU rank's intra-op threads: ``RELAY_TRAINER_CPU_THREADS``, else ``requested`` (relay
    sft's ranks, alone on their cores, ask for cores // ranks), else 1: a CPU job's ranks and
    engines share the cores, and OpenMP teams spinning against each other made a step 3-6x slower."""
    return engines_settings().trainer_cpu_threads or requested or 1


def peak_rss() -> int:
    """This process's peak resident set in bytes (``VmHWM``; 0 where /proc does not say)."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


class TrainerActor(Actor):
    def __init__(
        self,
        model_path: str,
        tp: int = 1,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        clip_grad: float = 1.0,
        lr_decay_style: str = "constant",
        lr_warmup_iters: int = 0,
        total_iters: int = 1000,
        seed: int = 1234,
        loss: dict | None = None,
        micro_batch_tokens: int | None = None,  # None: sized to the GPU (_auto_micro_batch_tokens)
        bf16: bool = False,
        optimizer: str = "auto",
        ep: int = 1,
        moe_aux_loss_coeff: float | None = None,
        cpu_threads: int | None = None,
        adam: tuple = (0.9, 0.999, 1e-8),
        frozen: bool = False,
        recompute: dict | None = None,  # Megatron's recompute_granularity / _method / _num_layers
        pack: bool = False,  # micro-batches packed without padding (batching.packed_inputs)
        reference_beside: bool = False,  # a frozen copy of the model shares the GPU (the KL's reference)
    ):
        self.model_path = model_path
        self.cpu_threads = cpu_threads  # intra-op threads on CPU (see _cpu_threads)
        self.tp = tp
        self.ep = ep  # expert-parallel size (MoE models)
        self.aux_loss_coeff = moe_aux_loss_coeff  # None: the checkpoint's router_aux_loss_coef
        self.opt_args = dict(lr=lr, weight_decay=weight_decay, betas=tuple(adam[:2]), eps=adam[2])
        self.recompute, self.pack = recompute, pack
        self.frozen = frozen  # a reference model: never steps (so bf16 params need no master weights)
        self.clip_grad = clip_grad
        self.schedule = (lr_decay_style, lr_warmup_iters, total_iters)
        self.seed = seed
        self.loss_cfg = LossConfig(**(loss or {}))
        self.micro_batch_tokens = micro_batch_tokens  # padded tokens per forward/backward
        self.reference_beside = reference_beside
        if optimizer not in ("auto", "torch", "megatron"):
            raise ValueError(f"optimizer must be 'auto', 'torch' or 'megatron', not {optimizer!r}")
        if bf16 and optimizer == "torch" and not frozen:
            raise ValueError("bf16 params need fp32 master weights: use optimizer 'megatron' (or 'auto')")
        self.bf16 = bf16
        self.optimizer_kind = optimizer
        self.step = 0
        self.offloaded = False
        self.sender: WeightSender | None = None  # this rank's side of weight sync (made in setup)

    def setup(self) -> None:
        import torch.distributed as dist

        from engines.models.checkpoint import checkpoint_tensors
        from engines.models.model import ModelConfig
        from engines.trainer import cpu_shim
        from engines.trainer.megatron_model import build_gpt, hf_to_megatron, shard_for_rank
        from engines.trainer.moe_convert import select_local_experts

        cpu_shim.install()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        if self.device.type == "cpu":
            torch.set_num_threads(_cpu_threads(self.cpu_threads))
        with _PROCESS_SETUP:
            self._init_parallel(dist)
        self.cfg = ModelConfig.from_dir(self.model_path)
        if self.pack and (self.cfg.hybrid or self.ep > 1):  # packing is not built for these: padded rows
            what = "a hybrid model" if self.cfg.hybrid else "EP > 1"
            print(f"relay trainer: packed micro-batches are not built for {what}; training with padded ones",
                  file=sys.stderr, flush=True)
            self.pack = False
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.model = build_gpt(self.cfg, self.tp, dtype, self.ep, self.aux_loss_coeff,
                               recompute=self.recompute).to(self.device)
        hf = {name: t for _, name, t in checkpoint_tensors(self.model_path)}  # FP8 dequantized
        full = select_local_experts(hf_to_megatron(self.cfg, hf), self.cfg.num_experts, self.ep, self.ep_rank)
        state = shard_for_rank(full, self.tp, self.tp_rank, self.cfg)
        missing, unexpected = self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()}, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise KeyError(
                f"checkpoint does not fit the model: missing {missing[:3]}, unexpected {list(unexpected)[:3]}"
            )
        from engines.trainer.optim import MegatronAdamW, TorchAdamW

        # auto: Megatron's distributed optimizer where it helps (DP > 1: optimizer state
        # sharded over DP) or is needed (bf16 params: fp32 master weights); else torch AdamW.
        kind = self.optimizer_kind
        if kind == "auto":
            kind = "megatron" if (self.dp_size > 1 or self.bf16) else "torch"
        if kind == "megatron":
            self.opt = MegatronAdamW(
                self.model, clip_grad=self.clip_grad, bf16=self.bf16, device=self.device, **self.opt_args
            )
        else:
            self.opt = TorchAdamW(
                self.model,
                clip_grad=self.clip_grad,
                dp_group=self.dp_group,
                dp_size=self.dp_size,
                device=self.device,
                tp_group=self.tp_group,
                tp_size=self.tp,
                ep_groups=(self.ep_group, self.expert_dp_group) if self.ep > 1 else None,
                **self.opt_args,
            )
        if self.micro_batch_tokens is None:
            self.micro_batch_tokens = self._auto_micro_batch_tokens(dist)

    def _auto_micro_batch_tokens(self, dist) -> int:
        """No micro-batch size given: on a GPU the most tokens whose activations fit beside this
        rank's state (and the reference's weights, when it shares the GPU), by
        engines/trainer/memory.py's arithmetic, the least over the ranks (they plan alike). On
        CPU, for a frozen reference (forward only), and for the models that arithmetic was not
        measured on (memory.sized_to_the_gpu): memory.CPU_MICRO_BATCH_TOKENS."""
        from engines.trainer import memory

        cfg = self.cfg
        if self.device.type != "cuda" or self.frozen or not memory.sized_to_the_gpu(bool(cfg.num_experts), cfg.hybrid):
            return memory.CPU_MICRO_BATCH_TOKENS
        params = sum(p.numel() for p in self.model.parameters())
        tokens = memory.auto_micro_batch_tokens(
            torch.cuda.get_device_properties(self.device).total_memory, params, hidden=cfg.hidden_size,
            intermediate=cfg.intermediate_size, layers=cfg.num_layers,
            vocab=cfg.vocab_size, tp=self.tp, dp=self.dp_size, bf16=self.bf16,
            full_recompute=(self.recompute or {}).get("recompute_granularity") == "full",
            beside=params * (2 if self.bf16 else 4) if self.reference_beside else 0)
        if dist.is_initialized() and dist.get_world_size() > 1:
            least = torch.tensor([tokens], device=self.device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            tokens = int(least.item())
        if self.rank == 0:
            print(f"relay trainer: micro-batch tokens {tokens:,} (sized to the GPU; --micro-batch-tokens sets them)",
                  file=sys.stderr, flush=True)
        return tokens

    def _init_parallel(self, dist) -> None:
        """torch.distributed and Megatron's model-parallel groups, once per process (a second
        trainer in the process, the reference, shares them)."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if not dist.is_initialized():
            _init_process_group(dist, "nccl" if self.device.type == "cuda" else "gloo")
        dp = dist.get_world_size() // self.tp
        if self.ep > 1 and dp % self.ep:
            raise ValueError(f"expert parallel size {self.ep} does not divide the data-parallel size {dp} "
                             f"({dist.get_world_size()} ranks / tensor parallel {self.tp})")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=self.tp, expert_model_parallel_size=self.ep
            )
        held = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if held != (self.tp, self.ep):
            raise ValueError(f"this process already runs tensor / expert parallel sizes {held}, not {self.tp, self.ep}")
        model_parallel_cuda_manual_seed(self.seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.ep_rank = parallel_state.get_expert_model_parallel_rank()
        self.ep_group = parallel_state.get_expert_model_parallel_group() if self.ep > 1 else None
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group() if self.ep > 1 else None
        self.rank = dist.get_rank()
        self.sender = WeightSender(self.rank, self.device)

    # ------------------------------------------------------------------ helpers

    def _lr(self) -> float:
        style, warmup, total = self.schedule
        base = self.opt_args["lr"]
        if warmup and self.step < warmup:
            return base * (self.step + 1) / warmup
        if style == "cosine":
            progress = min(1.0, (self.step - warmup) / max(1, total - warmup))
            return base * 0.5 * (1 + math.cos(math.pi * progress))
        return base

    def _begin_step(self) -> None:
        if self.frozen:
            raise RuntimeError("this trainer holds a frozen reference model: it does not train")
        if self.offloaded:
            raise RuntimeError("the trainer is offloaded; onload() before training")
        if self.cfg.num_experts and self.tp > 1:
            raise ValueError(MOE_TP_TRAINING)
        self.model.train()
        self.opt.zero_grad(self._lr())

    def _finish_step(self, what: str) -> float:
        """Average gradients over DP, clip, step the optimizer; returns the norm before
        clipping. A non-finite norm (the same on every rank) raises before any weight changes."""
        norm = self.opt.step(what)
        self.step += 1
        return norm

    def _mask(self, seqs: list, response_masks: list, width: int | None = None) -> torch.Tensor:
        """0/1 over tokens 1..n of each (right-padded) sequence: 1 on response tokens."""
        width = (width or max(len(s) for s in seqs)) - 1
        return batching.padded(response_masks, width, torch.float32).to(self.device)

    def _logprobs(self, seqs, temperature: float = 1.0, width: int | None = None, entropy: str | None = None):
        return batching.logprobs(self.model, self.cfg, seqs, self.device, temperature, width, entropy, self.pack)

    def _micro(self, seqs: list) -> list:
        """``(indices, width)`` per micro-batch; with EP > 1 the schedule the EP group shares
        (dummy rows: None; engines/trainer/batching.py)."""
        return batching.aligned_micro_batches(seqs, self.micro_batch_tokens, self.ep_group, self.pack)

    # ------------------------------------------------------------------ endpoints

    @endpoint
    def compute_logprobs(self, seqs: list, temperature: float = 1.0) -> list:
        """Per-token log-probs of each sequence's tokens 1..n at ``temperature`` (the engines'
        definition: log-softmax of logits / T)."""
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be a positive number, not {temperature!r}")
        self.model.eval()
        out: list = [None] * len(seqs)
        with torch.no_grad():
            for idx, width in self._micro(seqs):
                part = batching.rows(seqs, idx)
                lp = self._logprobs(part, temperature, width).cpu()
                for i, row, sq in zip(idx, lp, part):
                    if i is not None:
                        out[i] = row[: len(sq) - 1].tolist()
        return out

    @endpoint
    def train_step(self, batch: TrainBatch) -> StepStats:
        """One optimizer step of GRPO on ``batch`` (engines/trainer/train_batch.py: the step's
        aggregation, its whole-step denominator when it is one DP rank's shard, the rollout
        temperature of every log-prob). A non-finite loss or gradient raises
        FloatingPointError on every rank before any weight changes."""
        batch.validate()
        self._begin_step()
        # a shard weights its tokens by their share of the whole step and scales by the DP
        # size, which the DP averaging of gradients divides out: the ranks' gradients add up
        denominator = batch.denominator or batch.total() or 1
        scale = self.dp_size if batch.denominator else 1
        entropy = "trained" if self.loss_cfg.entropy_coef else "logged"
        shares: dict = {}
        maxima: dict = {}
        plan = self._micro(batch.tokens)
        for idx, width in plan:
            part = batching.rows(batch.tokens, idx)
            mask = self._mask(part, batching.pick(batch.response_masks, idx, []), width)
            weights = token_weights(mask, batch.aggregation, denominator)
            batching.set_aux_loss_scale(self.cfg, self.model.config, idx, float(weights.sum()) * scale)
            logp, ent = self._logprobs(part, batch.temperature, width, entropy)
            old, rollout, ref = batching.step_logprobs(logp, idx, batch.old_logprobs, batch.rollout_logprobs,
                                                       batch.ref_logprobs)
            adv = torch.tensor(batching.pick(batch.advantages, idx, 0.0), device=self.device, dtype=torch.float32)
            loss, st = policy_loss(logp, old, adv, weights, self.loss_cfg, ref_logp=ref, rollout_logp=rollout,
                                   entropy=ent)
            (loss * scale).backward()
            for k, v in st.items():
                if k.endswith("_max"):
                    maxima[k] = max(maxima.get(k, v), v)
                else:
                    shares[k] = shares.get(k, 0.0) + v
        means = batching.aux_loss_stats(self.cfg, plan)
        norm = self._finish_step(f"GRPO step {self.step} (loss {shares.get('loss', 0.0):.6g} on this rank)")
        return StepStats(norm, self.opt.lr, shares, means, maxima)

    @endpoint
    def sft_step(self, seqs: list, response_masks: list) -> dict:
        """One optimizer step of supervised fine-tuning: cross-entropy on the response tokens
        (token-level mean). Used by ``relay sft`` and the demo's warm-up."""
        check_response_masks(seqs, response_masks)
        self._begin_step()
        total = max(1, sum(sum(m) for m in response_masks))
        loss_sum = 0.0
        plan = self._micro(seqs)
        for idx, width in plan:
            part = batching.rows(seqs, idx)
            mask = self._mask(part, batching.pick(response_masks, idx, []), width)
            batching.set_aux_loss_scale(self.cfg, self.model.config, idx, float(mask.sum()) / total)
            loss = -(self._logprobs(part, 1.0, width) * mask).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        stats = {"loss": loss_sum}
        stats.update(batching.aux_loss_stats(self.cfg, plan))
        stats.update(grad_norm=self._finish_step(f"SFT step {self.step} (loss {loss_sum:.6g})"), lr=self.opt.lr)
        return stats

    @endpoint
    def greedy_match(self, seqs: list, response_masks: list) -> list:
        """Per sequence: does the argmax prediction equal every response token (teacher
        forced)? For a one-token answer this is exactly greedy decoding's accuracy."""
        check_response_masks(seqs, response_masks)
        self.model.eval()
        out: list = [False] * len(seqs)
        for idx, width in self._micro(seqs):
            part = batching.rows(seqs, idx)
            ids, pos, tgt = batching.model_inputs(part, width, self.device)
            pad = {"padding_mask": batching.padding_mask(part, width or ids.shape[1] + 1, self.device)}
            with torch.no_grad():
                logits = self.model(ids, pos, None, **(pad if self.cfg.num_experts else {}))
                if self.tp > 1:
                    from megatron.core.tensor_parallel import (
                        gather_from_tensor_model_parallel_region,
                    )

                    logits = gather_from_tensor_model_parallel_region(logits)
                pred = logits.argmax(-1)
            rmask = self._mask(part, batching.pick(response_masks, idx, []), width).bool()
            ok = ((pred == tgt) | ~rmask).all(dim=1)
            for i, x in zip(idx, ok.cpu()):
                if i is not None:
                    out[i] = bool(x)
        return out

    @contextlib.contextmanager
    def _hf_weights(self, copy: bool = True, lazy: bool = False):
        """The full weights under HF names (TP shards gathered; a collective over TP), on the
        trainer's device. Works while offloaded: the params come back for the body only, so
        with ``copy=False`` (views of the params where TP = 1) use them inside the body.
        ``lazy``: q/k/v are views of the fused weight (``weight_sync.shaped``), for the
        in-place weight sync only."""
        from engines.trainer.megatron_model import gather_full, megatron_to_hf

        with self.opt.params_present():
            full = gather_full(
                self.model, self.tp_group if self.tp > 1 else None, copy, self.ep_group, self.cfg.num_experts, self.cfg
            )
            yield megatron_to_hf(self.cfg, full, lazy=lazy)

    @endpoint
    def export_hf(self, bucket_bytes: int = 512 << 20) -> list:
        """The full weights under HF names, in buckets of about ``bucket_bytes``, as CPU
        tensors (what the relay path sends)."""
        with self._hf_weights() as full:
            return [{n: t.detach().cpu().contiguous() for n, t in b} for b in weight_sync.buckets(full, bucket_bytes)]

    @endpoint
    def push_weights(
        self,
        engines: list,
        version: int,
        bucket_bytes: int = 512 << 20,
        timeout: float = 600.0,
        transport: str = "auto",
    ) -> int:
        """Weight sync of ``version`` into each engine (an EngineActor mesh of one engine):
        :meth:`engines.weight_sync.sender.WeightSender.push`. Every trainer rank must call
        (the TP gather). Returns the bytes this rank sent."""
        plan = self.sender.plan(engines, transport, timeout)
        lazy = self.sender.in_place_only(plan, self.rank)  # q/k/v as views of the fused weight
        with self._hf_weights(copy=False, lazy=lazy) as full:
            return self.sender.push(plan, full, bucket_bytes, version, timeout)

    @endpoint
    def offload(self) -> int:
        """Move params, optimizer state (and, torch path, grads) to host buffers (allocated
        once, pinned on GPU) and free the device memory. Returns the bytes moved."""
        if self.offloaded:
            return 0
        moved = self.opt.offload()
        self.offloaded = True
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return moved

    @endpoint
    def onload(self) -> None:
        """Params back on the device before this returns; the optimizer state follows on a side
        stream (engines/trainer/optim.py). What this worker's sleeping engines lent is the
        trainer's now, even when it stayed resident: dropped into the allocator's cache, not
        given back to the driver, so the state and the activations reuse it without a driver
        allocation (the next offload empties the cache)."""
        kv_pool.drain(self.device)
        if not self.offloaded:
            return
        self.opt.onload()
        self.offloaded = False

    @endpoint
    def save_checkpoint(self, path: str) -> None:
        """Weights, optimizer state, steps and RNG states through Megatron's dist_checkpointing
        (engines/trainer/checkpoint_io.py): every rank calls."""
        self.opt.settle()
        checkpoint_io.save(self, path)

    @endpoint
    def load_checkpoint(self, path: str) -> int:
        """Every rank calls; any TP / DP / EP layout and either optimizer kind (format 2), the
        layout that wrote it (format 1). Returns the step it holds."""
        self.opt.settle()
        self.step = checkpoint_io.load(self, path)
        return self.step

    @endpoint
    def optimizer_info(self) -> dict:
        """Which optimizer path runs (``torch`` / ``megatron``), whether its state is sharded
        over DP, the DP size, the params' dtype and the dtype the optimizer updates in; the
        padded tokens of a micro-batch (given, or sized to the GPU at setup)."""
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        return {
            "micro_batch_tokens": self.micro_batch_tokens,
            "kind": self.opt.kind,
            "distributed": self.opt.kind == "megatron",
            "dp": self.dp_size,
            "params_dtype": name(next(self.model.parameters()).dtype),
            "master_dtype": name(self.opt.master_dtype),
        }

    @endpoint
    def gpu_memory(self, release_cache: bool = False) -> dict:
        """Device memory now: free and total (driver view: every process on this GPU),
        allocated by torch in this process, and the GPU's ``uuid``; ``peak``: the most allocated
        since the process started (on CPU: its peak resident set). ``release_cache``: first
        give the allocator's cached, unused blocks back to the device. The rest is zero on CPU."""
        if self.device.type != "cuda":
            return {"free": 0, "total": 0, "allocated": 0, "uuid": None, "peak": peak_rss()}
        torch.cuda.synchronize()
        if release_cache:
            kv_pool.release(self.device)
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return {"free": free, "total": total, "allocated": torch.cuda.memory_allocated(),
                "uuid": weight_sync.device_uuid(self.device), "peak": torch.cuda.max_memory_allocated()}

    @endpoint
    def shutdown(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.sender is not None:
            self.sender.close(30.0)
        if dist.is_initialized():
            dist.barrier()
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
