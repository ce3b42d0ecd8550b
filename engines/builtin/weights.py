"""The model's weights as a resource: released and restored by sleep/wake (``discard``:
re-synced by the trainer after wake; ``backup``: kept in a CPU buffer), replaced by HF
name through ``update_weights``, CUDA IPC or an NCCL broadcast, and the version they are.

Every method but :meth:`sync_info` runs on the engine thread. Releasing or restoring the
parameters moves their memory: the caller drops the CUDA graphs that point at it."""

from __future__ import annotations

import os
import uuid

import torch

from engines.models.fused_decode import pack_projections, unpack_projections
from engines.models.model import ModelConfig
from engines.models.weight_names import copy_all, place_weight


class Weights:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, device: torch.device, mode: str, name: str,
                 mirror=None):
        self.mirror = mirror  # rank 0 of a tensor-parallel engine: (op, *args) -> the followers run it next
        self.model = model
        self.cfg = cfg
        self.device = device
        self.mode = mode  # "discard" | "backup"
        self.name = name
        self.version = 0
        self.present = True  # the parameters hold memory
        self.valid = True  # ... and the model's values (wake after a discarding sleep: not yet)
        self.backup: dict[str, torch.Tensor] | None = None
        self.backup_current = False  # the backup holds the values the parameters hold now
        self.seen: set[str] = set()  # names updated since the last completed version
        self.groups: dict = {}  # group name -> weight_sync.BroadcastGroup
        self.engine_id = uuid.uuid4().hex  # lets a trainer keep one broadcast group per set of engines
        self.shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) if self.present else 0

    def full_nbytes(self) -> int:
        """What the parameters hold when present (this rank's shard), asleep or not."""
        return sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in self.shapes.values())

    def backup_nbytes(self) -> int:
        return 0 if self.backup is None else sum(t.numel() * t.element_size() for t in self.backup.values())

    # ------------------------------------------------------------------ sleep / wake

    def release(self) -> None:
        """Free the parameters' memory (``backup``: copied first to a CPU buffer, pinned
        on GPU, allocated once and reused by every later sleep; not copied again while it
        still holds their values: a judge's weights, unchanged since its last sleep).
        Idempotent."""
        if not self.present:
            return
        if self.mode == "backup" and not (self.backup is not None and self.backup_current):
            if self.backup is None:
                pin = self.device.type == "cuda"
                self.backup = {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
                               for n, p in self.model.named_parameters()}
            for n, p in self.model.named_parameters():
                self.backup[n].copy_(p.data, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.backup_current = True
        self._empty_parameters()

    def restore(self) -> None:
        """Allocate the parameters again: with the backup's values, or (``discard``) to be
        filled by an update covering every tensor before generating. Idempotent."""
        if self.present:
            return
        for n, p in self.model.named_parameters():
            shape, dtype = self.shapes[n]
            p.data = torch.empty(shape, dtype=dtype, device=self.device)
        pack_projections(self.model, keep_values=False)  # q/k/v and gate/up: views of packed tensors
        if self.mode == "backup":
            for n, p in self.model.named_parameters():
                p.data.copy_(self.backup[n], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.present = True
        self.valid = self.mode == "backup"
        self.seen = set()  # fresh (discarded) weights: an update must cover them all
        if self.cfg.tie_word_embeddings:
            self.model.lm_head.weight = self.model.model.embed_tokens.weight

    def close(self) -> None:
        """Free the parameters and the backup for good."""
        self._empty_parameters()
        self.valid = False
        self.backup, self.backup_current = None, False

    def _empty_parameters(self) -> None:
        unpack_projections(self.model)
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.present = False

    # ------------------------------------------------------------------ updates

    def update(self, buckets, version: int) -> None:
        """Copy HF-named tensors (dicts or (name, tensor) pairs, bucket by bucket) into the
        model; completes ``version``."""
        if not self.present:
            raise RuntimeError(f"{self.name}: wake(['weights']) before update_weights()")
        for bucket in buckets:
            self.copy_in(bucket.items() if isinstance(bucket, dict) else bucket)
        self.finish_version(version)

    def copy_in(self, items) -> None:
        """Copy full HF-named tensors into the parameters (any device/dtype; converted; this
        rank's shard of each). Rank 0 of a tensor-parallel engine first broadcasts them to
        the followers as one flat buffer."""
        if not self.present:
            raise RuntimeError(f"{self.name}: wake(['weights']) before update_weights()")
        self.backup_current = False  # the values change: the next sleep backs them up again
        if self.cfg.tp_size > 1 and self.cfg.tp_rank == 0:
            from engines.weight_sync import flatten

            items = list(items)
            buf, metas = flatten(items, self.device)
            self.mirror("weights_in", metas, buf.numel())
            self.model.tp.broadcast(buf)
        params = dict(self.model.named_parameters())
        copies: list = []
        covered: set = set()
        for name, tensor in items:  # per-expert or fused expert tensors, VL names: engines/models/weight_names.py
            covered.update(place_weight(self.model, params, name, tensor, "update_weights", copies))
        copy_all(copies)  # nothing is copied when a tensor is refused
        self.seen |= covered

    def finish_version(self, version: int) -> None:
        """The update of ``version`` is complete (over one or several calls). After a
        discarding sleep it must have covered every tensor."""
        if self.cfg.tp_size > 1 and self.cfg.tp_rank == 0:
            self.mirror("weights.finish_version", version)
        seen, self.seen = self.seen, set()
        if not self.valid:
            missing = set(self.model.hf_names()) - seen
            if missing:
                raise ValueError("update_weights after a discarding sleep must cover every tensor; "
                                 f"missing {sorted(missing)[:5]}")
            self.valid = True
        self.version = version

    def sync_info(self) -> dict:
        """What a trainer needs to pick the transport: CUDA IPC needs the same physical GPU."""
        from engines.weight_sync import device_uuid

        return {"backend": "torch", "device_type": self.device.type, "uuid": device_uuid(self.device),
                "pid": os.getpid(), "engine_id": self.engine_id, "tp_size": self.cfg.tp_size,
                "weights_bytes": self.full_nbytes()}

    def receive_ipc(self, handle: dict | list, metas: list, version: int, last: bool) -> None:
        """Map the trainer's memory by CUDA IPC, copy each tensor device to device,
        synchronize and unmap before returning (the trainer reuses or frees that memory only
        after that). ``handle`` a dict: one flat bucket, ``metas`` ``(name, shape, dtype,
        offset)``; a list: storages shared in place, ``metas`` views of them
        (``weight_sync.share_in_place``). ``last`` completes ``version``."""
        from engines.weight_sync import open_ipc, open_views, unflatten

        if self.device.type != "cuda" and not (handle and _in_process(handle)):
            raise RuntimeError(f"{self.name}: CUDA IPC weight sync needs a CUDA engine; this one runs on {self.device}")
        if isinstance(handle, list):
            views = open_views(handle, metas, self.device)
        else:
            views = unflatten(open_ipc(handle, self.device), metas)
        try:
            self.copy_in(views)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        finally:
            del views
        if last:
            self.finish_version(version)

    def receive_broadcast(self, group, names: list, dtypes: list, shapes: list, version: int, last: bool) -> None:
        """Receive one bucket that the trainer broadcasts in ``group`` as one flat buffer
        laid out by ``weight_sync.metas_for``, and copy it in. ``last`` completes
        ``version``."""
        from engines.weight_sync import metas_for, unflatten

        metas, total = metas_for(names, dtypes, shapes)
        buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        group.broadcast(buf)
        self.copy_in(unflatten(buf, metas))
        if last:
            self.finish_version(version)


def _in_process(handle: dict | list) -> bool:
    """Shared by this very process (colocated actors): no CUDA mapping involved."""
    handles = handle if isinstance(handle, list) else [handle]
    return all(h.get("pid") == os.getpid() and "handle" not in h for h in handles)
