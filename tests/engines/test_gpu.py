"""GPU checks of the built-in engine (marker ``gpu``: run on the H200 machine, not in CI)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.builtin import TorchEngine
from engines.models.model_builder import make_model
from tests.helpers import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model_06b(tmp_path_factory):
    return make_model(
        "qwen3", "0.6b", str(tmp_path_factory.mktemp("m") / "q06"), seed=0, dtype="bfloat16", init_device="cuda"
    )


def test_a_sleeping_engine_lends_its_kv_cache_to_the_next_one_that_wakes(model_06b):
    """lend_kv (colocated engines, one worker per GPU): the rollout's sleep keeps its K and V
    whole in the pool, the judge's wake takes them (no new device memory: allocating memory
    just freed waits for the driver to clear it), with the same number of blocks as its own
    first cache, and generates exactly as before; drain() frees what is left."""
    from engines import kv_pool

    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    prompt = list(range(5, 40))

    async def main():
        judge = TorchEngine(model_06b, device="cuda", mem_fraction_static=0.4, weights_mode="backup", lend_kv=True)
        blocks = judge.runner.kv_blocks
        before = await judge.generate(prompt, greedy)
        await judge.sleep()  # lends its cache: the rollout's start takes it
        rollout = TorchEngine(model_06b, device="cuda", mem_fraction_static=0.4, lend_kv=True)
        took = kv_pool.lent_bytes("cuda")
        await rollout.generate(prompt, greedy)
        await rollout.sleep()
        lent = kv_pool.lent_bytes("cuda")
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info()[0]
        await judge.wake()
        torch.cuda.synchronize()
        taken = free - torch.cuda.mem_get_info()[0]
        after = await judge.generate(prompt, greedy)
        again, left = judge.runner.kv_blocks, kv_pool.lent_bytes("cuda")
        weights = judge.weights.full_nbytes()
        await judge.sleep()
        drained = kv_pool.drain("cuda")
        for e in (rollout, judge):
            await e.close()
        return blocks, again, took, lent, taken, left, drained, before, after, weights

    blocks, again, took, lent, taken, left, drained, before, after, weights = run(main(), 500)
    kv = 2 * (blocks + 1) * 28 * 16 * 8 * 128 * 2  # K and V: layers, block size 16, KV heads, dim, bf16
    assert took == 0 and lent == kv, (took, lent, kv)  # the rollout took the judge's, then lent it back
    assert again == blocks and left == 0 and drained == kv
    assert taken < weights + (1 << 29), (taken, weights)  # its weights only: the cache came from the pool
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


@pytest.mark.parametrize("mode", ["backup", "discard"])
def test_sleep_really_releases_gpu_memory(model_06b, mode):
    async def main():
        eng = TorchEngine(model_06b, device="cuda", mem_fraction_static=0.3, weights_mode=mode)
        prompt = list(range(5, 40))
        before = await eng.generate(prompt, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
        stats = await eng.stats()
        held = stats["bytes"]
        assert stats["cuda_graphs"] == [1]  # decode ran through a captured graph
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        await eng.sleep(["weights", "kv_cache"])
        free_asleep = torch.cuda.mem_get_info()[0]
        await eng.wake(["weights"])
        if mode == "discard":
            from safetensors.torch import load_file

            await eng.update_weights([load_file(f"{model_06b}/model.safetensors")], version=1)
        await eng.wake(["kv_cache"])
        after = await eng.generate(prompt, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
        captures = await eng.stats()
        await eng.close()
        return before, after, held, free_awake, free_asleep, captures

    before, after, held, free_awake, free_asleep, captures = run(main(), 500)
    released = free_asleep - free_awake
    assert released >= 0.95 * (held["weights"] + held["kv_cache"] + held["cuda_graph"]), (released, held)
    assert after.token_ids == before.token_ids
    # the sleep dropped the batch-1 graph: the generation after the wake captured it again
    assert captures["cuda_graph_captures"] == 2 and captures["cuda_graph_capture_s"] > 0, captures


def test_bf16_output_close_to_transformers(model_06b):
    import transformers

    # five prompts: the decode graph runs at the padded batch size 8
    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((8, 21, 40, 77, 130))]

    async def main():
        eng = TorchEngine(model_06b, device="cuda", kv_cache_tokens=8192)
        res = await asyncio.gather(
            *(eng.generate(p, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}) for p in prompts)
        )
        await eng.close()
        return res

    res = run(main(), 500)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_06b, dtype=torch.bfloat16).cuda().eval()
    diffs, agree, total = [], 0, 0
    for p, r in zip(prompts, res):
        ids = torch.tensor([p + r.token_ids], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1)
        ours = torch.tensor(r.logprobs, device="cuda")
        diffs.append(
            (ours - ref.gather(1, torch.tensor(r.token_ids, device="cuda")[:, None])[:, 0]).abs().mean().item()
        )
        agree += sum(int(a == b) for a, b in zip(ref.argmax(-1).tolist(), r.token_ids))
        total += len(r.token_ids)
    assert max(diffs) < 0.05, diffs  # bf16: same distribution up to rounding
    assert agree / total >= 0.9, agree / total  # teacher-forced argmax agrees on >= 90% of steps


def test_decode_kernel_bf16_matches_reference():
    """The Triton paged decode attention on a Qwen3-0.6B-like head layout (16 query heads, 8
    KV heads, head dim 128) in bf16 against the float32 reference, contexts up to 700."""
    from engines.kernels.paged_attention import _triton_decode, paged_decode_attention_ref

    torch.manual_seed(0)
    b, blocks, page = 64, 3000, 16
    q = torch.randn(b, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(blocks, page, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(blocks, page, 8, 128, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device="cuda")[: b * 44].view(b, 44).to(torch.int32)
    lens = torch.randint(1, 44 * page + 1, (b,), device="cuda", dtype=torch.int32)
    out = _triton_decode(q, k, v, tables, lens, 128**-0.5).float()
    ref = paged_decode_attention_ref(q.float(), k.float(), v.float(), tables, lens, 128**-0.5)
    assert (out - ref).abs().max().item() < 2e-2


def test_cuda_graph_decode_equals_eager_decode(model_06b):
    """Eight requests decode at batch 8 (no padding): the captured graph gives exactly the
    eager step's tokens and log-probs."""
    prompts = [list(range(7 + i, 7 + i + n)) for i, n in enumerate((5, 9, 16, 31, 33, 60, 64, 100))]

    async def main(graph):
        eng = TorchEngine(model_06b, device="cuda", kv_cache_tokens=8192, cuda_graph=graph)
        res = await asyncio.gather(
            *(eng.generate(p, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}) for p in prompts)
        )
        graphs = (await eng.stats())["cuda_graphs"]
        await eng.close()
        return res, graphs

    eager, none = run(main(False), 300)
    graphed, held = run(main(True), 300)
    assert none == [] and held == [8]
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert [r.logprobs for r in graphed] == [r.logprobs for r in eager]


