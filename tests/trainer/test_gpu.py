"""Trainer on a CUDA GPU (marker ``gpu``: the H200 machine, not CI)."""

from __future__ import annotations

import pytest
import torch

from engines.model_builder import make_model
from engines.trainer.actor import TrainerActor
from relay import setup_torch_distributed, this_host
from tests.helpers import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SEQS = [[5 + (i * 11 + j * 5) % 90 for j in range(256)] for i in range(8)]
MASKS = [[0] * 64 + [1] * 191 for _ in SEQS]


def test_train_offload_frees_memory_and_onload_resumes(tmp_path):
    path = make_model("qwen3", "0.6b", str(tmp_path / "q06"), seed=0, dtype="float32", init_device="cuda")

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        t = procs.spawn("trainer", TrainerActor, path, lr=1e-5)
        await t.initialized(600)
        s1 = await t.train_step.call_one(SEQS, MASKS, [1.0, -1.0] * 4).result(600)
        mem = await t.gpu_memory.call_one()
        moved = await t.offload.call_one().result(600)
        after = await t.gpu_memory.call_one()
        await t.onload.call_one().result(600)
        s2 = await t.train_step.call_one(SEQS, MASKS, [1.0, -1.0] * 4).result(600)
        await t.shutdown.call().result(60)
        await procs.stop()
        return s1, s2, mem, after, moved

    s1, s2, mem, after, moved = run(main(), 880)
    held = mem["allocated"]
    freed = after["free"] - mem["free"]
    assert freed >= 0.95 * held, (freed, held, mem, after)
    assert s2["loss"] == s2["loss"] and s1["grad_norm"] > 0  # finite, trained
