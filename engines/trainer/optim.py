"""The trainer's two optimizer paths, behind one small interface (``zero_grad``, ``step``,
``offload`` / ``onload``, ``params_present``, ``load_state_dict`` of a format-1 checkpoint;
engines/trainer/checkpoint_io.py reads and writes their state through Megatron's dist_checkpointing):

- :class:`TorchAdamW`: ``torch.optim.AdamW`` on the model's own (fp32) parameters; data
  parallel replicas average their gradients with one all-reduce. Every rank holds the whole
  optimizer state. The default for fp32 with DP = 1.
- :class:`MegatronAdamW`: Megatron-core's ``DistributedDataParallel`` (contiguous grad and
  param buffers) and ``DistributedOptimizer`` (ZeRO-1: gradients are reduce-scattered, each
  DP rank updates its 1/DP shard of fp32 master weights and Adam moments, the updated
  params are all-gathered). Used when DP > 1 or with bf16 params (fp32 master weights).
  On CPU its ``device='cuda'`` literals go through :func:`cpu_shim.megatron_cuda_calls`.

Offload frees device memory by shrinking the tensors' storages to zero bytes after copying
them into host buffers that are allocated once (pinned on CUDA) and reused; the tensors
(and every view of them, such as Megatron's params inside its param buffer) stay the same
Python objects, so onload restores them bit for bit. On CUDA, onload returns once the
parameters are back; the optimizer's state (Adam moments, fp32 master shards) copies on a
side stream meanwhile, behind the step's forward and backward passes, and whatever reads or
frees it first waits for it (:meth:`_Optimizer.settle`: the optimizer step, offload,
checkpoints).
"""

from __future__ import annotations

import contextlib
import math

import torch

from engines.trainer import cpu_shim


def fuse_on_cuda(opt: torch.optim.Optimizer) -> None:
    """Each parameter group of ``opt`` (torch's Adam/AdamW) whose parameters are all CUDA
    floats steps through torch's fused kernel (``fused=True``: one pass over the state,
    where the default foreach path makes several; the 4B shape on an H200 spent 76 ms of a
    637 ms step there, docs/PERFORMANCE.md). Its ``step`` counters then live on the
    parameters' device: checkpoint loaders make them with :func:`adam_step_counter`."""
    for group in opt.param_groups:
        params = group["params"]
        if params and all(p.is_cuda and p.is_floating_point() for p in params):
            group["fused"], group["foreach"] = True, False


def clip_in_adam_step(opt: torch.optim.Optimizer, coef: float) -> bool:
    """Where every group of ``opt`` runs torch's fused kernel (:func:`fuse_on_cuda`), have its
    next ``step`` multiply the gradients by ``coef`` as it reads them (torch's ``grad_scale``,
    which the kernel divides by: no pass of its own over the gradients; Megatron's fallback
    scaling without apex made three over the fp32 gradients) and return True; else False, and
    the caller scales them. :func:`end_adam_step` clears it after the step."""
    groups = [g for g in opt.param_groups if g["params"]]
    if not groups or not all(g.get("fused") for g in groups):
        return False
    opt.grad_scale = torch.full((), 1.0 / coef, dtype=torch.float32, device=groups[0]["params"][0].device)
    return True


def end_adam_step(opt: torch.optim.Optimizer) -> None:
    """Forget a :func:`clip_in_adam_step` scale (the next step's gradients are unscaled)."""
    opt.grad_scale = None


def adam_step_counter(opt: torch.optim.Optimizer, value: float | torch.Tensor) -> dict:
    """Per parameter of ``opt``, its Adam ``step`` counter of ``value`` as torch keeps it: a
    float32 scalar, on the parameter's device in a fused group (:func:`fuse_on_cuda`), else on
    the host."""
    value = float(value)
    return {p: torch.tensor(value, dtype=torch.float32, device=p.device if group.get("fused") else "cpu")
            for group in opt.param_groups for p in group["params"]}


def sum_tp_partial_grads(model, attr: str = "grad") -> None:
    """Sum over the tensor-parallel group the gradients that each TP rank holds only in part:
    weights every head shares while each rank computes only its own heads — the q/k
    layernorm weights, a hybrid model's q/k norms and gated norm (marked ``tp_partial_grad``)
    — as Megatron's ``finalize_model_grads`` does. Without it the TP replicas of those weights
    get different (partial) gradients and drift apart. ``attr``: ``grad`` or ``main_grad``."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    import torch.distributed as dist

    grads = [
        getattr(p, attr)
        for n, p in model.named_parameters()
        if (getattr(p, "tp_partial_grad", False) or (model.config.qk_layernorm and ("q_layernorm" in n or
                                                                                   "k_layernorm" in n)))
        and getattr(p, attr, None) is not None
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=parallel_state.get_tensor_model_parallel_group())
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


def _is_expert(p) -> bool:
    """A MoE expert's parameter (Megatron sets ``allreduce = False`` on them)."""
    return not getattr(p, "allreduce", True)


class _StorageOffloader:
    """Moves whole tensor storages to host buffers and back (see the module docstring).
    ``zero_only`` storages (gradient buffers: every step starts by zeroing them) are freed
    without a copy and come back zeroed."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: dict[int, torch.Tensor] = {}  # storage index -> host buffer, reused
        self._side = None  # the CUDA stream deferred onload copies run on (made on first use)

    def offload(self, storages: list, zero_only: list) -> int:
        moved = 0
        pin = self.device.type == "cuda"
        self._sizes = []
        for i, st in enumerate(storages):
            n = st.nbytes()
            host = self._host.get(i)
            if host is None or host.numel() != n:
                host = self._host[i] = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
            host.untyped_storage().copy_(st, non_blocking=pin)
            moved += n
            self._sizes.append(n)
        if pin:
            torch.cuda.synchronize(self.device)
        for st in storages:
            st.resize_(0)
        self._zero_sizes = [st.nbytes() for st in zero_only]
        for st in zero_only:
            st.resize_(0)
        return moved

    def onload(self, storages: list, zero_only: list, later: int = 0):
        """Every storage back on the device. On CUDA the last ``later`` of ``storages`` copy
        on a side stream: returns the event the caller's stream must wait for before it
        reads or frees them (None when nothing is left copying). Their memory is allocated
        here, on the caller's stream, so freeing it after that wait is ordered as usual."""
        cuda = self.device.type == "cuda"
        now = len(storages) - (later if cuda else 0)
        for st, n in zip(storages, self._sizes):
            st.resize_(n)
        for i, st in enumerate(storages[:now]):
            st.copy_(self._host[i].untyped_storage(), non_blocking=cuda)
        for st, n in zip(zero_only, self._zero_sizes):
            st.resize_(n)
            torch.empty(0, dtype=torch.uint8, device=self.device).set_(st).zero_()
        if not cuda:
            return None
        pending = None
        if now < len(storages):
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            self._side.wait_stream(torch.cuda.current_stream(self.device))  # after the allocations
            with torch.cuda.stream(self._side):
                for i in range(now, len(storages)):
                    storages[i].copy_(self._host[i].untyped_storage(), non_blocking=True)
            pending = torch.cuda.Event()
            pending.record(self._side)
        torch.cuda.current_stream(self.device).synchronize()
        return pending

    @contextlib.contextmanager
    def restored(self, storages: list):
        """While offloaded: the first ``len(storages)`` offloaded storages (the params) back
        on the device for the body, freed again after it (their host copies stay valid)."""
        for i, st in enumerate(storages):
            st.resize_(self._sizes[i])
            st.copy_(self._host[i].untyped_storage())
        try:
            yield
        finally:
            for st in storages:
                st.resize_(0)


