"""Trainer on a CUDA GPU (marker ``gpu``: the H200 machine, not CI)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.models.model_builder import make_model
from engines.trainer.actor import TrainerActor
from engines.trainer.train_batch import TrainBatch
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
        s1 = await t.train_step.call_one(TrainBatch(SEQS, MASKS, [1.0, -1.0] * 4)).result(600)
        mem = await t.gpu_memory.call_one()
        moved = await t.offload.call_one().result(600)
        after = await t.gpu_memory.call_one()
        await t.onload.call_one().result(600)
        s2 = await t.train_step.call_one(TrainBatch(SEQS, MASKS, [1.0, -1.0] * 4)).result(600)
        await t.shutdown.call().result(60)
        await procs.stop()
        return s1, s2, mem, after, moved

    s1, s2, mem, after, moved = run(main(), 880)
    held = mem["allocated"]
    freed = after["free"] - mem["free"]
    assert freed >= 0.95 * held, (freed, held, mem, after)
    assert s2["loss"] == s2["loss"] and s1["grad_norm"] > 0  # finite, trained


def test_bf16_training_with_fp32_master_weights_and_offload(tmp_path):
    """Qwen3-0.6B-shaped model, bf16 params, Megatron's optimizer with fp32 master weights:
    SFT lowers the loss, params stay bf16, offload frees >= 95% of what the trainer held
    and training resumes after onload."""
    path = make_model("qwen3", "0.6b", str(tmp_path / "q06"), seed=0, dtype="bfloat16", init_device="cuda")

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        t = procs.spawn("trainer", TrainerActor, path, lr=1e-4, bf16=True)
        await t.initialized(600)
        info = await t.optimizer_info.call_one().result(60)
        losses = [(await t.sft_step.call_one(SEQS, MASKS).result(600))["loss"] for _ in range(4)]
        mem = await t.gpu_memory.call_one()
        await t.offload.call_one().result(600)
        after = await t.gpu_memory.call_one()
        await t.onload.call_one().result(600)
        losses.append((await t.sft_step.call_one(SEQS, MASKS).result(600))["loss"])
        info_after = await t.optimizer_info.call_one().result(60)
        await t.shutdown.call().result(60)
        await procs.stop()
        return info, info_after, losses, mem, after

    info, info_after, losses, mem, after = run(main(), 880)
    assert info == info_after and info["params_dtype"] == "bfloat16" and info["master_dtype"] == "float32", info
    assert all(x == x and abs(x) < float("inf") for x in losses), losses
    assert losses[3] < losses[0] and losses[4] < losses[0], losses
    assert after["free"] - mem["free"] >= 0.95 * mem["allocated"], (mem, after)


@pytest.mark.parametrize("bf16", [False, True], ids=["torch", "megatron"])
def test_an_offload_cycle_between_steps_changes_nothing(tmp_path, bf16):
    """Onload returns once the params are back; the optimizer state follows on a side stream
    behind the next passes (engines/trainer/optim.py). Steps right after an onload (the
    second one with no passes to hide behind: an SFT step of one short row) give the log-probs
    of a trainer that never offloaded, as closely as two such trainers agree with each other,
    on both optimizer paths."""
    dtype = "bfloat16" if bf16 else "float32"
    path = make_model("qwen3", "0.6b", str(tmp_path / "q06"), seed=0, dtype=dtype, init_device="cuda")

    async def trained(cycle: bool):
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        try:
            await setup_torch_distributed(procs)
            t = procs.spawn("trainer", TrainerActor, path, lr=1e-3, bf16=bf16)
            await t.initialized(600)
            for i in range(3):
                if cycle and i:
                    await t.offload.call_one().result(600)
                    await t.onload.call_one().result(600)
                if i < 2:
                    await t.train_step.call_one(TrainBatch(SEQS, MASKS, [1.0, -1.0] * 4)).result(600)
                else:
                    await t.sft_step.call_one([SEQS[0][:8]], [[0, 0, 1, 1, 1, 1, 1]]).result(600)
            lp = await t.compute_logprobs.call_one(SEQS[:2]).result(600)
            await t.shutdown.call().result(60)
            return lp
        finally:
            await procs.stop()

    plain, cycled, again = run(trained(False), 880), run(trained(True), 880), run(trained(False), 880)

    def apart(a, b):
        return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))

    cycle_gap, noise = apart(cycled, plain), apart(again, plain)
    # The Megatron path trains deterministically here (an H100: both gaps 0.0): bit for bit.
    # The torch path does not (fp32, two trainers that never offload: up to ~8e-5 apart), so
    # within ten times that; a step that read its Adam state before it arrived (lr 1e-3)
    # would be far outside it.
    assert cycle_gap <= 10 * noise, (cycle_gap, noise)


def test_cuda_ipc_export_into_engines_on_the_same_gpu(tmp_path):
    """push_weights picks CUDA IPC for built-in engines on the trainer's GPU: one in another
    process (a real IPC mapping) and one in the trainer's own worker process (colocated
    actors share it). Both then generate exactly what an engine given the same weights
    over the relay path generates, and differ from before the sync."""
    from engines.actor import EngineActor

    path = make_model("qwen3", "0.6b", str(tmp_path / "q06"), seed=0, dtype="bfloat16", init_device="cuda")
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    ekw = dict(device="cuda", kv_cache_tokens=4096, weights_mode="discard")

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        t = procs.spawn("trainer", TrainerActor, path, lr=1e-3, bf16=True)
        await t.initialized(600)
        local = procs.spawn("local", EngineActor, path, "torch", **ekw)  # in the trainer's process
        eprocs = this_host().spawn_procs(per_host={"gpus": 2})
        others = eprocs.spawn("others", EngineActor, path, "torch", **ekw)
        await asyncio.gather(local.initialized(600), others.initialized(600))
        remote, relay_ref = others.slice(gpus=0), others.slice(gpus=1)
        before = (await remote.generate.call_one(SEQS[0][:32], greedy).result(300))
        await t.train_step.call_one(TrainBatch(SEQS, MASKS, [1.0, -1.0] * 4)).result(600)
        await t.offload.call_one().result(600)
        for e in (local, others):
            await e.sleep.call(["weights", "kv_cache"]).result(300)
            await e.wake.call(["weights"]).result(300)
        ipc_bytes = await t.push_weights.call_one([remote, local], 1, 64 << 20, 600.0, "auto").result(600)
        await t.push_weights.call_one([relay_ref], 1, 64 << 20, 600.0, "relay").result(600)
        for e in (local, others):
            await e.wake.call(["kv_cache"]).result(300)
        outs = [await e.generate.call_one(SEQS[0][:32], greedy).result(300) for e in (remote, local, relay_ref)]
        # again with the trainer resident (the loop's order when the GPU has room): the
        # parameter buffer itself is shared, no copy of it brought back from the host
        await t.onload.call_one().result(600)
        await t.train_step.call_one(TrainBatch(SEQS, MASKS, [-1.0, 1.0] * 4)).result(600)
        await t.push_weights.call_one([remote, local], 2, 64 << 20, 600.0, "auto").result(600)
        await t.push_weights.call_one([relay_ref], 2, 64 << 20, 600.0, "relay").result(600)
        outs += [await e.generate.call_one(SEQS[0][:32], greedy).result(300) for e in (remote, local, relay_ref)]
        mem = await t.gpu_memory.call_one()
        await t.shutdown.call().result(60)
        await procs.stop()
        await eprocs.stop()
        return before, outs, ipc_bytes, mem

    before, (remote, local, ref, remote2, local2, ref2), ipc_bytes, mem = run(main(), 880)
    assert ipc_bytes > 2 * 1.0e9  # 0.6B bf16 params (~1.2 GB with tied embeddings), to two engines
    assert remote.token_ids == local.token_ids == ref.token_ids
    assert remote.logprobs == local.logprobs == ref.logprobs
    assert remote.weight_version == local.weight_version == ref.weight_version == 1
    assert remote.logprobs != before.logprobs  # the weights really changed
    assert remote2.token_ids == local2.token_ids == ref2.token_ids
    assert remote2.logprobs == local2.logprobs == ref2.logprobs != ref.logprobs
    assert remote2.weight_version == local2.weight_version == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_broadcast_export_into_an_engine_on_another_gpu(tmp_path):
    """push_weights picks the broadcast group (NCCL) for a built-in engine on another GPU than
    the trainer's; the engine then generates exactly what an engine given the same weights
    over relay generates."""
    from engines.actor import EngineActor

    path = make_model("qwen3", "small", str(tmp_path / "small"), seed=0, dtype="bfloat16", init_device="cuda")
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    ekw = dict(device="cuda", kv_cache_tokens=4096, weights_mode="discard")

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})  # trainer on GPU 0
        await setup_torch_distributed(procs)
        t = procs.spawn("trainer", TrainerActor, path, lr=1e-2, bf16=True)
        # "gpus" is a label: a process sees every GPU and uses the first unless told otherwise
        rprocs = this_host().spawn_procs(per_host={"gpus": 1})  # the reference engine, on the trainer's GPU 0
        oprocs = this_host().spawn_procs(per_host={"gpus": 1}, env={"CUDA_VISIBLE_DEVICES": "1"})  # on GPU 1
        ref = rprocs.spawn("ref", EngineActor, path, "torch", **ekw)
        other = oprocs.spawn("other", EngineActor, path, "torch", **ekw)
        await asyncio.gather(t.initialized(600), ref.initialized(600), other.initialized(600))
        before = await other.generate.call_one(SEQS[0][:32], greedy).result(300)
        await t.train_step.call_one(TrainBatch(SEQS, MASKS, [1.0, -1.0] * 4)).result(600)
        for e in (ref, other):
            await e.sleep.call(["weights", "kv_cache"]).result(300)
            await e.wake.call(["weights"]).result(300)
        plan = await t.push_weights.call_one([other], 1, 1 << 20, 120.0, "auto").result(300)
        await t.push_weights.call_one([ref], 1, 1 << 20, 120.0, "relay").result(300)
        for e in (ref, other):
            await e.wake.call(["kv_cache"]).result(300)
        outs = [await e.generate.call_one(SEQS[0][:32], greedy).result(300) for e in (other, ref)]
        groups = [(await other.stats.call_one().result(60))["weight_update_groups"]]
        # a second push of new weights reuses the NCCL group
        await t.train_step.call_one(TrainBatch(SEQS, MASKS, [1.0, -1.0] * 4)).result(600)
        await t.push_weights.call_one([other], 2, 1 << 20, 120.0, "auto").result(300)
        await t.push_weights.call_one([ref], 2, 1 << 20, 120.0, "relay").result(300)
        outs2 = [await e.generate.call_one(SEQS[0][:32], greedy).result(300) for e in (other, ref)]
        groups.append((await other.stats.call_one().result(60))["weight_update_groups"])
        events = await other.events.call_one().result(60)
        await t.shutdown.call().result(60)
        await procs.stop()
        await rprocs.stop()
        await oprocs.stop()
        return before, outs, outs2, plan, events, groups

    before, (other, ref), (other2, ref2), sent, events, groups = run(main(), 880)
    assert sent > 0
    assert other.token_ids == ref.token_ids and other.logprobs == ref.logprobs
    assert other.weight_version == 1 and other.logprobs != before.logprobs
    assert other2.token_ids == ref2.token_ids and other2.logprobs == ref2.logprobs and other2.weight_version == 2
    assert len(groups[0]) == 1 and groups[1] == groups[0]  # auto chose the broadcast group, kept for push 2
    assert [e[2] for e in events if e[1] == "update_weights"] == [1, 2]


def test_fused_adam_on_cuda_equals_the_foreach_path_and_steps_from_loaded_counters():
    """``fuse_on_cuda``: torch AdamW's fused kernel gives the default (foreach) path's params
    to float32 rounding over three steps; counters made by ``adam_step_counter`` (as the
    checkpoint loaders make them) live on the device and the fused step runs from them."""
    from engines.trainer.optim import adam_step_counter, fuse_on_cuda

    torch.manual_seed(0)
    shapes = [(1000,), (33, 7), (64, 128)]
    plain = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
    fused = [p.detach().clone().requires_grad_() for p in plain]
    a = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    b = torch.optim.AdamW(fused, lr=1e-2, weight_decay=0.1)
    fuse_on_cuda(b)
    assert all(g["fused"] and not g["foreach"] for g in b.param_groups)
    for step in range(4):
        if step == 3:  # a resumed run: the counters as a checkpoint loader puts them
            for p, counter in adam_step_counter(b, 3).items():
                assert counter.device == p.device
                b.state[p]["step"] = counter
        for p, q in zip(plain, fused):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    assert max((p - q).abs().max().item() for p, q in zip(plain, fused)) < 1e-5
    assert all(float(b.state[p]["step"]) == 4.0 for p in fused)


def test_checkpoint_round_trip_with_the_fused_optimizer_on_cuda(tmp_path):
    """bf16 params with Megatron's optimizer (fused Adam on CUDA): a checkpoint saved after a
    step loads back and training goes on (the loaded step counters on the device)."""
    path = make_model("qwen3", "tiny", str(tmp_path / "tiny"), seed=0, dtype="bfloat16", init_device="cuda")

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        t = procs.spawn("trainer", TrainerActor, path, lr=1e-4, bf16=True)
        await t.initialized(600)
        first = (await t.sft_step.call_one(SEQS, MASKS).result(600))["loss"]
        await t.save_checkpoint.call_one(str(tmp_path / "ckpt")).result(600)
        second = (await t.sft_step.call_one(SEQS, MASKS).result(600))["loss"]
        await t.load_checkpoint.call_one(str(tmp_path / "ckpt")).result(600)
        again = (await t.sft_step.call_one(SEQS, MASKS).result(600))["loss"]
        await t.shutdown.call().result(60)
        await procs.stop()
        return first, second, again

    first, second, again = run(main(), 880)
    assert abs(again - second) < 1e-3 * max(1.0, abs(second)), (first, second, again)


def test_clipping_inside_the_fused_adam_step_equals_scaling_the_gradients():
    """``clip_in_adam_step``: a fused AdamW told to scale by ``coef`` steps exactly as the
    foreach path on gradients multiplied by ``coef`` beforehand (to float32 rounding), and
    the step after ``end_adam_step`` is unscaled again."""
    from engines.trainer.optim import clip_in_adam_step, end_adam_step, fuse_on_cuda

    torch.manual_seed(1)
    shapes = [(4096,), (65, 33)]
    plain = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
    fused = [p.detach().clone().requires_grad_() for p in plain]
    a = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    b = torch.optim.AdamW(fused, lr=1e-2, weight_decay=0.1)
    assert not clip_in_adam_step(b, 0.5)  # not fused yet: the caller must scale
    end_adam_step(b)
    fuse_on_cuda(b)
    for coef in (0.25, 1e-3, None):
        for p, q in zip(plain, fused):
            q.grad = torch.randn_like(p) * 10
            p.grad = q.grad * coef if coef is not None else q.grad.clone()
        if coef is not None:
            assert clip_in_adam_step(b, coef)
        a.step()
        b.step()
        end_adam_step(b)
        assert max((p - q).abs().max().item() for p, q in zip(plain, fused)) < 1e-5, coef


@pytest.mark.parametrize("optimizer", ["torch", "megatron"])
def test_clip_grad_bounds_the_update_on_cuda(tmp_path, optimizer):
    """tests/trainer/test_trainer_actor.py's clipping test on CUDA, where the clipping happens
    inside the fused Adam step: clipped to 1e-9 one step barely moves the log-probs, unclipped
    it moves them, and both report the same norm before clipping."""
    bf16 = optimizer == "megatron"  # the torch path trains fp32 params only (bf16 needs fp32 masters)
    path = make_model("qwen3", "tiny", str(tmp_path / "tiny"), seed=0, dtype="bfloat16" if bf16 else "float32",
                      init_device="cuda")
    adv = [1.0, -1.0] * 4

    async def one_step(clip_grad):
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        t = procs.spawn("trainer", TrainerActor, path, lr=1e-2, bf16=bf16, clip_grad=clip_grad, optimizer=optimizer)
        await t.initialized(600)
        before = await t.compute_logprobs.call_one(SEQS).result(600)
        stats = await t.train_step.call_one(TrainBatch(SEQS, MASKS, adv)).result(600)
        after = await t.compute_logprobs.call_one(SEQS).result(600)
        await t.shutdown.call().result(60)
        await procs.stop()
        return max(abs(x - y) for rx, ry in zip(before, after) for x, y in zip(rx, ry)), stats["grad_norm"]

    async def main():
        return [await one_step(0.0), await one_step(1e-9)]

    (free, norm_free), (clipped, norm_clipped) = run(main(), 880)
    assert free > 1e-2, free
    assert clipped < 0.02 * free, (clipped, free)
    assert norm_clipped == pytest.approx(norm_free, rel=1e-3) and norm_free > 1e-3


def test_the_automatic_micro_batch_fills_the_gpu_within_its_plan(tmp_path):
    """Qwen3-0.6B-shaped model, bf16, no micro-batch size: the trainer sizes micro-batches to
    this GPU (engines/trainer/memory.py: 32,768 tokens on an 80 GB one), and a step whose one
    micro-batch holds that many tokens trains and peaks within the share of the GPU the
    arithmetic planned for."""
    from engines.trainer import memory

    path = make_model("qwen3", "0.6b", str(tmp_path / "q06"), seed=0, dtype="bfloat16", init_device="cuda")
    total = torch.cuda.get_device_properties(0).total_memory

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        t = procs.spawn("trainer", TrainerActor, path, lr=1e-5, bf16=True)
        await t.initialized(600)
        tokens = (await t.optimizer_info.call_one().result(60))["micro_batch_tokens"]
        seqs = [[5 + (i * 7 + j * 3) % 1000 for j in range(2048)] for i in range(tokens // 2048)]
        out = await t.sft_step.call_one(seqs, [[0] * 64 + [1] * 1983 for _ in seqs]).result(600)
        mem = await t.gpu_memory.call_one()
        await t.shutdown.call().result(60)
        await procs.stop()
        return tokens, out, mem

    tokens, out, mem = run(main(), 880)
    assert tokens >= (32768 if total >= 75 * (1 << 30) else memory.AUTO_MIN_TOKENS), (tokens, total)
    assert out["loss"] == out["loss"], out
    assert mem["peak"] <= memory.AUTO_GPU_SHARE * total, (mem["peak"] / (1 << 30), tokens)
