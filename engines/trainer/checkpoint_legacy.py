"""Format 1 of the trainer's checkpoints (relay before dist_checkpointing): one ``torch.save`` file
per (TP, EP) rank, ``trainer-tp{t}.pt`` or ``trainer-tp{t}-ep{e}.pt``, holding that rank's weights,
its optimizer's state dict, the step and RNG states. Read only, with ``weights_only=True``, and only
in the layout that wrote it (the files are per-rank shards); saving again writes format 2."""

from __future__ import annotations

import os
import pickle
import random
import re

import torch

_FILE = re.compile(r"trainer-tp(\d+)(?:-ep(\d+))?\.pt$")


def _layout(path: str) -> tuple[int, int]:
    """(TP, EP) sizes of the format-1 files in ``path``."""
    found = [m for m in (_FILE.match(n) for n in os.listdir(path)) if m]
    return (1 + max(int(m[1]) for m in found), 1 + max(int(m[2] or 0) for m in found))


def load(trainer, path: str) -> int:
    """``trainer``'s rank file from ``path`` (a collective over DP with the distributed optimizer);
    returns the step. Refuses another layout, naming the format and what to do."""
    tp, ep = _layout(path)
    if (tp, ep) != (trainer.tp, trainer.ep):
        raise ValueError(
            f"{path} is a format-1 relay checkpoint (trainer-tp*.pt files, one per rank) written with tensor "
            f"parallel {tp} and expert parallel {ep}; format 1 loads only in that layout (this trainer runs "
            f"{trainer.tp} and {trainer.ep}): resume it with those sizes once and save, which writes format 2, "
            "and format 2 loads under any layout")
    name = f"trainer-tp{trainer.tp_rank}.pt" if ep == 1 else f"trainer-tp{trainer.tp_rank}-ep{trainer.ep_rank}.pt"
    try:
        state = torch.load(os.path.join(path, name), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path}/{name} (a format-1 relay checkpoint) holds objects that do not load with "
                         f"weights_only=True ({e}); it is not loaded") from None
    if state.get("optimizer", "torch") != trainer.opt.kind:
        raise ValueError(
            f"{path} (format 1) holds {state.get('optimizer', 'torch')!r} optimizer state; this trainer runs "
            f"{trainer.opt.kind!r} (set optimizer= to match: format 1 does not convert between them)")
    trainer.model.load_state_dict({k: v.to(trainer.device) for k, v in state["model"].items()}, strict=False)
    trainer.opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state["step"]
