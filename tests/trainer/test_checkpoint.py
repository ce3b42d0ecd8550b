"""Trainer checkpoints (format 2, Megatron's dist_checkpointing) on CPU/gloo: a checkpoint resumes
under another tensor / data / expert parallel layout and the other optimizer kind with the weights
and Adam moments equal (the full tensors, gathered), and the next step continues as without the
reload; nothing in it is unpickled but torch.distributed.checkpoint's metadata; an incomplete or
newer checkpoint is refused naming what it found; format 1 (per-rank torch.save files) loads in its
own layout and is refused, naming its version, in another."""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest
import torch

from engines.models.model_builder import make_model
from engines.trainer.train_batch import TrainBatch
from relay import ActorError
from tests.helpers import run, start_trainer, stop_trainer
from tests.trainer.actors import StateProbe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

SEQS = [[5 + (i * 11 + j * 5) % 90 for j in range(14 + 2 * i)] for i in range(4)]  # uneven lengths
MASKS = [[0] * 5 + [1] * (len(s) - 6) for s in SEQS]
ADV = [1.0, -1.0, 0.5, -0.7]
WHOLE = TrainBatch(SEQS, MASKS, ADV, temperature=0.8)
#: the same step as WHOLE over two DP ranks (each weighted by its share of the step)
HALVES = [TrainBatch(SEQS[:2], MASKS[:2], ADV[:2], temperature=0.8, denominator=4),
          TrainBatch(SEQS[2:], MASKS[2:], ADV[2:], temperature=0.8, denominator=4)]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return make_model("qwen3", "tiny", str(tmp_path_factory.mktemp("p") / "policy"), seed=6)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_model("qwen3_moe", "tiny", str(tmp_path_factory.mktemp("moe") / "m"), seed=3)


async def start(path, gpus: int = 1, **kw):
    return await start_trainer(StateProbe, path, gpus, lr=1e-2, **kw)


stop = stop_trainer


async def step(t, dp: int) -> None:
    """One optimizer step of the same global batch on ``dp`` data-parallel ranks."""
    if dp == 1:
        await t.train_step.call(WHOLE).result(120)
        return
    await asyncio.gather(*[t.slice(gpus=r).train_step.call_one(HALVES[r]).result(120) for r in range(dp)])


async def save_then_continue(path, ckpt, gpus, dp, **kw):
    """Two steps, a checkpoint, the full state, one more step and the log-probs after it."""
    procs, t = await start(path, gpus, **kw)
    for _ in range(2):
        await step(t, dp)
    await t.save_checkpoint.call(ckpt).result(120)
    states = (await t.full_state.call().result(120)).values()
    await step(t, dp)
    lp = (await t.compute_logprobs.call(SEQS).result(120)).values()[0]
    kind = (await t.optimizer_info.call().result(60)).values()[0]["kind"]
    await stop(procs, t)
    return states[0], lp, kind


async def resume_then_continue(path, ckpt, gpus, dp, **kw):
    procs, t = await start(path, gpus, **kw)
    steps = (await t.load_checkpoint.call(ckpt).result(120)).values()
    states = (await t.full_state.call().result(120)).values()
    await step(t, dp)
    lp = (await t.compute_logprobs.call(SEQS).result(120)).values()[0]
    kind = (await t.optimizer_info.call().result(60)).values()[0]["kind"]
    await stop(procs, t)
    return steps, states, lp, kind


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def assert_same_state(saved: dict, resumed: list, tolerance: float = 1e-6) -> None:
    for state in resumed:  # every rank gathers the same full state
        assert state["step"] == saved["step"] == 2
        for k in ("weights", "exp_avg", "exp_avg_sq"):
            assert max_diff(saved[k], state[k]) <= tolerance, k
        assert any(float(v.abs().max()) > 0 for v in state["exp_avg"].values())  # moments really came back


def lp_close(a: list, b: list, tolerance: float) -> float:
    diff = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert diff < tolerance, diff
    return diff


@pytest.mark.parametrize("saved_at, resumed_at", [
    ((2, 2, "auto"), (2, 1, "auto")),  # TP 2 (torch AdamW) -> DP 2 (distributed optimizer)
    ((2, 1, "megatron"), (2, 2, "megatron")),  # the distributed optimizer, DP 2 -> TP 2 DP 1
])
def test_resume_under_another_tensor_and_data_parallel_layout(policy, tmp_path, saved_at, resumed_at):
    """(gpus, tp, optimizer) at save and at resume: weights and Adam moments equal within 1e-6,
    and the next step moves the log-probs as continuing without the reload did (up to the
    float rounding of another TP / DP reduction order)."""
    ckpt = str(tmp_path / "ckpt")
    (g1, tp1, o1), (g2, tp2, o2) = saved_at, resumed_at

    async def main():
        saved = await save_then_continue(policy, ckpt, g1, g1 // tp1, tp=tp1, optimizer=o1)
        resumed = await resume_then_continue(policy, ckpt, g2, g2 // tp2, tp=tp2, optimizer=o2)
        return saved, resumed

    (saved, lp_a, kind_a), (steps, states, lp_b, kind_b) = run(main(), 390)
    if saved_at[2] == "auto":
        assert (kind_a, kind_b) == ("torch", "megatron")
    assert list(steps) == [2] * g2
    assert_same_state(saved, states)
    lp_close(lp_a, lp_b, 1e-4)


def test_bf16_distributed_optimizer_resumes_its_fp32_master_weights_under_another_dp(policy, tmp_path):
    """--bf16 (bf16 params, fp32 master weights and moments in the distributed optimizer): saved at
    DP 1, resumed at DP 2 with the bf16 weights, the fp32 master weights and the moments equal."""
    ckpt = str(tmp_path / "ckpt")

    async def main():
        saved = await save_then_continue(policy, ckpt, 1, 1, bf16=True)
        resumed = await resume_then_continue(policy, ckpt, 2, 2, bf16=True)
        return saved, resumed

    (saved, _, kind_a), (steps, states, _, kind_b) = run(main(), 390)
    assert kind_a == kind_b == "megatron" and list(steps) == [2, 2]
    assert_same_state(saved, states)
    for state in states:
        assert max_diff(saved["param"], state["param"]) == 0.0
        assert max_diff(saved["param"], {n: w.float() for n, w in state["weights"].items()}) > 0  # fp32, not bf16


def test_moe_resumes_under_another_expert_parallel_layout(moe, tmp_path):
    """A mixture-of-experts model saved under EP = 2 (DP 2, distributed optimizer) resumes under
    EP = 1 (DP 2) with every expert's weights and moments equal, and the next step as without
    the reload."""
    ckpt = str(tmp_path / "ckpt")

    async def main():
        saved = await save_then_continue(moe, ckpt, 2, 2, ep=2, micro_batch_tokens=64)
        resumed = await resume_then_continue(moe, ckpt, 2, 2, ep=1, micro_batch_tokens=64)
        return saved, resumed

    (saved, lp_a, kind_a), (steps, states, lp_b, kind_b) = run(main(), 390)
    assert kind_a == kind_b == "megatron" and list(steps) == [2, 2]
    assert any(".local_experts.3." in n for n in saved["exp_avg"])  # experts by global index
    assert_same_state(saved, states)
    lp_close(lp_a, lp_b, 1e-4)


def test_checkpoint_files_unpickle_nothing_but_dcp_metadata_and_refusals_name_the_problem(policy, tmp_path):
    """The checkpoint's files: torch.distributed.checkpoint's shards and ``.metadata`` (its own
    pickle), Megatron's ``common.pt`` loading with weights_only=True, the manifest, the model's
    config and tokenizer. A directory whose save did not finish, and one of a newer format, are
    refused with what was found."""
    ckpt = str(tmp_path / "ckpt")

    async def main():
        procs, t = await start(policy)
        await t.train_step.call(WHOLE).result(120)
        await t.save_checkpoint.call(ckpt).result(120)
        errors = []
        for broken in ("incomplete", "newer"):
            path = str(tmp_path / broken)
            os.makedirs(path)
            if broken == "newer":
                with open(os.path.join(path, "relay-checkpoint.json"), "w") as f:
                    json.dump({"format": 3}, f)
            with pytest.raises(ActorError) as e:
                await t.load_checkpoint.call(path).result(120)
            errors.append(str(e.value))
        await stop(procs, t)
        return errors

    incomplete, newer = run(main(), 300)
    assert "not a complete relay trainer checkpoint" in incomplete
    assert "format 3" in newer and "formats 1 and 2" in newer
    names = sorted(os.listdir(ckpt))
    manifest = json.load(open(os.path.join(ckpt, "relay-checkpoint.json")))
    assert manifest["format"] == 2 and manifest["step"] == 1 and manifest["optimizer"] == "torch"
    assert os.path.exists(os.path.join(ckpt, "hf", "config.json")) and os.path.exists(
        os.path.join(ckpt, "hf", "tokenizer.json"))
    pickled = [n for n in names if n.endswith((".pt", ".pkl", ".pickle")) and n != "common.pt"]
    assert not pickled, names
    torch.load(os.path.join(ckpt, "common.pt"), weights_only=True)
    assert any(n.endswith(".distcp") for n in names) and ".metadata" in names


class _NeedsUnpickling:
    """An object that only full unpickling rebuilds (what a hostile file would carry)."""

    def __reduce__(self):
        return (random.Random, (0,))


def test_format1_loads_in_its_layout_and_is_refused_in_another(policy, tmp_path):
    """Format 1 (relay's per-rank ``torch.save`` files, written here by the code that wrote them)
    loads with weights_only=True in the layout that wrote it and resumes to the same next step;
    under another layout it is refused naming format 1 and what to do; a file that needs full
    unpickling is refused, not loaded."""
    v1 = str(tmp_path / "v1")
    hostile = str(tmp_path / "hostile")

    async def main():
        procs, t = await start(policy, optimizer="torch")
        await t.train_step.call(WHOLE).result(120)
        await t.write_format1.call(v1).result(120)
        after = (await t.train_step.call(WHOLE).result(120)).values()[0]
        await stop(procs, t)
        os.makedirs(hostile)
        state = torch.load(os.path.join(v1, "trainer-tp0.pt"), weights_only=True)
        torch.save({**state, "extra": _NeedsUnpickling()}, os.path.join(hostile, "trainer-tp0.pt"))
        procs, t = await start(policy, optimizer="torch")
        step = (await t.load_checkpoint.call(v1).result(120)).values()[0]
        resumed = (await t.train_step.call(WHOLE).result(120)).values()[0]
        with pytest.raises(ActorError) as bad:
            await t.load_checkpoint.call(hostile).result(120)
        await stop(procs, t)
        procs, t = await start(policy, gpus=2, tp=2, optimizer="torch")
        with pytest.raises(ActorError) as other_layout:
            await t.load_checkpoint.call(v1).result(120)
        await stop(procs, t)
        return step, after, resumed, str(bad.value), str(other_layout.value)

    step, after, resumed, bad, other_layout = run(main(), 390)
    assert step == 1 and resumed["loss"] == after["loss"] and resumed["grad_norm"] == after["grad_norm"]
    assert "format-1" in bad and "weights_only=True" in bad
    assert "format-1" in other_layout and "tensor parallel 1" in other_layout and "format 2" in other_layout