def _unique_storages(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(st)
    return out


def no_weight_decay(name: str, param) -> bool:
    """Megatron's rule: norms (1-D weights) and biases are exempt from weight decay."""
    return param.ndim == 1 or name.endswith(".bias")


def check_finite_norm(norm: float, what: str) -> None:
    """Raises FloatingPointError (before the optimizer changes any weight) for a non-finite
    gradient norm; ``what`` names the step."""
    if not math.isfinite(norm):
        raise FloatingPointError(
            f"{what}: the gradient norm is {norm}; not stepping (no weight changed). A reward, advantage or "
            "log-prob reached the loss as NaN or inf: check the reward function and --lr")


class _Optimizer:
    """What both paths share: lr and master dtype from ``self.opt``, and offload / onload /
    ``params_present`` over the storages that :meth:`_storages` names as (params, state to
    copy, storages that come back zeroed)."""

    opt = None
    _held: tuple | None = None
    _pending = None  # the CUDA event of the state's onload copies, until settle() waits for it
    weight_decay = 0.0

    def __init__(self, device: torch.device):
        self.device = device
        self._offloader = _StorageOffloader(device)

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype the optimizer updates in (fp32 master shards under bf16 params)."""
        return self.opt.param_groups[0]["params"][0].dtype

    def _set_lr(self, lr: float) -> None:
        """The step's learning rate, and each group's weight decay: the configured one times
        the group's ``wd_mult`` (0 for norms and biases, as Megatron's param scheduler sets it)."""
        for g in self.opt.param_groups:
            g["lr"] = lr
            g["weight_decay"] = self.weight_decay * g.get("wd_mult", 1.0)

    def _storages(self) -> tuple[list, list, list, list]:
        """(params, copied now, state copied behind the next passes, storages that come back
        zeroed)."""
        raise NotImplementedError

    def offload(self) -> int:
        self.settle()
        params, now, state, zeroed = self._held = self._storages()
        return self._offloader.offload(params + now + state, zeroed)

    def onload(self) -> None:
        """Params (and what must be present at once) back before this returns; the state
        follows on a side stream on CUDA (:meth:`settle`)."""
        params, now, state, zeroed = self._held
        self._pending = self._offloader.onload(params + now + state, zeroed, later=len(state))
        self._held = None

    def settle(self) -> None:
        """The caller's stream waits for the state's onload copies (no host wait): call before
        reading, writing or freeing optimizer state."""
        if self._pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending)
            self._pending = None

    @contextlib.contextmanager
    def params_present(self):
        """While offloaded: the parameters back on the device for the body (read only)."""
        if self._held is None:
            yield
            return
        with self._offloader.restored(self._held[0]):
            yield


class TorchAdamW(_Optimizer):
    """``torch.optim.AdamW`` on the model's parameters; DP gradients averaged by all-reduce;
    the gradient norm is the whole model's (TP shards summed, replicated params once)."""

    kind = "torch"

    def __init__(
        self,
        model,
        lr: float,
        weight_decay: float,
        clip_grad: float,
        dp_group,
        dp_size: int,
        device,
        tp_group=None,
        tp_size: int = 1,
        ep_groups: tuple | None = None,
        betas: tuple = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        super().__init__(device)
        self.model = model
        self.weight_decay = weight_decay
        self.tp_group, self.tp_size = tp_group, tp_size
        # expert parallel: (EP group, expert-DP group); expert params (Megatron marks them
        # allreduce=False) average over expert-DP and count once per EP rank in the norm
        self.ep_groups = ep_groups
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if not no_weight_decay(n, p)], "wd_mult": 1.0},
                  {"params": [p for n, p in named if no_weight_decay(n, p)], "wd_mult": 0.0}]
        self.opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, weight_decay=weight_decay,
                                     betas=betas, eps=eps)
        fuse_on_cuda(self.opt)
        self._set_lr(lr)
        self.clip_grad = clip_grad
        self.dp_group, self.dp_size = dp_group, dp_size

    def zero_grad(self, lr: float) -> None:
        self._set_lr(lr)
        self.opt.zero_grad(set_to_none=True)

    def _reduce_grads(self) -> None:
        """Data parallel: average gradients over the DP group (each rank's loss is the mean
        over its own shard of the batch, so ranks should get equal shares)."""
        if self.dp_size == 1:
            return
        import torch.distributed as dist

        # Expert params' grads already sum every EP rank's tokens (the token dispatch's
        # backward): they are reduced over the expert-DP group only, divided by the full DP size.
        groups = [(False, self.dp_group)] + ([(True, self.ep_groups[1])] if self.ep_groups else [])
        for expert, group in groups:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None and _is_expert(p) == expert]
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat /= self.dp_size
            off = 0
            for g in grads:
                g.copy_(flat[off : off + g.numel()].view_as(g))
                off += g.numel()

    def step(self, what: str = "step") -> float:
        """Average gradients over DP, clip to ``clip_grad`` (0: no clipping), step; returns
        the gradient norm before clipping. A non-finite norm (every rank computes the same
        one) raises before the step."""
        self.settle()
        self._reduce_grads()
        sum_tp_partial_grads(self.model)
        norm = self._clip(what)
        try:
            self.opt.step()
        finally:
            end_adam_step(self.opt)
        return norm

    def _clip(self, what: str) -> float:
        """Clip by the global norm, as ``clip_grad_norm_`` would on the unsharded model: a
        TP-sharded parameter's shards are summed over the TP group, a replicated one (norms,
        biases) counted once."""
        import torch.distributed as dist
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        counted = [
            p
            for p in self.model.parameters()
            if p.grad is not None and (self.tp_size == 1 or param_is_not_tensor_parallel_duplicate(p))
        ]

        def sq_sum(ps):
            return torch.stack([p.grad.detach().float().pow(2).sum() for p in ps]).sum() if ps else torch.zeros(())

        sq = sq_sum([p for p in counted if not _is_expert(p)]).to(self.device)
        experts = sq_sum([p for p in counted if _is_expert(p)]).to(self.device)
        if self.ep_groups:  # each EP rank holds its own experts
            dist.all_reduce(experts, group=self.ep_groups[0])
        sq = sq + experts
        if self.tp_size > 1:
            dist.all_reduce(sq, group=self.tp_group)
        norm = float(sq.sqrt())
        check_finite_norm(norm, what)
        if self.clip_grad > 0:
            coef = min(1.0, self.clip_grad / (norm + 1e-6))
            if coef < 1.0 and not clip_in_adam_step(self.opt, coef):
                for g in grads:
                    g.mul_(coef)
        return norm

    def _storages(self) -> tuple[list, list, list, list]:
        """(params, grads (copied at once: they may be read after an onload), Adam state, none)."""
        params = list(self.model.parameters())
        state = [v for p in params for v in self.opt.state.get(p, {}).values() if torch.is_tensor(v) and v.numel() > 1]
        grads = [p.grad for p in params if p.grad is not None]
        return _unique_storages(params), _unique_storages(grads), _unique_storages(state), []

    def load_state_dict(self, sd: dict) -> None:
        """A format-1 checkpoint's state (engines/trainer/checkpoint_legacy.py)."""
        self.settle()
        self.opt.load_state_dict(sd)


