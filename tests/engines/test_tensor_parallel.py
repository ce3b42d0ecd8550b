"""The built-in engine over several GPUs (tensor parallel, engines/builtin/tp.py): each rank is
its own process with its shard of the model and KV cache (gloo on CPU); the engine answers
as the same model on one GPU does, through prefill, shared-prefix samples, decode, sleep,
wake and a weight update."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engines.actor import EngineActor
from engines.builtin.tp import FollowerActor
from engines.models.model import ModelConfig, shard_tensor
from engines.models.model_builder import make_model
from relay import this_host
from tests.helpers import run

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.mark.unit
@pytest.mark.parametrize("arch,tp", [("qwen3", 2), ("qwen3", 4), ("llama", 2), ("qwen3_moe", 2)])
def test_the_shards_of_every_tensor_put_together_are_the_tensor(tmp_path, arch, tp):
    path = make_model(arch, "tiny", str(tmp_path / "m"), seed=3)
    cfg = ModelConfig.from_dir(path)
    full = load_file(f"{path}/model.safetensors")
    for name, tensor in full.items():
        parts = [shard_tensor(cfg.shard_for(tp, r), name, tensor) for r in range(tp)]
        leaf = name.rsplit(".", 2)[-2]
        if leaf in ("o_proj", "down_proj"):
            assert torch.equal(torch.cat(parts, 1), tensor), name
        elif leaf in ("k_proj", "v_proj") and tp > cfg.num_kv_heads:  # fewer KV heads than ranks: replicated
            per = tp // cfg.num_kv_heads
            assert torch.equal(torch.cat(parts[::per], 0), tensor), name
        elif leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") or (
                name == "lm_head.weight" and not cfg.tie_word_embeddings):
            assert torch.equal(torch.cat(parts, 0)[: tensor.shape[0]], tensor), name
        else:
            assert all(p is tensor for p in parts), name


@pytest.mark.unit
def test_a_linear_attention_layers_shards_are_its_heads(tmp_path):
    """qwen3_5_moe over 2 ranks: each rank's q, k and v channels (projection and conv), value
    heads' gates, decays and output columns are its own heads', and together every head."""
    path = make_model("qwen3_5_moe", "tiny", str(tmp_path / "m"), seed=3)
    cfg = ModelConfig.from_dir(path)
    full = {k.replace("model.language_model.", "model."): v for k, v in load_file(f"{path}/model.safetensors").items()}
    kd, vd = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    seen = set()
    for name, tensor in full.items():
        if ".linear_attn." not in name:
            continue
        seen.add(name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1])
        parts = [shard_tensor(cfg.shard_for(2, r), name, tensor) for r in range(2)]
        if ".in_proj_qkv." in name or ".conv1d." in name:
            for lo, width in ((0, kd), (kd, kd), (2 * kd, vd)):  # q, k, v: each section split by heads
                got = torch.cat([p.narrow(0, lo // 2, width // 2) for p in parts])
                assert torch.equal(got, tensor.narrow(0, lo, width)), name
        elif ".out_proj." in name:
            assert torch.equal(torch.cat(parts, 1), tensor), name
        elif ".norm." in name:
            assert all(p is tensor for p in parts), name
        else:  # in_proj_z / a / b, dt_bias, A_log: by value heads
            assert torch.equal(torch.cat(parts, 0), tensor) and parts[0].shape[0] == tensor.shape[0] // 2, name
    assert seen == {"in_proj_qkv", "conv1d", "in_proj_z", "in_proj_a", "in_proj_b", "dt_bias", "A_log", "norm",
                    "out_proj"}, seen
    q = full["model.layers.1.self_attn.q_proj.weight"]  # gated attention: each head's query and gate rows
    parts = [shard_tensor(cfg.shard_for(2, r), "model.layers.1.self_attn.q_proj.weight", q) for r in range(2)]
    assert torch.equal(torch.cat(parts), q) and parts[0].shape[0] == cfg.num_heads // 2 * cfg.head_dim * 2


@pytest.mark.unit
@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 2)])
def test_expert_parallel_ranks_hold_their_groups_experts_and_together_every_expert(tmp_path, tp, ep):
    path = make_model("qwen3_moe", "tiny", str(tmp_path / "m"), seed=3)
    cfg = ModelConfig.from_dir(path)
    per_group, split = cfg.num_experts // ep, tp // ep
    name = "model.layers.0.mlp.experts.gate_up_proj"
    stacked = torch.randn(cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    for r in range(tp):
        c = cfg.shard_for(tp, r, ep)
        assert (c.ep_size, c.ep_rank) == (ep, r // split)
        mine = shard_tensor(c, name, stacked)
        assert mine.shape == (per_group, 2 * cfg.moe_intermediate_size // split, cfg.hidden_size)
        first = c.ep_rank * per_group
        gate = stacked[first:first + per_group, :cfg.moe_intermediate_size].chunk(split, 1)[r % split]
        assert torch.equal(mine[:, :gate.shape[1]], gate)
        for e in range(cfg.num_experts):  # one expert's tensor: only its group's ranks take it
            one = shard_tensor(c, f"model.layers.0.mlp.experts.{e}.down_proj.weight", stacked[e, :cfg.hidden_size])
            assert (one is not None) == (first <= e < first + per_group)
    with pytest.raises(ValueError, match="ep_size 3 must divide the engine's 2 GPUs"):
        cfg.shard_for(2, 0, 3)
    with pytest.raises(ValueError, match="ep_size 2 must divide the engine's 1 GPUs"):
        cfg.shard_for(1, 0, 2)
    dense = ModelConfig.from_dir(make_model("qwen3", "tiny", str(tmp_path / "d"), seed=3))
    assert dense.shard_for(2, 1, 2).ep_size == 1  # a dense model ignores ep_size, as SGLang does


@pytest.mark.unit
def test_a_model_that_does_not_divide_over_the_ranks_is_refused_naming_the_dimension(tmp_path):
    cfg = ModelConfig.from_dir(make_model("qwen3", "tiny", str(tmp_path / "m"), seed=3))
    with pytest.raises(ValueError, match=r"attention heads \(4\) do not divide over 3 tensor-parallel GPUs"):
        cfg.shard_for(3, 0)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch,tp,fused,ep", [("qwen3", 2, False, 1), ("llama", 2, False, 1), ("qwen3", 4, False, 1),
                                              ("qwen3", 2, True, 1), ("qwen3_moe", 2, False, 1),
                                              ("qwen3_moe", 2, False, 2), ("qwen3_moe", 2, True, 2),
                                              ("qwen3_5_moe", 2, False, 1), ("qwen3_5_moe", 2, True, 2)])
def test_a_tensor_parallel_engine_answers_as_the_one_gpu_engine(tmp_path, arch, tp, fused, ep):
    """``fused``: decode through the fused Triton kernels (the GPU path: residual RMSNorm,
    norm+rope, paged attention, the MoE grouped GEMMs), run by Triton's interpreter on CPU.
    ``qwen3_moe``: each expert's intermediate dimension split over the ranks (``ep`` 1) or each
    rank holding half the experts whole (``ep`` 2, expert parallel: the other half's
    assignments skipped), the weight update naming experts one by one (its fused path over TP
    shards: tests/engines/test_moe.py, at the layer). ``qwen3_5_moe``: the hybrid's Gated
    DeltaNet heads, their conv and recurrent states, gated attention and shared expert split
    over the ranks (``fused``: the linear-attention decode kernels too)."""
    policy = make_model(arch, "tiny", str(tmp_path / "p"), seed=1)
    other = make_model(arch, "tiny", str(tmp_path / "o"), seed=2)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], list(range(20, 45))]
    options = {"kv_cache_tokens": 1024, "weights_mode": "discard"}
    # under the interpreter a decode step costs seconds: 4 tokens (a prefill and 3 decode
    # steps through every kernel) instead of 8
    sampling = {**GREEDY, "max_new_tokens": 4} if fused else GREEDY

    async def generate(engine, n: int = 1) -> list:
        out = []
        for p in prompts:
            for r in (await engine.generate_batch.call_one([[p, sampling]] * n).result(120)):
                out.append((r.token_ids, r.logprobs))
        return out

    def same(a: list, b: list) -> None:
        assert [t for t, _ in a] == [t for t, _ in b]
        for (_, la), (_, lb) in zip(a, b):
            assert max(abs(x - y) for x, y in zip(la, lb)) < 1e-4

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": tp + 1}, env={"TRITON_INTERPRET": "1"} if fused else None)
        one = procs.slice(gpus=0).spawn("one", EngineActor, policy, "torch", **options)
        followers = [procs.slice(gpus=1 + r).spawn(f"f{r}", FollowerActor) for r in range(1, tp)]
        for f in followers:
            await f.initialized(timeout=60)
        sharded = procs.slice(gpus=1).spawn("sharded", EngineActor, policy, "torch", tp_peers=followers, **options,
                                            **({"engine_config": {"ep_size": ep}} if ep > 1 else {}))
        await one.initialized(timeout=120)
        await sharded.initialized(timeout=120)
        first = await generate(sharded)
        same(first, await generate(one))
        same(await generate(sharded, n=4), await generate(one, n=4))  # samples of one prompt share its prefill
        stats = [await e.stats.call_one().result(30) for e in (one, sharded)]
        cfg = ModelConfig.from_dir(policy).shard_for(tp, 0)  # rank 0 holds its share of the KV heads
        assert stats[1]["bytes"]["kv_cache"] * cfg.num_kv_heads == stats[0]["bytes"]["kv_cache"] * cfg.local_kv_heads
        assert stats[1]["bytes"]["weights"] < stats[0]["bytes"]["weights"]
        assert stats[1]["ep_size"] == ep
        # sleep, wake and a weight update (the full tensors reach every rank; each keeps its shard)
        tensors = load_file(f"{other}/model.safetensors")
        for engine in (one, sharded):
            await engine.sleep.call_one(["weights", "kv_cache"]).result(60)
            await engine.wake.call_one(["weights"]).result(60)
            await engine.update_weights.call_one([tensors], 7).result(60)
            await engine.wake.call_one(["kv_cache"]).result(60)
        updated = await generate(sharded)
        same(updated, await generate(one))
        assert [lp for _, lp in updated] != [lp for _, lp in first]  # the new weights answer differently
        statuses = [await f.status.call_one().result(30) for f in followers]
        assert [(s["running"], s["error"], s["rank"]) for s in statuses] == [(True, None, r) for r in range(1, tp)]
        await procs.stop()

    run(main(), 280)
