"""The trainer's checkpoints (format 2): Megatron's ``dist_checkpointing`` (torch.distributed.checkpoint
files, ``torch_dist``) holding the weights, the Adam moments (and fp32 master weights under the
distributed optimizer) keyed by the model's *global* tensors, so a checkpoint resumes under another
tensor / data / expert parallel layout and with either optimizer kind; each rank's RNG states; and,
written last by rank 0, ``relay-checkpoint.json`` (the format, steps, optimizer, layout) beside a copy of
the model's config and tokenizer (``hf/``), so ``relay export-hf`` needs nothing else.

Nothing is unpickled but torch.distributed.checkpoint's own ``.metadata``: the weights and moments are
ShardedTensors, Megatron's ``common.pt`` holds no object (it loads with ``weights_only=True``), and the
steps live in the JSON. Format 1 (``trainer-tp{t}.pt`` per rank, relay before dist_checkpointing) still
loads in the layout that wrote it, read with ``weights_only=True`` (engines/trainer/checkpoint_legacy.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil

import torch

from engines.trainer import cpu_shim
from engines.trainer.optim import adam_step_counter

FORMAT = 2
MANIFEST = "relay-checkpoint.json"
HF_DIR = "hf"  # the model's config.json, tokenizer and chat template; not_trained.safetensors
NOT_TRAINED_FILE = "not_trained.safetensors"  # tensors the trainer does not hold (a VL vision tower)
OPT_PREFIX = "optimizer.state"
MOMENTS = ("exp_avg", "exp_avg_sq")


class CheckpointFormatError(ValueError):
    """A directory that is not a checkpoint this relay reads (says what it found and what to do)."""


def read_manifest(path: str) -> dict:
    """``path``'s manifest, or CheckpointFormatError naming what the directory holds instead."""
    file = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointFormatError(f"{path}: no such checkpoint directory")
    if not os.path.exists(file):
        if any(n.startswith("trainer-tp") and n.endswith(".pt") for n in os.listdir(path)):
            return {"format": 1}
        raise CheckpointFormatError(
            f"{path} is not a complete relay trainer checkpoint: it has no {MANIFEST} (written last: the save did "
            "not finish) and no format-1 trainer-tp*.pt files; use another checkpoint (--resume takes the newest "
            "complete one)")
    with open(file) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise CheckpointFormatError(
            f"{path} holds a relay checkpoint of format {manifest.get('format')!r}; this relay reads formats 1 and "
            f"{FORMAT}: use the relay version that wrote it (or a newer one)")
    return manifest


def check_tp_change(cfg, manifest: dict, tp: int, path: str) -> None:
    """A hybrid model's token mixers (engines/trainer/hybrid_layers.py) shard by heads in their own
    order, which their sharded state does not describe: they reload only at the TP size that saved."""
    saved = manifest["layout"]["tp"]
    if cfg.hybrid and saved != tp:
        raise ValueError(f"{path} holds a hybrid (Qwen3.5) model saved at tensor parallel {saved}; its linear-"
                         f"attention and gated-attention shards load only at that size, not {tp}: resume with "
                         f"--tensor-model-parallel-size {saved}")


# ---------------------------------------------------------------- sharded state dicts


def model_sharded(model) -> dict:
    """The model's sharded state dict without its ``_extra_state`` objects (the local spec keeps
    none; they would be pickled)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sd = model.sharded_state_dict()
    objects = [k for k, v in sd.items() if isinstance(v, ShardedObject) and not k.endswith("_extra_state")]
    if objects:
        raise TypeError(f"the model's sharded state holds objects that would be pickled: {objects[:3]}")
    return {k: v for k, v in sd.items() if not isinstance(v, ShardedObject)}


def _by_param(model_sd: dict) -> dict:
    """id(param) -> its ShardedTensor (or factory) in ``model_sd``."""
    return {id(sh.data): sh for sh in model_sd.values()}


def _torch_optimizer(trainer, model_sd: dict, loading: bool) -> dict:
    """TorchAdamW's moments as ShardedTensors of the parameters' global shapes. Saving, a
    parameter that never had a gradient (no state yet) is written with zero moments."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    by_param, opt = _by_param(model_sd), trainer.opt.opt
    out = {}
    for i, p in enumerate(trainer.model.parameters()):
        state = opt.state.get(p, {})
        out[i] = {k: make_sharded_optimizer_tensor(by_param[id(p)], torch.zeros_like(p) if loading or k not in state
                                                   else state[k].detach(), f"{OPT_PREFIX}.{k}") for k in MOMENTS}
    return out


def _megatron_optimizer(trainer, model_sd: dict, loading: bool) -> dict:
    """The distributed optimizer's fp32 master weights and moments, gathered over DP into the
    parameters' global shapes (Megatron's ``fully_reshardable`` format): collective over DP."""
    with cpu_shim.megatron_cuda_calls():
        return {i: part.sharded_param_state_fully_reshardable(model_sd, is_loading=loading, metadata={})
                for i, part in enumerate(trainer.opt._parts)}


def _rng_sharded(rank: int, world: int, loading: bool) -> dict:
    """This rank's RNG states (torch, Python's ``random``; CUDA's on CUDA) as rows ``rank`` of
    ``(world, n)`` tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    states = {"torch": torch.get_rng_state(), "python": torch.tensor(random.getstate()[1], dtype=torch.int64)}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return {k: ShardedTensor.from_rank_offsets(f"rng.{k}", v.clone(), (0, rank, world), replica_id=0,
                                               prepend_axis_num=1) for k, v in states.items()}


def _set_rng(loaded: dict) -> None:
    torch.set_rng_state(loaded["torch"].reshape(-1))
    random.setstate((3, tuple(int(x) for x in loaded["python"].reshape(-1)), None))
    if "cuda" in loaded and torch.cuda.is_available():
        torch.cuda.set_rng_state(loaded["cuda"].reshape(-1))


def _adam_step(trainer) -> int:
    """The optimizer's own step count (torch AdamW keeps it per parameter; every one the same)."""
    opts = [p.optimizer for p in trainer.opt._parts] if trainer.opt.kind == "megatron" else [trainer.opt.opt]
    for opt in opts:
        for state in opt.state.values():
            if "step" in state:
                return int(float(state["step"]))
    return 0


# ---------------------------------------------------------------- save


def _in_process_strategy():
    """Megatron's ``torch_dist`` format (what its default load strategy reads), written by
    torch.distributed.checkpoint's ``FileSystemWriter`` in this process. Megatron's own writer forks
    one process per file bucket (from a trainer process with live sockets and threads) and needs
    psutil; this one writes the same files from this process."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed import checkpoint as dcp

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp.save(mcore_to_pyt_state_dict(flat, False), storage_writer=dcp.FileSystemWriter(str(checkpoint_dir)),
                     planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    return InProcessTorchDistSave("torch_dist", 1)



def save(trainer, path: str) -> None:
    """Every trainer rank calls (collective). Replaces what ``path`` held: its manifest goes
    first, so a save cut short never leaves a directory that reads as complete."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    if trainer.offloaded:
        raise RuntimeError("the trainer is offloaded; onload() before saving a checkpoint")
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        if os.path.exists(os.path.join(path, MANIFEST)):
            os.remove(os.path.join(path, MANIFEST))
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier()
    model_sd = model_sharded(trainer.model)
    build = _megatron_optimizer if trainer.opt.kind == "megatron" else _torch_optimizer
    state = {"model": model_sd, "optimizer": build(trainer, model_sd, False), "rng": _rng_sharded(rank, world, False)}
    dist_checkpointing.save(state, path, sharded_strategy=_in_process_strategy())
    if rank == 0:
        _write_model_files(trainer.model_path, os.path.join(path, HF_DIR))
        _write_manifest(trainer, path, world)
    dist.barrier()


def _write_model_files(source: str, dest: str) -> None:
    """The source checkpoint's config, tokenizer and chat template, and the tensors the trainer
    does not hold (a VL checkpoint's vision tower, an MTP head) in ``not_trained.safetensors``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from engines.trainer.hybrid_layers import NOT_TRAINED

    os.makedirs(dest)
    kept = {}
    for name in sorted(os.listdir(source)):
        src = os.path.join(source, name)
        if not os.path.isfile(src):
            continue
        if name.endswith(".safetensors"):
            with safe_open(src, "pt") as h:
                kept.update({k: h.get_tensor(k) for k in h.keys() if k.startswith(NOT_TRAINED)})
        elif not name.endswith((".safetensors.index.json", ".bin", ".pt", ".pth")):
            shutil.copy(src, dest)
    if kept:
        save_file(kept, os.path.join(dest, NOT_TRAINED_FILE), metadata={"format": "pt"})


def _write_manifest(trainer, path: str, world: int) -> None:
    manifest = {
        "format": FORMAT,
        "step": trainer.step,
        "adam_step": _adam_step(trainer),
        "optimizer": trainer.opt.kind,
        "layout": {"world": world, "tp": trainer.tp, "dp": trainer.dp_size, "ep": trainer.ep},
        "params_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
        "source_model": os.path.abspath(trainer.model_path),
    }
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(path, MANIFEST))


# ---------------------------------------------------------------- load


def load(trainer, path: str) -> int:
    """Every trainer rank calls (collective). Loads a format-2 checkpoint under any layout, a
    format-1 one under its own; returns the checkpoint's step. RNG states come back where the
    number of ranks is the one that saved (a changed layout keeps this run's)."""
    if trainer.offloaded:
        raise RuntimeError("the trainer is offloaded; onload() before loading a checkpoint")
    manifest = read_manifest(path)
    if manifest["format"] == 1:
        from engines.trainer import checkpoint_legacy

        return checkpoint_legacy.load(trainer, path)
    return _load_v2(trainer, path, manifest)


def _load_v2(trainer, path: str, manifest: dict) -> int:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    check_tp_change(trainer.cfg, manifest, trainer.tp, path)
    saved = dist_checkpointing.load_tensors_metadata(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    model_sd = model_sharded(trainer.model)
    request = {"model": model_sd}
    with_moments = manifest["adam_step"] > 0
    if with_moments and trainer.opt.kind == "megatron":
        request["optimizer"] = _master_from_weights(_megatron_optimizer(trainer, model_sd, True), saved)
    elif with_moments:
        request["optimizer"] = _torch_optimizer(trainer, model_sd, True)
    rng = _rng_sharded(rank, world, True)
    if all(k in saved and saved[k].global_shape[0] == world for k in (s.key for s in rng.values())):
        request["rng"] = rng
    loaded = dist_checkpointing.load(request, path)
    missing, unexpected = trainer.model.load_state_dict(loaded["model"], strict=False)
    missing = [m for m in missing if not m.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"{path} does not fit the model: missing {missing[:3]}, unexpected {list(unexpected)[:3]}")
    if with_moments:
        put = _put_megatron if trainer.opt.kind == "megatron" else _put_torch
        put(trainer, loaded["optimizer"], manifest["adam_step"])
    if "rng" in loaded:
        _set_rng(loaded["rng"])
    return manifest["step"]


def _master_from_weights(request: dict, saved: dict) -> dict:
    """A checkpoint of the torch optimizer holds no fp32 master weights (its params are fp32): the
    distributed optimizer's are then not asked for; :func:`_put_megatron` takes the weights."""
    master = f"{OPT_PREFIX}.param."  # the distributed optimizer's fp32 master weights
    if any(k.startswith(master) for k in saved):
        return request
    for part in request.values():
        for tensors in part.values():
            tensors.pop("param", None)
    return request


@torch.no_grad()
def _put_torch(trainer, loaded: dict, adam_step: int) -> None:
    opt = trainer.opt.opt
    steps = adam_step_counter(opt, adam_step)
    for i, p in enumerate(trainer.model.parameters()):
        opt.state[p] = {"step": steps[p], **{k: loaded[i][k].to(p.device, p.dtype).clone() for k in MOMENTS}}


@torch.no_grad()
def _put_megatron(trainer, loaded: dict, adam_step: int) -> None:
    """Master weights (the weights where the checkpoint has none) and moments into each rank's DP
    shard. Megatron's loader copies every state
    tensor it finds, ``step`` included, which the checkpoint does not hold (fused Adam keeps it per
    group): it is set aside and given back as one tensor per parameter, as torch's AdamW keeps it."""
    with cpu_shim.megatron_cuda_calls():
        for i, part in enumerate(trainer.opt._parts):
            for group in part.optimizer.param_groups:
                for p in group["params"]:
                    state = part.optimizer.state[p]
                    state.pop("step", None)
                    for k in MOMENTS:
                        state.setdefault(k, torch.zeros_like(p))
            # the order of Megatron's fully_reshardable state: each buffer's params in order
            params = [p for buffer in part.buffers for p in buffer.param_index_map]
            for j, p in enumerate(params):
                loaded[i][j].setdefault("param", p.detach())  # no master weights saved: the weights
            part.load_parameter_state_from_fully_reshardable(loaded[i])
            for p, step in adam_step_counter(part.optimizer, adam_step).items():
                part.optimizer.state[p]["step"] = step