class MegatronAdamW(_Optimizer):
    """Megatron DDP + DistributedOptimizer (AdamW, fp32 master weights and moments sharded
    over DP). ``self.ddp`` wraps the model; params live inside the DDP param buffers."""

    kind = "megatron"

    def __init__(self, model, lr: float, weight_decay: float, clip_grad: float, bf16: bool, device,
                 betas: tuple = (0.9, 0.999), eps: float = 1e-8):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides

        super().__init__(device)
        self.model = model
        self.weight_decay = weight_decay
        model.config.bf16 = bf16
        with cpu_shim.megatron_cuda_calls():
            self.ddp = DistributedDataParallel(
                model.config,
                DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False
                ),
                model,
            )
            config = OptimizerConfig(
                optimizer="adam",
                lr=lr,
                weight_decay=weight_decay,
                bf16=bf16,
                params_dtype=torch.bfloat16 if bf16 else torch.float32,
                clip_grad=clip_grad if clip_grad > 0 else float("inf"),
                use_distributed_optimizer=True,
                adam_beta1=betas[0],
                adam_beta2=betas[1],
                adam_eps=eps,
            )
            # norms and biases in groups of wd_mult 0 (applied by _set_lr: no param scheduler runs)
            overrides = get_standard_config_overrides(config)
            self.opt = get_megatron_optimizer(config, [self.ddp], config_overrides=overrides)
        self._set_lr(lr)
        self._parts = getattr(self.opt, "chained_optimizers", [self.opt])
        for part in self._parts:
            fuse_on_cuda(part.optimizer)

    def zero_grad(self, lr: float) -> None:
        self._set_lr(lr)
        self.ddp.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self, what: str = "step") -> float:
        """Reduce-scatter the gradients (averaged over DP), clip, update this rank's shard,
        all-gather the params; returns the gradient norm before clipping. A non-finite norm
        (NaN or inf in any rank's gradients reaches every rank's norm through its all-reduce)
        raises on every rank before the update: Megatron's own ``step`` checks only under a
        loss scaler, so fp32 and bf16 steps would apply them. Megatron's step in its parts
        (prepare, norm, clip, update) with the check between: the norm is the one pass over
        the gradients it makes anyway."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self.settle()
        with cpu_shim.megatron_cuda_calls(), torch.no_grad():
            self.ddp.finish_grad_sync()
            sum_tp_partial_grads(self.model, "main_grad")
            if self.opt.prepare_grads():
                raise FloatingPointError(f"{what}: the loss scaler found non-finite gradients; not stepping")
            norm = float(self.opt.get_grad_norm())
            check_finite_norm(norm, what)
            for part in self._parts:
                clip = part.config.clip_grad
                if getattr(part, "is_stub_optimizer", False) or not 0 < clip < math.inf:
                    continue
                coef = clip / (norm + 1e-6)  # as clip_grad_by_total_norm_fp32
                if coef < 1.0 and not clip_in_adam_step(part.optimizer, coef) and (params := part.get_parameters()):
                    clip_grad_by_total_norm_fp32(
                        params, clip, norm,
                        use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
            try:
                if not self.opt.step_with_ready_grads():
                    raise FloatingPointError(f"{what}: the optimizer skipped the step")
            finally:
                for part in self._parts:
                    end_adam_step(part.optimizer)
        return norm

    def _storages(self) -> tuple[list, list, list, list]:
        """(param buffers, none, optimizer state + fp32 master shards, grad buffers)."""
        buffers = list(self.ddp.buffers) + list(getattr(self.ddp, "expert_parallel_buffers", []))
        params = _unique_storages(b.param_data for b in buffers if b.param_data is not None)
        owned = {st.data_ptr() for st in params}
        state = []
        for part in self._parts:
            for g in getattr(part, "shard_fp32_from_float16_groups", []):
                state.extend(g)
            for s in part.optimizer.state.values():
                state.extend(v for v in s.values() if torch.is_tensor(v) and v.numel() > 1)
        state = [st for st in _unique_storages(state) if st.data_ptr() not in owned]
        grads = _unique_storages(b.grad_data for b in buffers)
        return params, [], state, grads

    def load_state_dict(self, sd: dict) -> None:
        """A format-1 checkpoint's state (engines/trainer/checkpoint_legacy.py), collective over
        DP: DP rank 0's ``sd`` is scattered to the shards (no_grad: with
        fp32 params the master shards are views of the params)."""
        self.settle()
        with cpu_shim.megatron_cuda_calls(), torch.no_grad():
            self.opt.load_state_dict(sd["groups"])
            for part, shard in zip(self._parts, sd["shards"]):
                # torch AdamW keeps 'step' per param. Megatron (written for fused Adam: step
                # per group) restores it above as ONE tensor shared by all params, which
                # AdamW would then increment once per param; and its shard loader expects
                # 'step' in the shard file. Set it aside and give each param its own copy.
                steps = {p: st.pop("step") for p, st in part.optimizer.state.items() if "step" in st}
                part.load_parameter_state_from_dp_zero(shard)
                counters = adam_step_counter(part.optimizer, 0)
                for p, step in steps.items():
                    part.optimizer.state[p]["step"] = counters[p].copy_(step)
