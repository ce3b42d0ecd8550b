"""``relay export-hf CKPT --out DIR``: a trainer checkpoint (format 2) as an HF checkpoint, in this
process, whatever layout wrote it: the weights are read through dist_checkpointing into a TP = EP = 1
model, converted to HF names and written as ``model.safetensors`` beside the config, tokenizer and chat
template the checkpoint keeps (``hf/``) and the tensors the trainer does not train (a vision tower)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch

from engines.trainer.checkpoint_io import (
    HF_DIR,
    NOT_TRAINED_FILE,
    CheckpointFormatError,
    check_tp_change,
    model_sharded,
    read_manifest,
)


@contextlib.contextmanager
def _one_rank():
    """torch.distributed (gloo, a file store: no port) and Megatron's groups for a world of one."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with tempfile.TemporaryDirectory(prefix="relay-export-") as d:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel(1, expert_model_parallel_size=1)
            model_parallel_cuda_manual_seed(0)
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def hf_tensors(ckpt: str, manifest: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under HF names (the trainer's dtype)."""
    from megatron.core import dist_checkpointing

    from engines.models.model import ModelConfig
    from engines.trainer import cpu_shim
    from engines.trainer.megatron_model import build_gpt, megatron_to_hf

    cpu_shim.install()
    cfg = ModelConfig.from_dir(os.path.join(ckpt, HF_DIR))
    try:
        check_tp_change(cfg, manifest, 1, ckpt)
    except ValueError as e:
        raise CheckpointFormatError(f"{e} (export reads it at tensor parallel 1)") from None
    with _one_rank():
        model = build_gpt(cfg, 1, getattr(torch, manifest["params_dtype"]), 1)
        loaded = dist_checkpointing.load({"model": model_sharded(model)}, ckpt)
        missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointFormatError(f"{ckpt} does not fit its own config: missing {missing[:3]}, unexpected "
                                        f"{list(unexpected)[:3]}")
        full = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return megatron_to_hf(cfg, full)


def export_hf(ckpt: str, out: str) -> str:
    """Write ``ckpt`` as an HF checkpoint in ``out`` (which must not exist or be empty), through a
    temporary directory renamed into place. Returns ``out``. CheckpointFormatError (what is wrong,
    what to do) for a missing, incomplete or format-1 checkpoint."""
    from safetensors.torch import load_file, save_file

    manifest = read_manifest(ckpt)
    if manifest["format"] == 1:
        raise CheckpointFormatError(
            f"{ckpt} is a format-1 relay checkpoint (trainer-tp*.pt files), which holds no model config: resume it "
            "(--resume) and let the job save once, which writes format 2, then export that")
    if os.path.exists(out) and os.listdir(out):
        raise CheckpointFormatError(f"--out {out} exists and is not empty: choose a new directory")
    tensors = {k: v.contiguous() for k, v in hf_tensors(ckpt, manifest).items()}
    source = os.path.join(ckpt, HF_DIR)
    extra = os.path.join(source, NOT_TRAINED_FILE)
    if os.path.exists(extra):
        tensors.update({k: v for k, v in load_file(extra).items() if k not in tensors})
    tmp = tempfile.mkdtemp(prefix=".export-", dir=os.path.dirname(os.path.abspath(out)))
    try:
        for name in os.listdir(source):
            if name != NOT_TRAINED_FILE:
                shutil.copy(os.path.join(source, name), tmp)
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if os.path.exists(out):
            os.rmdir(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
