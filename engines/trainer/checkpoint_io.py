"""The trainer's checkpoints: one file per (TP, EP) rank of a ``TrainerActor``, with its
weights, optimizer state, step and RNG states; written to a temporary name and renamed, so a
crash never leaves a half-written checkpoint."""

from __future__ import annotations

import os
import random

import torch


def shard_file(trainer) -> str:
    """``trainer-tp{t}.pt``, or ``trainer-tp{t}-ep{e}.pt`` with expert parallelism."""
    t = trainer.tp_rank
    return f"trainer-tp{t}.pt" if trainer.ep == 1 else f"trainer-tp{t}-ep{trainer.ep_rank}.pt"


def save(trainer, path: str) -> None:
    """Data-parallel replicas hold the same weights: only DP rank 0 of each TP rank writes
    (the distributed optimizer's shards are gathered there first: every rank must call).
    With expert parallelism, expert-DP rank 0 of each (TP, EP) rank writes its file (its
    experts and their optimizer state; EP rank 0's file also the dense weights' state)."""
    from megatron.core import parallel_state as ps

    if trainer.offloaded:
        raise RuntimeError("the trainer is offloaded; onload() before saving a checkpoint")
    opt_state = trainer.opt.state_dict()
    if (ps.get_expert_data_parallel_rank() if trainer.ep > 1 else ps.get_data_parallel_rank()) != 0:
        return
    os.makedirs(path, exist_ok=True)
    state = {
        "model": {k: v for k, v in trainer.model.state_dict().items() if not k.endswith("_extra_state")},
        "opt": opt_state,
        "optimizer": trainer.opt.kind,
        "step": trainer.step,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }
    final = os.path.join(path, shard_file(trainer))
    tmp = final + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, final)


def load(trainer, path: str) -> int:
    """Load ``trainer``'s rank file from ``path`` (a collective over DP with the distributed
    optimizer); returns the checkpoint's step."""
    if trainer.offloaded:
        raise RuntimeError("the trainer is offloaded; onload() before loading a checkpoint")
    state = torch.load(os.path.join(path, shard_file(trainer)), weights_only=False)
    if state.get("optimizer", "torch") != trainer.opt.kind:
        raise ValueError(
            f"checkpoint holds {state.get('optimizer', 'torch')!r} optimizer state; this trainer runs "
            f"{trainer.opt.kind!r} (set optimizer= to match)"
        )
    trainer.model.load_state_dict(state["model"], strict=False)
    trainer.opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state["step"]
