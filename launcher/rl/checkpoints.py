"""Checkpoints of the RL loop under ``RUN_DIR/checkpoints/step_NNNNNN`` (NNNNNN: the steps
done, from 1): the trainer's checkpoint (engines/trainer/checkpoint_io.py: Megatron
dist_checkpointing files and ``relay-checkpoint.json``), then ``state.json`` (``next_step``: the steps done, which
is the 0-based index of the next; the weight version), written last, so a checkpoint without
it is incomplete and ignored by ``--resume``."""

from __future__ import annotations

import json
import os
import shutil

CHECKPOINT_DIR = "checkpoints"
STATE_FILE = "state.json"


class StoppedWithCheckpoint(Exception):
    """The loop stopped on request (SIGTERM, e.g. slurm preemption) after writing a
    checkpoint; ``--resume`` continues at ``next_step``."""

    def __init__(self, path: str, next_step: int):
        super().__init__(f"stopped on request after writing {path}; --resume continues with step {next_step + 1}")
        self.path = path
        self.next_step = next_step


class Checkpoints:
    """The checkpoint directories of one run directory."""

    def __init__(self, run_dir: str):
        self.root = os.path.join(run_dir, CHECKPOINT_DIR)

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:06d}")

    def complete(self) -> list[str]:
        """Complete checkpoints (those with ``state.json``), oldest first."""
        if not os.path.isdir(self.root):
            return []
        return [os.path.join(self.root, d) for d in sorted(os.listdir(self.root))
                if os.path.exists(os.path.join(self.root, d, STATE_FILE))]

    def latest(self) -> str | None:
        done = self.complete()
        return done[-1] if done else None

    def mark_complete(self, path: str, next_step: int, weight_version: int) -> None:
        """Write ``state.json`` (atomically: a temporary file renamed into place)."""
        tmp = os.path.join(path, STATE_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"next_step": next_step, "weight_version": weight_version}, f)
        os.replace(tmp, os.path.join(path, STATE_FILE))

    async def save(self, trainer, done: int, weight_version: int, colocate: bool, keep: int) -> str:
        """Every trainer rank writes its shard (onloaded for it when ``colocate``), then
        ``state.json``; with ``keep`` > 0 only the newest ``keep`` complete checkpoints stay.
        Returns the checkpoint's path."""
        path = self.path(done)
        if colocate:
            await trainer.onload()
        await trainer.save_checkpoint(path)
        if colocate:
            await trainer.offload()
        self.mark_complete(path, done, weight_version)
        if keep:
            self.prune(keep)
        return path

    async def restore(self, trainer, out) -> dict | None:
        """``--resume``: the newest complete checkpoint into the trainer; returns its state
        ``{"next_step", "weight_version"}``, or None (said on ``out``) when there is none."""
        path = self.latest()
        if path is None:
            print(f"--resume: no complete checkpoint under {self.root}; starting with step 1", file=out, flush=True)
            return None
        with open(os.path.join(path, STATE_FILE)) as f:
            state = json.load(f)
        await trainer.load_checkpoint(path)
        print(f"resumed from {path} (after step {state['next_step']}): continuing with step "
              f"{state['next_step'] + 1}, weight version {state['weight_version']}",
              file=out, flush=True)
        return state

    def prune(self, keep: int) -> None:
        """``--keep-checkpoints``: delete all but the newest ``keep`` complete checkpoints
        (the newest one is complete before any older one goes)."""
        for path in self.complete()[:-keep]:
            os.remove(os.path.join(path, STATE_FILE))  # incomplete first, so a crash mid-delete is never resumed from
            shutil.rmtree(path, ignore_errors=True)


async def write_hf_checkpoint(trainer, source: str, dest: str) -> str:
    """The trainer's current weights as an HF checkpoint in ``dest``: rank 0's gathered
    export (``model.safetensors``) beside ``source``'s config, tokenizer and chat template,
    written to a temporary directory and renamed into place; what the trainer does not hold
    (a VL checkpoint's vision tower, a Qwen3.5 MTP head) is copied from ``source`` unchanged,
    so transformers loads the result as it loaded the source. Returns ``dest``."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from engines.trainer.hybrid_layers import NOT_TRAINED

    buckets = await trainer.export_hf()
    tensors = {k: v.contiguous() for b in buckets for k, v in b.items()}
    for name in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        with safe_open(os.path.join(source, name), "pt") as h:
            for key in h.keys():
                if key.startswith(NOT_TRAINED) and key not in tensors:
                    tensors[key] = h.get_tensor(key)
    tmp = dest + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in os.listdir(source):  # config, tokenizer, chat template: all but the weights
        src = os.path.join(source, name)
        if os.path.isfile(src) and not name.endswith((".safetensors", ".safetensors.index.json", ".bin")):
            shutil.copy(src, tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    if os.path.exists(dest):
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest
