"""``TrainerActor``: one Megatron-core training shard per worker process (sync endpoints:
they run on the actor's thread, so the process's event loop and heartbeats stay free).

Expects torch.distributed's env (MASTER_ADDR, RANK, WORLD_SIZE, ...) from
``relay.setup_torch_distributed``. Tensor parallel size ``tp`` divides the world; the rest is
data parallel. CPU (gloo) and CUDA (NCCL).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading

import torch

import relay
from engines import weight_sync
from engines.weight_sync.sender import WeightSender
from relay import Actor, endpoint

from .loss import LossConfig, policy_loss

#: torch.distributed and Megatron's parallel state are per process; two trainers in one
#: process (policy and reference) must not create groups concurrently (group creation is a
#: collective: the order must be the same on every rank).
_PROCESS_SETUP = threading.Lock()


def _init_process_group(dist, backend: str) -> None:
    """Join the trainer's torch.distributed group (MASTER_ADDR/PORT, RANK, WORLD_SIZE from
    relay.setup_torch_distributed; rank 0 hosts the store). The rendezvous is bounded by
    ``RELAY_DIST_INIT_TIMEOUT`` seconds (default 60): every rank announces itself in the
    store, and a rank that cannot see all of them in time raises, naming itself and the
    ranks (bundle, node, host) that never came, instead of waiting out torch's 30-minute
    default. Collectives afterwards keep torch's long default timeout."""
    import datetime
    import time

    from torch.distributed import TCPStore

    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    cfg = relay.settings()
    limit = cfg.dist_init_timeout
    me = f"bundle {cfg.bundle}, node {cfg.node}, host {cfg.host}"
    where = f"trainer rank {rank} of {world} ({me})"
    hint = (
        "Check that every node is up and reaches that address (RELAY_HOST / the network interface); "
        "RELAY_DIST_INIT_TIMEOUT sets the limit"
    )
    deadline = time.monotonic() + limit
    try:
        store = TCPStore(
            addr, port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=limit), wait_for_workers=False
        )
    except Exception as e:  # noqa: BLE001 (re-raised with who and where)
        raise RuntimeError(
            f"{where}: torch.distributed did not form within {limit:g} s: could not join the store of rank 0 at "
            f"{addr}:{port} "
            f"({e}). {hint}"
        ) from None
    store.set(f"relay/joined/{rank}", where)
    while True:
        missing = [r for r in range(world) if not store.check([f"relay/joined/{r}"])]
        if not missing:
            break
        if time.monotonic() > deadline:
            expected = "; ".join(f"rank {r}" for r in missing)
            raise RuntimeError(
                f"{where}: torch.distributed did not form within {limit:g} s: not every rank joined the store at "
                f"{addr}:{port} "
                f"(missing: {expected}; the controller's placement table says which bundle each rank is). {hint}"
            )
        time.sleep(0.05)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def micro_batches(seqs: list, budget: int) -> list[list[int]]:
    """Consecutive index groups whose padded size (count x longest) stays within ``budget``
    tokens (a longer single sequence is a micro-batch of its own)."""
    out, cur, width = [], [], 0
    for i, s in enumerate(seqs):
        w = max(width, len(s))
        if cur and w * (len(cur) + 1) > budget:
            out.append(cur)
            cur, w = [], len(s)
        cur.append(i)
        width = w
    if cur:
        out.append(cur)
    return out