def test_cuda_graph_decode_equals_eager_decode_across_the_long_context_line(model_06b):
    """Requests whose contexts grow past LONG_CONTEXT_TOKENS mid-generation (their attention
    then splits as a long context's): the graphs of short and long tables give exactly the
    eager steps' tokens and log-probs, and both kinds were captured."""
    from engines.kernels.paged_attention import LONG_CONTEXT_TOKENS

    prompts = [list(range(7 + i, 7 + i + LONG_CONTEXT_TOKENS - 60 + 7 * i)) for i in range(8)]

    async def main(graph):
        eng = TorchEngine(model_06b, device="cuda", kv_cache_tokens=8 * 2304, cuda_graph=graph)
        res = await asyncio.gather(
            *(eng.generate(p, {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}) for p in prompts)
        )
        keys = sorted(eng.runner.graphs.graphs) if eng.runner.graphs is not None else []
        await eng.close()
        return res, keys

    eager, _ = run(main(False), 300)
    graphed, keys = run(main(True), 300)
    assert {long for _, long in keys} == {False, True}, keys
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert [r.logprobs for r in graphed] == [r.logprobs for r in eager]


def test_batch_one_decode_with_programmatic_dependent_launch_equals_it_without(model_06b, monkeypatch):
    """One request (the skinny-GEMM path; its kernels, the q/k/v rotary write and the split
    attention with its combine launch as programmatic dependents on Hopper): captured and eager
    steps with PDL give exactly the tokens and log-probs of the steps without it
    (RELAY_DECODE_PDL=0), a long prompt (a split attention) included."""
    from engines.kernels.paged_attention import pdl_enabled

    assert pdl_enabled(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    prompts = [list(range(7, 40)), [11 + i % 500 for i in range(3000)]]

    async def main(graph):
        eng = TorchEngine(model_06b, device="cuda", kv_cache_tokens=8192, cuda_graph=graph)
        res = [await eng.generate(p, {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}) for p in prompts]
        await eng.close()
        return [(r.token_ids, r.logprobs) for r in res]

    with_pdl = [run(main(graph), 300) for graph in (True, False)]
    monkeypatch.setenv("RELAY_DECODE_PDL", "0")
    assert not pdl_enabled(torch.device("cuda"))
    without = [run(main(graph), 300) for graph in (True, False)]
    assert with_pdl == without


def test_sampling_keys_under_cuda_graphs(tmp_path):
    """Penalties and min_p apply to the logits of a CUDA-graph decode as to an eager one
    (graphs capture the forward only), and the defaults' rows beside penalized rows are
    unchanged (against a batch of the same size whose other rows are unpenalized seeded
    ones: a decode step's kernels may depend on its batch size, e.g. attention split over
    the context for small batches); min_p 1 through the Triton seeded path equals greedy."""
    path = make_model("qwen3", "tiny", str(tmp_path / "tiny"), seed=1)
    prompts = [[5 + (i * 7 + n) % 90 for i in range(n)] for n in (3, 9, 17, 30)]
    greedy = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    seeded = {"temperature": 0.8, "seed": 7, "max_new_tokens": 32, "ignore_eos": True}
    penalized = [
        {**greedy, "repetition_penalty": 1.5, "frequency_penalty": 1.0},
        {**seeded, "seed": 9, "min_p": 0.2, "presence_penalty": 0.5},
        {**greedy, "min_new_tokens": 6, "stop_token_ids": [22]},
    ]
    min_p_one = {"temperature": 1.3, "min_p": 1.0, "seed": 4, "max_new_tokens": 32, "ignore_eos": True}
    fillers = [{**seeded, "seed": 100 + j} for j in range(4)]  # plain's batch: as many rows as mixed's

    async def main(graph):
        eng = TorchEngine(path, device="cuda", kv_cache_tokens=8192, cuda_graph=graph)
        plain = await asyncio.gather(*(eng.generate(p, sp) for p in prompts for sp in (greedy, seeded, *fillers)))
        mixed = await asyncio.gather(
            *(eng.generate(p, sp) for p in prompts for sp in (greedy, seeded, min_p_one, *penalized))
        )
        graphs = (await eng.stats())["cuda_graphs"]
        await eng.close()
        return plain, mixed, graphs

    g_plain, g_mixed, graphs = run(main(True))
    e_plain, e_mixed, no_graphs = run(main(False))
    assert graphs and not no_graphs
    for plain, mixed in ((g_plain, g_mixed), (e_plain, e_mixed)):
        beside = [r for i, r in enumerate(mixed) if i % 6 < 2]
        plain = [r for i, r in enumerate(plain) if i % 6 < 2]
        assert [r.token_ids for r in plain] == [r.token_ids for r in beside]
        assert [r.logprobs for r in plain] == [r.logprobs for r in beside]
        assert [r.token_ids for r in mixed[2::6]] == [r.token_ids for r in mixed[0::6]]  # min_p 1 == greedy
        assert all(22 not in r.token_ids[:6] for r in mixed[5::6])
    assert [r.token_ids for r in g_mixed] == [r.token_ids for r in e_mixed]


def test_one_pass_sampling_at_a_real_vocabulary():
    """``sample_pairs`` on the GPU at the 0.6B shape's vocabulary and a 256-row batch (bf16
    logits as the decode graph leaves them): greedy rows give torch's argmax and log-softmax;
    seeded rows at temperatures from 0.05 to 2 give the torch hash's Gumbel-max token (float64
    scores: the kernel's float32 shortlist and GPU logs must not change a token) and its
    log-probability at that temperature."""
    from engines.builtin.sample_kernels import sample_pairs, seeded_uniform

    torch.manual_seed(0)
    rows, vocab = 256, 151936
    logits = (torch.randn(rows, vocab, device="cuda") * 4).bfloat16()
    x = logits.float()
    greedy = sample_pairs(logits)
    assert torch.equal(greedy[:, 0].long(), x.argmax(-1))
    lp = torch.log_softmax(x, -1).gather(1, greedy[:, 0].long()[:, None])[:, 0].double()
    assert (greedy[:, 1] - lp).abs().max().item() < 1e-4
    temps = torch.linspace(0.05, 2.0, rows, device="cuda")
    seeds = torch.arange(rows, dtype=torch.int64, device="cuda") * 7919 + 11
    pos = torch.arange(rows, dtype=torch.int64, device="cuda") * 13
    pairs = sample_pairs(logits, temps, seeds, pos)
    tok = pairs[:, 0].long()
    for lo in range(0, rows, 32):  # the float64 reference in slices ([32, V] float64 at a time)
        sl = slice(lo, lo + 32)
        u = seeded_uniform(seeds[sl], pos[sl], vocab)
        ref = ((x[sl] / temps[sl, None]).double() - torch.log(-torch.log(u))).argmax(-1)
        assert torch.equal(tok[sl], ref), (tok[sl] != ref).nonzero().flatten().tolist()
        z = torch.log_softmax(x[sl] / temps[sl, None], -1).gather(1, tok[sl, None])[:, 0].double()
        assert (pairs[sl, 1] - z).abs().max().item() < 1e-3


def test_fused_prefill_close_to_the_torch_prefill(model_06b, monkeypatch):
    """On CUDA the prefill runs the decode step's kernels (engines/models/fused_decode.py
    ``prefill_fused``); in bf16 at the 0.6B shape its last-token log-probs and the K/V it writes
    stay within bf16 rounding of the torch prefill's, for right-padded prompts up to 1,500
    tokens."""
    import engines.models.model as model_module

    async def main():
        eng = TorchEngine(model_06b, device="cuda", kv_cache_tokens=8192)
        model, runner = eng.runner.model, eng.runner
        bs = runner.blocks.block_size
        lens = torch.tensor([1500, 901, 37, 2])
        ids = torch.randint(5, 5000, (4, 1500), device="cuda")
        scratch = runner.blocks.scratch_block * bs
        slots = torch.randperm(scratch, device="cuda")[: 4 * 1500].view(4, 1500)
        for r, n in enumerate(lens.tolist()):
            slots[r, n:] = scratch
        caches = [(torch.zeros_like(runner.k), torch.zeros_like(runner.v)) for _ in range(2)]
        fused = model.prefill(ids, lens.cuda(), slots, *caches[0])
        monkeypatch.setattr(model_module, "triton_usable", lambda device: False)
        ref = model.prefill(ids, lens.cuda(), slots, *caches[1])
        monkeypatch.undo()
        real = slots[slots != scratch]
        kv = [(a.view(a.shape[0], -1, *a.shape[3:])[:, real].float() - b.view(b.shape[0], -1, *b.shape[3:])[:, real]
               .float()).abs().mean().item() for a, b in zip(caches[0], caches[1])]
        await eng.close()
        return torch.log_softmax(fused.float(), -1), torch.log_softmax(ref.float(), -1), kv

    fused, ref, kv = run(main(), 300)
    p = ref.exp()
    assert ((p * (ref - fused)).sum(-1)).max().item() < 0.02  # KL(ref || fused) per prompt
    assert max(kv) < 0.02, kv
