"""``relay export-hf CKPT --out DIR`` (the console script a user types): a checkpoint written under
TP = 2 after a step becomes an HF directory that transformers loads, whose log-probs equal the
trainer's (fp32, CPU) within 1e-4; a missing or incomplete checkpoint and a used --out are refused,
exit 2, naming the problem."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engines.models.model_builder import make_model
from engines.trainer.actor import TrainerActor
from engines.trainer.train_batch import TrainBatch
from relay import setup_torch_distributed, this_host
from tests.helpers import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")

SEQS = [[5 + (i * 7 + j * 3) % 90 for j in range(12 + 3 * i)] for i in range(3)]
MASKS = [[0] * 4 + [1] * (len(s) - 5) for s in SEQS]


def relay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RELAY, *args], capture_output=True, text=True, timeout=300)


def hf_logprobs(path: str, seqs: list) -> list:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            out.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


def test_export_hf_loads_in_transformers_with_the_trainers_logprobs(tmp_path):
    policy = make_model("qwen3", "tiny", str(tmp_path / "policy"), seed=4)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        await setup_torch_distributed(procs)
        t = procs.spawn("trainer", TrainerActor, policy, tp=2, lr=1e-2)
        await t.initialized(240)
        await t.train_step.call(TrainBatch(SEQS, MASKS, [1.0, -1.0, 0.5])).result(120)
        await t.save_checkpoint.call(ckpt).result(120)
        lp = (await t.compute_logprobs.call(SEQS).result(120)).values()[0]
        await t.shutdown.call().result(60)
        await procs.stop()
        return lp

    trainer_lp = run(main(), 300)
    p = relay("export-hf", ckpt, "--out", out)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert f"relay export-hf: wrote {out}" in p.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    exported = hf_logprobs(out, SEQS)
    diff = max(abs(a - b) for ra, rb in zip(exported, trainer_lp) for a, b in zip(ra, rb))
    assert diff < 1e-4, diff
    before = hf_logprobs(policy, SEQS)  # the step moved them: the export is the trained weights
    assert max(abs(a - b) for ra, rb in zip(exported, before) for a, b in zip(ra, rb)) > 1e-3

    used = relay("export-hf", ckpt, "--out", out)
    assert used.returncode == 2 and f"--out {out} exists and is not empty" in used.stderr, used.stderr
    os.makedirs(tmp_path / "half")  # a save cut short: no manifest
    for path, says in ((str(tmp_path / "none"), "no such checkpoint directory"),
                       (str(tmp_path / "half"), "not a complete relay trainer checkpoint")):
        p = relay("export-hf", path, "--out", str(tmp_path / "x"))
        assert p.returncode == 2 and f"relay export-hf: {path}" in p.stderr and says in p.stderr, p.stderr
        assert not os.path.exists(tmp_path / "x")