def _aligned(base: torch.Tensor, rows: list) -> torch.Tensor:
    """``base`` with each row's leading entries replaced by the given values."""
    out = base.clone()
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, device=base.device, dtype=base.dtype)
    return out


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
        micro_batch_tokens: int = 8192,
        bf16: bool = False,
        optimizer: str = "auto",
    ):
        self.model_path = model_path
        self.tp = tp
        self.opt_args = dict(lr=lr, weight_decay=weight_decay)
        self.clip_grad = clip_grad
        self.schedule = (lr_decay_style, lr_warmup_iters, total_iters)
        self.seed = seed
        self.loss_cfg = LossConfig(**(loss or {}))
        self.micro_batch_tokens = micro_batch_tokens  # padded tokens per forward/backward
        if optimizer not in ("auto", "torch", "megatron"):
            raise ValueError(f"optimizer must be 'auto', 'torch' or 'megatron', not {optimizer!r}")
        if bf16 and optimizer == "torch":
            raise ValueError("bf16 params need fp32 master weights: use optimizer 'megatron' (or 'auto')")
        self.bf16 = bf16
        self.optimizer_kind = optimizer
        self.step = 0
        self.offloaded = False
        self.sender: WeightSender | None = None  # this rank's side of weight sync (made in setup)

    def setup(self) -> None:
        import torch.distributed as dist
        from safetensors.torch import load_file

        from engines.model import ModelConfig

        from . import cpu_shim
        from .megatron_model import build_gpt, hf_to_megatron, shard_for_rank

        cpu_shim.install()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        with _PROCESS_SETUP:
            self._init_parallel(dist)
        self.cfg = ModelConfig.from_dir(self.model_path)
        self.model = build_gpt(self.cfg, tp=self.tp, dtype=torch.bfloat16 if self.bf16 else torch.float32).to(
            self.device
        )
        files = sorted(f for f in os.listdir(self.model_path) if f.endswith(".safetensors"))
        hf = {}
        for f in files:
            hf.update(load_file(os.path.join(self.model_path, f)))
        state = shard_for_rank(hf_to_megatron(self.cfg, hf), self.tp, self.tp_rank)
        missing, unexpected = self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()}, strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise KeyError(
                f"checkpoint does not fit the model: missing {missing[:3]}, unexpected {list(unexpected)[:3]}"
            )
        from .optim import MegatronAdamW, TorchAdamW

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
                **self.opt_args,
            )

    def _init_parallel(self, dist) -> None:
        """torch.distributed and Megatron's model-parallel groups, once per process (a second
        trainer in the process, the reference, shares them)."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if not dist.is_initialized():
            _init_process_group(dist, "nccl" if self.device.type == "cuda" else "gloo")
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        elif parallel_state.get_tensor_model_parallel_world_size() != self.tp:
            raise ValueError(
                f"this process already runs tensor parallel size "
                f"{parallel_state.get_tensor_model_parallel_world_size()}, not {self.tp}"
            )
        model_parallel_cuda_manual_seed(self.seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = parallel_state.get_data_parallel_world_size()
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
        if self.offloaded:
            raise RuntimeError("the trainer is offloaded; onload() before training")
        self.model.train()
        self.opt.zero_grad(self._lr())

    def _finish_step(self) -> float:
        """Average gradients over DP, clip, step the optimizer; returns the norm before clipping."""
        norm = self.opt.step()
        self.step += 1
        return norm

    def _batch(self, seqs: list):
        from .megatron_model import causal_mask

        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        ids = ids.to(self.device)
        s = width - 1
        pos = torch.arange(s, device=self.device)[None].expand(len(seqs), -1)
        return ids[:, :-1], pos, causal_mask(s).to(self.device), ids[:, 1:]

    def _mask(self, seqs: list, response_masks: list) -> torch.Tensor:
        """0/1 over tokens 1..n of each (right-padded) sequence: 1 on response tokens."""
        mask = torch.zeros(len(seqs), max(len(s) for s in seqs) - 1, device=self.device)
        for i, m in enumerate(response_masks):
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
        return mask

    def _logprobs(self, seqs, temperature: float = 1.0) -> torch.Tensor:
        from .megatron_model import token_logprobs

        ids, pos, mask, tgt = self._batch(seqs)
        return token_logprobs(self.model, ids, pos, mask, tgt, temperature)

    # ------------------------------------------------------------------ endpoints

    @endpoint
    def compute_logprobs(self, seqs: list, temperature: float = 1.0) -> list:
        """Per-token log-probs of each sequence's tokens 1..n (the engines' definition)."""
        self.model.eval()
        out: list = [None] * len(seqs)
        with torch.no_grad():
            for idx in micro_batches(seqs, self.micro_batch_tokens):
                part = [seqs[i] for i in idx]
                lp = self._logprobs(part, temperature).cpu()
                for i, row, sq in zip(idx, lp, part):
                    out[i] = row[: len(sq) - 1].tolist()
        return out

    @endpoint
    def train_step(
        self,
        seqs: list,
        response_masks: list,
        advantages: list,
        rollout_logprobs: list | None = None,
        ref_logprobs: list | None = None,
        temperature: float = 1.0,
    ) -> dict:
        """One optimizer step of GRPO on these sequences. ``response_masks[i][t]`` marks the
        response tokens among tokens 1..n of sequence i; ``rollout_logprobs`` / ``ref_logprobs``
        (aligned the same way) feed TIS / mismatch_kl and the KL loss."""
        self._begin_step()
        token_level = self.loss_cfg.aggregation == "token"
        total = sum(sum(m) for m in response_masks) if token_level else len(seqs)
        stats: dict = {}
        # Micro-batches under the token budget; each one's loss is weighted by its share of
        # the batch (tokens or samples), so the summed gradient equals the whole batch's.
        for idx in micro_batches(seqs, self.micro_batch_tokens):
            part = [seqs[i] for i in idx]
            mask = self._mask(part, [response_masks[i] for i in idx])
            with torch.no_grad():
                old = self._logprobs(part, temperature)
            rollout = _aligned(old, [rollout_logprobs[i] for i in idx]) if rollout_logprobs is not None else None
            ref = _aligned(old, [ref_logprobs[i] for i in idx]) if ref_logprobs is not None else None
            logp = self._logprobs(part, temperature)
            adv = torch.tensor([advantages[i] for i in idx], device=self.device, dtype=torch.float32)
            loss, st = policy_loss(logp, old, adv, mask, self.loss_cfg, ref_logp=ref, rollout_logp=rollout)
            weight = (float(mask.sum()) if token_level else len(idx)) / max(total, 1)
            (loss * weight).backward()
            for k, v in st.items():
                stats[k] = stats.get(k, 0.0) + v * weight
        stats["grad_norm"] = self._finish_step()
        stats["lr"] = self.opt.lr
        return stats

    @endpoint
    def sft_step(self, seqs: list, response_masks: list) -> dict:
        """One optimizer step of supervised fine-tuning: cross-entropy on the response tokens
        (token-level mean). Used by ``relay sft`` and the demo's warm-up."""
        self._begin_step()
        total = max(1, sum(sum(m) for m in response_masks))
        loss_sum = 0.0
        for idx in micro_batches(seqs, self.micro_batch_tokens):
            part = [seqs[i] for i in idx]
            mask = self._mask(part, [response_masks[i] for i in idx])
            loss = -(self._logprobs(part) * mask).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = self._finish_step()
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr": self.opt.lr}

    @endpoint
    def greedy_match(self, seqs: list, response_masks: list) -> list:
        """Per sequence: does the argmax prediction equal every response token (teacher
        forced)? For a one-token answer this is exactly greedy decoding's accuracy."""
        self.model.eval()
        out: list = [False] * len(seqs)
        for idx in micro_batches(seqs, self.micro_batch_tokens):
            part = [seqs[i] for i in idx]
            ids, pos, mask, tgt = self._batch(part)
            with torch.no_grad():
                logits = self.model(ids, pos, mask)
                if self.tp > 1:
                    from megatron.core.tensor_parallel import (
                        gather_from_tensor_model_parallel_region,
                    )

                    logits = gather_from_tensor_model_parallel_region(logits)
                pred = logits.argmax(-1)
            rmask = self._mask(part, [response_masks[i] for i in idx]).bool()
            ok = ((pred == tgt) | ~rmask).all(dim=1)
            for i, x in zip(idx, ok.cpu()):
                out[i] = bool(x)
        return out

    @contextlib.contextmanager
    def _hf_weights(self, copy: bool = True):
        """The full weights under HF names (TP shards gathered; a collective over TP), on the
        trainer's device. Works while offloaded: the params come back for the body only, so
        with ``copy=False`` (views of the params where TP = 1) use them inside the body."""
        from .megatron_model import gather_full, megatron_to_hf

        with self.opt.params_present():
            yield megatron_to_hf(self.cfg, gather_full(self.model, self.tp_group if self.tp > 1 else None, copy=copy))

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
        with self._hf_weights(copy=False) as full:
            return self.sender.push(plan, weight_sync.buckets(full, bucket_bytes), version, timeout)

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
        if not self.offloaded:
            return
        self.opt.onload()
        self.offloaded = False

    @endpoint
    def save_checkpoint(self, path: str) -> None:
        """Weights (this rank's shard), optimizer, step and RNG states; written to a temporary
        name and renamed, so a crash never leaves a half-written checkpoint. Data-parallel
        replicas hold the same weights: only DP rank 0 of each TP rank writes (the
        distributed optimizer's shards are gathered there first: every rank must call)."""
        from megatron.core import parallel_state

        if self.offloaded:
            raise RuntimeError("the trainer is offloaded; onload() before saving a checkpoint")
        opt_state = self.opt.state_dict()
        if parallel_state.get_data_parallel_rank() != 0:
            return
        os.makedirs(path, exist_ok=True)
        state = {
            "model": {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")},
            "opt": opt_state,
            "optimizer": self.opt.kind,
            "step": self.step,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        final = os.path.join(path, f"trainer-tp{self.tp_rank}.pt")
        tmp = final + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, final)

    @endpoint
    def load_checkpoint(self, path: str) -> int:
        """Every rank reads its TP rank's file (a collective over DP with the distributed
        optimizer)."""
        if self.offloaded:
            raise RuntimeError("the trainer is offloaded; onload() before loading a checkpoint")
        state = torch.load(os.path.join(path, f"trainer-tp{self.tp_rank}.pt"), weights_only=False)
        if state.get("optimizer", "torch") != self.opt.kind:
            raise ValueError(
                f"checkpoint holds {state.get('optimizer', 'torch')!r} optimizer state; this trainer runs "
                f"{self.opt.kind!r} (set optimizer= to match)"
            )
        self.model.load_state_dict(state["model"], strict=False)
        self.opt.load_state_dict(state["opt"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        return self.step

    @endpoint
    def optimizer_info(self) -> dict:
        """Which optimizer path runs (``torch`` / ``megatron``), whether its state is sharded
        over DP, the DP size, the params' dtype and the dtype the optimizer updates in."""
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        return {
            "kind": self.opt.kind,
            "distributed": self.opt.kind == "megatron",
            "dp": self.dp_size,
            "params_dtype": name(next(self.model.parameters()).dtype),
            "master_dtype": name(self.opt.master_dtype),
        }

    @endpoint
    def gpu_memory(self) -> dict:
        """Device memory now: free and total (driver view: every process on this GPU) and
        allocated by torch in this process. All zero on CPU."""
        if self.device.type != "cuda":
            return {"free": 0, "total": 0, "allocated": 0}
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {"free": free, "total": total, "allocated": torch.cuda.memory_allocated()}

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
