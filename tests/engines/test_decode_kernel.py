"""The paged decode-attention kernel (engines/kernels/paged_attention.py) against its torch reference, run
under Triton's interpreter on CPU (``TRITON_INTERPRET=1`` must be set before Triton loads,
so each check runs in a fresh interpreter), and a whole engine decoding through it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
pytest.importorskip(
    "triton", reason="Triton is a dev dependency (pyproject [dev]); the kernel runs under its interpreter here"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _interpret(code: str, timeout: float = 240) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_kernel_matches_reference_across_shapes():
    """GQA groups 1, 2, 3 and 8; head dims 16, 24 (padded to a power of two) and 128;
    block sizes 8 and 16; lengths from 1 to a full table; scattered, repeated blocks."""
    out = _interpret("""
        import torch
        from engines.kernels.paged_attention import _triton_decode, paged_decode_attention_ref
        torch.manual_seed(0)
        worst = 0.0
        for (b, h, kvh, d, page, blocks, width) in [(3, 4, 4, 16, 16, 9, 3), (5, 4, 2, 24, 8, 40, 6),
                                                    (2, 6, 2, 16, 16, 12, 5), (2, 16, 2, 128, 16, 30, 9)]:
            q = torch.randn(b, h, d)
            k, v = torch.randn(blocks, page, kvh, d), torch.randn(blocks, page, kvh, d)
            tables = torch.randint(0, blocks, (b, width), dtype=torch.int32)
            lens = torch.randint(1, width * page + 1, (b,), dtype=torch.int32)
            lens[0], lens[-1] = 1, width * page
            out = _triton_decode(q, k, v, tables, lens, d ** -0.5)
            ref = paged_decode_attention_ref(q, k, v, tables, lens, d ** -0.5)
            assert out.shape == ref.shape and out.dtype == ref.dtype
            worst = max(worst, (out - ref).abs().max().item())
        print(worst)
    """)
    assert float(out.split()[-1]) < 1e-5


def test_split_context_kernel_matches_reference():
    """The context of each (sequence, KV head) split over 2, 3, 16 and 32 programs (most of them
    empty for short contexts) and combined gives the reference's attention; the batch sizes
    that split are the ones ``decode_splits`` names."""
    out = _interpret("""
        import torch
        from engines.kernels.paged_attention import (DECODE_SPLITS, _triton_decode, decode_splits,
                                                     paged_decode_attention_ref)
        torch.manual_seed(5)
        worst = 0.0
        for (b, h, kvh, d, page, blocks, width) in [(1, 4, 2, 16, 16, 20, 12), (3, 6, 2, 24, 8, 40, 20)]:
            q = torch.randn(b, h, d)
            k, v = torch.randn(blocks, page, kvh, d), torch.randn(blocks, page, kvh, d)
            tables = torch.randint(0, blocks, (b, width), dtype=torch.int32)
            lens = torch.randint(1, width * page + 1, (b,), dtype=torch.int32)
            lens[0] = width * page
            ref = paged_decode_attention_ref(q, k, v, tables, lens, d ** -0.5)
            for splits in (2, 3, 16, 32):
                out = _triton_decode(q, k, v, tables, lens, d ** -0.5, splits=splits)
                worst = max(worst, (out - ref).abs().max().item())
        cpu = torch.device("cpu")  # 4 "SMs" under the interpreter
        short = [decode_splits(1, 1, cpu, 2048) == DECODE_SPLITS, decode_splits(2, 1, cpu, 256),
                 decode_splits(1, 2, cpu, 2048)]
        long = [decode_splits(8, 1, cpu, 8192), decode_splits(4, 2, cpu, 4096), decode_splits(5, 2, cpu, 2049),
                decode_splits(64, 1, cpu, 8192), decode_splits(1, 1, cpu, 8192)]
        print(worst, *short, *long)
    """)
    worst, one, two_rows, two_heads, eight, four_by_two, five_by_two, many, single = out.split()[-9:]
    assert float(worst) < 1e-5
    # tables spanning at most 2,048 tokens: split only with at most a quarter of the 4 "SMs" busy
    assert (one, two_rows, two_heads) == ("True", "1", "1")
    # longer: 8 programs an SM x 4 "SMs": 8 rows of 1 KV head split in 4, 4 rows x 2 heads
    # also, 5 rows count as 8 (2), 64 rows do not split
    assert (eight, four_by_two, five_by_two, many) == ("4", "4", "2", "1")
    # one row of one head: 32 programs on 4 "SMs" (past the 16 of a short context's split)
    assert single == "32"


def test_kernel_ignores_context_past_each_length():
    """Keys and values past a sequence's length (stale cache contents) do not leak in."""
    out = _interpret("""
        import torch
        from engines.kernels.paged_attention import _triton_decode
        torch.manual_seed(1)
        q = torch.randn(2, 4, 16)
        k, v = torch.randn(6, 16, 2, 16), torch.randn(6, 16, 2, 16)
        tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
        lens = torch.tensor([20, 33], dtype=torch.int32)
        a = _triton_decode(q, k, v, tables, lens, 0.25)
        k2, v2 = k.clone(), v.clone()
        k2[1, 4:], v2[1, 4:] = 1e4, -1e4   # sequence 0's slots 20..31
        k2[5, 1:], v2[5, 1:] = 1e4, -1e4   # sequence 1's slots 33..47
        b = _triton_decode(q, k2, v2, tables, lens, 0.25)
        print((a - b).abs().max().item())
    """)
    assert float(out.split()[-1]) == 0.0


def test_engine_decoding_through_the_kernel_equals_transformers(tmp_path):
    """The built-in engine with decode attention in the (interpreted) Triton kernel gives
    transformers' greedy tokens, for a batch of prompts of different lengths."""
    out = _interpret(f"""
        import asyncio, json, torch, transformers
        from engines.models.model_builder import make_model
        from engines.builtin import TorchEngine
        path = make_model("qwen3", "tiny", {str(tmp_path / "m")!r}, seed=3)
        prompts = [[5 + (i * 7 + n) % 90 for i in range(n)] for n in (3, 11, 20, 37)]
        async def main():
            eng = TorchEngine(path, kv_cache_tokens=1024)
            greedy = {{"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
            res = await asyncio.gather(*(eng.generate(p, greedy) for p in prompts))
            seeded = await asyncio.gather(*(
                eng.generate(p, {{"temperature": 0.8, "seed": 11 + i, "max_new_tokens": 12, "ignore_eos": True}})
                for i, p in enumerate(prompts)
            ))
            await eng.close()
            return [r.token_ids for r in res], [r.token_ids for r in seeded]
        ours, seeded = asyncio.run(main())
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        ref = []
        for p in prompts:
            o = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
            ref.append(o[0, len(p):].tolist())
        print(json.dumps([ours, ref, seeded]))
    """)
    import asyncio
    import json

    from engines.builtin import TorchEngine

    ours, ref, seeded = json.loads(out.strip().splitlines()[-1])
    assert ours == ref

    async def torch_path():  # this process: no interpreter, so seeded rows use the torch hash path
        eng = TorchEngine(str(tmp_path / "m"), kv_cache_tokens=1024)
        res = [
            await eng.generate(p, {"temperature": 0.8, "seed": 11 + i, "max_new_tokens": 12, "ignore_eos": True})
            for i, p in enumerate([[5 + (i * 7 + n) % 90 for i in range(n)] for n in (3, 11, 20, 37)])
        ]
        await eng.close()
        return [r.token_ids for r in res]

    assert asyncio.run(torch_path()) == seeded  # the fused seeded-sampling kernel draws the same tokens


def test_seeded_gumbel_kernel_matches_the_torch_hash():
    """The fused seeded Gumbel-max kernel picks the torch path's tokens (same 64-bit hash,
    same float64 scores), for large seeds and positions and a vocabulary not a multiple
    of the tile."""
    out = _interpret("""
        import torch
        from engines.builtin.sample_kernels import seeded_gumbel_argmax, seeded_uniform
        torch.manual_seed(0)
        r, v = 8, 3001
        logits = torch.randn(r, v) * 3
        temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 0.5, 1.0, 0.9])
        seeds = torch.tensor([1, 2, 3, 1 << 40, 5, 12345678901, 0, (1 << 62) + 7], dtype=torch.int64)
        pos = torch.tensor([0, 1, 7, 100, 2, 9, 40000, 3], dtype=torch.int64)
        u = seeded_uniform(seeds, pos, v)
        ref = ((logits / temps[:, None]).double() - torch.log(-torch.log(u))).argmax(-1)
        print(int((seeded_gumbel_argmax(logits, temps, seeds, pos) == ref).all()))
    """)
    assert out.split()[-1] == "1"


def test_one_pass_sampling_kernel_matches_the_torch_rules():
    """``sample_pairs`` (two kernels, one pass over the logits, split into vocabulary chunks):
    greedy rows give torch's argmax (the first of tied maxima, across chunks too) and its
    log-softmax; sampled rows give the seeded Gumbel-max token of their (seed, position) at
    their temperature (as ``seeded_gumbel_argmax`` and the torch hash) and its log-softmax at
    that temperature; greedy and sampled rows mixed in one batch; a row whose first chunk is
    all -inf; and the drawn tokens follow the softmax (2,000 seeds over an 8-token vocabulary,
    with the hash's noise and with the unseeded rows' Philox noise)."""
    out = _interpret("""
        import torch
        from engines.builtin.sample_kernels import PICK_CHUNK, sample_pairs, seeded_uniform
        torch.manual_seed(0)
        r, v = 6, 2 * PICK_CHUNK + 11
        logits = torch.randn(r, v) * 3
        logits[0, 5] = logits[0, PICK_CHUNK + 3] = 50.0   # tied maxima in different chunks: the first wins
        logits[1, 7] = logits[1, 9] = 60.0                # tied in one chunk
        logits[2, :PICK_CHUNK] = float("-inf")            # a whole chunk of -inf
        worst = 0.0
        pairs = sample_pairs(logits)
        tok, lp = pairs[:, 0].long(), pairs[:, 1]
        ok = bool((tok == logits.argmax(-1)).all()) and tok[0].item() == 5 and tok[1].item() == 7
        ref_lp = torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0].double()
        worst = max(worst, (lp - ref_lp).abs().max().item())
        temps = torch.tensor([0.0, 0.7, 1.3, 1.0, 0.0, 2.0])
        seeds = torch.tensor([0, 2, 1 << 40, 12345678901, 0, (1 << 62) + 7], dtype=torch.int64)
        pos = torch.tensor([0, 1, 100, 40000, 0, 3], dtype=torch.int64)
        pairs = sample_pairs(logits, temps, seeds, pos)
        tok, lp = pairs[:, 0].long(), pairs[:, 1]
        t = torch.where(temps > 0, temps, torch.ones_like(temps))
        u = seeded_uniform(seeds, pos, v)
        ref = torch.where(temps > 0, ((logits / t[:, None]).double() - torch.log(-torch.log(u))).argmax(-1),
                          logits.argmax(-1))
        ok &= bool((tok == ref).all())
        logp = torch.log_softmax(logits / t[:, None], -1)
        worst = max(worst, (lp - logp.gather(1, tok[:, None])[:, 0].double()).abs().max().item())
        n = 2000
        small = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -3.0, 0.3]).repeat(n, 1)
        drawn = sample_pairs(small, torch.ones(n), torch.arange(n, dtype=torch.int64) * 7919 + 1,
                             torch.zeros(n, dtype=torch.int64))[:, 0].long()
        freq = torch.bincount(drawn, minlength=8).double() / n
        dist = (freq - torch.softmax(small[0].double(), -1)).abs().max().item()
        unseeded = sample_pairs(small * 2, torch.full((n,), 2.0), torch.arange(n, dtype=torch.int64) * 104729 + 3,
                                torch.full((n,), -1, dtype=torch.int64))[:, 0].long()
        freq = torch.bincount(unseeded, minlength=8).double() / n
        dist = max(dist, (freq - torch.softmax(small[0].double(), -1)).abs().max().item())
        half = logits.bfloat16()  # a decode graph's logits: read as float32, the same pairs as their float32 copy
        ok &= bool(torch.equal(sample_pairs(half), sample_pairs(half.float())))
        ok &= bool(torch.equal(sample_pairs(half, temps, seeds, pos), sample_pairs(half.float(), temps, seeds, pos)))
        print(int(ok), worst, dist)
    """)
    ok, worst, dist = out.split()[-3:]
    assert ok == "1" and float(worst) < 1e-5 and float(dist) < 0.04, (ok, worst, dist)


def test_one_pass_seeded_rows_decide_near_ties_in_float64():
    """A seeded row's float32 keys only shortlist: where another token's key is within the
    float32 error of the best (in another lane, or in the best one's own lane a block later),
    the float64 keys decide, as the torch hash's scores do; tiny temperatures (keys in the
    thousands) too."""
    out = _interpret("""
        import torch
        from engines.builtin.sample_kernels import PICK_BLOCK, sample_pairs, seeded_uniform
        v = 3 * PICK_BLOCK + 5
        # within float32's rounding at 5 (4.8e-7 apart) the float32 keys tie or flip; further, they agree
        deltas = [k * 2.5e-8 for k in range(-40, 41)] + [3e-5, -3e-5, 4e-4, -4e-4, 1e-2]
        rows, temps, seeds, pos = [], [], [], []
        for i, d in enumerate(deltas):
            for lane_mate in (False, True):  # the rival in another lane, or in the best one's lane
                s, p = 1000 + 7 * i + lane_mate, 3 + i
                g = -torch.log(-torch.log(seeded_uniform(torch.tensor([s]), torch.tensor([p]), v)[0]))
                x = torch.full((v,), -20.0, dtype=torch.float64)
                a, b = 17, 17 + PICK_BLOCK if lane_mate else 40
                x[a], x[b] = 5.0 - g[a], 5.0 - g[b] + d  # keys 5 and 5 + d: a near tie
                rows.append(x.float()); temps.append(1.0); seeds.append(s); pos.append(p)
        for i in range(6):  # tiny temperatures: large keys
            rows.append(torch.randn(v) * 2); temps.append(0.002 * (i + 1)); seeds.append(77 + i); pos.append(i)
        logits, temps = torch.stack(rows), torch.tensor(temps)
        seeds, pos = torch.tensor(seeds, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64)
        u = seeded_uniform(seeds, pos, v)
        ref = ((logits / temps[:, None]).double() - torch.log(-torch.log(u))).argmax(-1)
        tok = sample_pairs(logits, temps, seeds, pos)[:, 0].long()
        print(int((tok == ref).all()), (tok != ref).nonzero().flatten().tolist())
    """)
    assert out.split()[0] == "1", out


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_sampling_kernels_compile_for_an_h200_without_one(greedy, dtype):
    """The interpreter runs a kernel as Python and forgives what Triton's compiler does not (a
    name bound only in a branch the compiler also builds failed the greedy picker on the
    GPU): ``sample_pairs``' kernels compiled for sm_90 down to a cubin, greedy and sampling,
    for bf16 and float32 logits, without spilling to local memory."""
    from triton.compiler import ASTSource

    from engines.builtin import sample_kernels as sk
    from tests.helpers import compile_for_h200

    consts = {"K_SEED": sk._K_SEED, "K_POS": sk._K_POS, "K_TOK": sk._K_TOK, "MIX1": sk._MIX1, "MIX2": sk._MIX2,
              "CHUNK": sk.PICK_CHUNK, "BLOCK": sk.PICK_BLOCK, "GREEDY": greedy}
    chunk = ASTSource(fn=sk._pick_chunk_kernel, constexprs=consts, signature={
        "LOGITS": f"*{dtype}", "s_l": "i32", "TEMP": f"*{dtype}" if greedy else "*fp32", "SEED": "*i64", "POS": "*i64",
        "PM": "*fp32", "PS": "*fp32", "PK": "*fp64", "PT": "*i64", "PZ": "*fp32", "vocab": "i32", "chunks": "i32",
        **{k: "constexpr" for k in consts}})
    rows = ASTSource(fn=sk._pick_rows_kernel, constexprs={"CHUNKS_P": 32}, signature={
        "PM": "*fp32", "PS": "*fp32", "PK": "*fp64", "PT": "*i64", "PZ": "*fp32", "OUT": "*fp64", "chunks": "i32",
        "CHUNKS_P": "constexpr"})
    for src, options in ((chunk, {"num_warps": sk.PICK_WARPS}), (rows, {"num_warps": 1})):
        kernel = compile_for_h200(src, options)
        assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"]


def test_sampler_takes_one_pass_rows_through_the_kernel_whatever_the_other_rows():
    """Where Triton runs, the sampler's greedy and untruncated rows (seeded or not) take
    ``sample_pairs`` and the others (min_p, top-k, top-p) the torch rules: a one-pass row's
    token and log-prob are the same in a batch of its kind alone and beside torch-rule rows;
    a seeded row draws its (seed, position) token; a min_p-1 row is greedy's token; a top-k 1
    row too. Given a decode graph's bf16 logits, the one-pass rows' kernel reads them as they
    are in both batches (on a GPU, the kernel compiled for float32 input rounds the log-prob
    differently: a row's log-prob changed with its neighbours)."""
    out = _interpret("""
        import torch
        from engines.interface import SamplingParams
        from engines.builtin.sampler import Sampler
        from engines.builtin.sequence import Sequence

        def seq(i, **kw):
            sp = SamplingParams(max_new_tokens=8, **kw)
            gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
            return Sequence(i, [1, 2], sp, None, None, gen, output=[3] * i)

        torch.manual_seed(0)
        sampler = Sampler(None, set())
        logits = torch.randn(6, 5000) * 2
        one = [seq(0, temperature=0.0), seq(1, temperature=0.8, seed=7), seq(2, temperature=1.0)]
        rest = [seq(3, temperature=1.3, min_p=1.0, seed=4), seq(4, temperature=1.0, top_k=1)]
        alone = sampler.sample_batch(logits[:2].clone(), one[:2]).host
        mixed = sampler.sample_batch(torch.cat([logits[:2], logits[3:5], logits[2:3]]), one[:2] + rest + one[2:])
        mixed = mixed.host
        same = bool((alone == mixed[:2]).all())
        argmax = logits[3:5].argmax(-1).double()
        greedy_like = bool((mixed[2:4, 0] == argmax).all())
        import engines.builtin.sampler as sampler_module
        read, kernel = [], sampler_module.sample_pairs
        sampler_module.sample_pairs = lambda x, *a: (read.append(x.dtype), kernel(x, *a))[1]
        half = logits.bfloat16()  # a decode graph's logits: the one-pass rows read them so, beside any rows
        alone = sampler.sample_batch(half[:2].clone(), one[:2]).host
        mixed = sampler.sample_batch(torch.cat([half[:2], half[3:5], half[2:3]]), one[:2] + rest + one[2:]).host
        same_half = bool((alone == mixed[:2]).all()) and read == [torch.bfloat16] * 2
        print(int(same), int(greedy_like), int(0 <= mixed[4, 0].item() < 5000), int(same_half), read)
    """)
    assert out.split("\n")[-2].split()[:4] == ["1", "1", "1", "1"], out


def test_fused_ops_match_the_torch_modules():
    """RMSNorm (alone and with the residual add), q/k RMSNorm + rotary embedding (with and
    without the norm, head dims 16 and 24) and SiLU-and-multiply against the torch code."""
    out = _interpret("""
        import torch
        import torch.nn.functional as F
        from engines.kernels.paged_attention import norm_rope, rms_norm, silu_mul
        from engines.models.model import RMSNorm, _rotate_half
        torch.manual_seed(2)
        worst = 0.0
        norm = RMSNorm(48, 1e-6)
        norm.weight.data = torch.randn(48)
        x, r = torch.randn(5, 48), torch.randn(5, 48)
        worst = max(worst, (rms_norm(x, norm.weight, 1e-6) - norm(x)).abs().max().item())
        y, s = rms_norm(x, norm.weight, 1e-6, residual=r)
        worst = max(worst, (s - (x + r)).abs().max().item(), (y - norm(x + r)).abs().max().item())
        for d in (16, 24):
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
            pos = torch.tensor([0, 3, 17, 400])
            q = torch.randn(4, 3, d)
            qn = RMSNorm(d, 1e-6)
            qn.weight.data = torch.randn(d)
            emb = torch.cat([pos.float()[:, None] * inv] * 2, -1)[:, None, :]
            for w, ref_in in ((qn.weight, qn(q)), (None, q)):
                ref = ref_in * emb.cos() + _rotate_half(ref_in) * emb.sin()
                worst = max(worst, (norm_rope(q, w, pos, inv, 1e-6) - ref).abs().max().item())
        g, u = torch.randn(3, 2500), torch.randn(3, 2500)
        worst = max(worst, (silu_mul(g, u) - F.silu(g) * u).abs().max().item())
        print(worst)
    """)
    assert float(out.split()[-1]) < 1e-4


def test_qkv_rope_write_matches_norm_rope_and_the_cache_writes():
    """The fused q/k/v kernel of a decode step (engines/models/fused_decode.py) against the separate
    kernels and cache writes it replaces: queries as ``norm_rope``, each token's k (normed,
    rotated) and v in its cache slot, every other slot untouched; with and without q/k norm,
    GQA groups 2 and 3, head dims 16 and 24."""
    out = _interpret("""
        import torch
        from engines.models.fused_decode import qkv_rope_write
        from engines.kernels.paged_attention import norm_rope
        torch.manual_seed(4)
        worst, untouched = 0.0, True
        for h, kvh, d, norm in [(4, 2, 16, True), (6, 2, 24, False), (3, 1, 16, True)]:
            b, blocks, page = 5, 6, 4
            qkv = torch.randn(b, (h + 2 * kvh) * d)
            qn, kn = (torch.randn(d), torch.randn(d)) if norm else (None, None)
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
            pos = torch.tensor([0, 5, 9, 200, 3])
            slots = torch.tensor([7, 2, 19, 12, 0])
            kc, vc = torch.randn(blocks, page, kvh, d), torch.randn(blocks, page, kvh, d)
            k0, v0 = kc.clone(), vc.clone()
            q = qkv_rope_write(qkv, qn, kn, pos, inv, slots, kc, vc, h, kvh, 1e-6)
            qs, ks, vs = qkv.split([h * d, kvh * d, kvh * d], dim=1)
            worst = max(worst, (q - norm_rope(qs.reshape(b, h, d), qn, pos, inv, 1e-6)).abs().max().item())
            k = norm_rope(ks.reshape(b, kvh, d), kn, pos, inv, 1e-6)
            worst = max(worst, (kc.view(-1, kvh, d)[slots] - k).abs().max().item())
            worst = max(worst, (vc.view(-1, kvh, d)[slots] - vs.reshape(b, kvh, d)).abs().max().item())
            rest = torch.ones(blocks * page, dtype=torch.bool)
            rest[slots] = False
            untouched &= bool((kc.view(-1, kvh, d)[rest] == k0.view(-1, kvh, d)[rest]).all())
            untouched &= bool((vc.view(-1, kvh, d)[rest] == v0.view(-1, kvh, d)[rest]).all())
        print(worst, untouched)
    """)
    worst, untouched = out.split()[-2:]
    assert float(worst) < 1e-5 and untouched == "True"


def test_under_the_interpreter_a_launch_patches_the_language_once_not_once_a_helper_call():
    """engines/kernels/triton_interpreter.py: Triton's interpreter re-patched triton.language at every
    @triton.jit helper call (normed_rotated, tl.sum: per program), a fifth of an interpreted
    decode step. Counted through Triton's own patch function: a qkv_rope launch of 5 x 6
    programs (each calling helpers) patches at most twice (the launch, tl.core for tl.sum's
    first call), the launch's patch is undone after it, and the queries still equal norm_rope's
    (the full check: test_qkv_rope_write_matches_norm_rope_and_the_cache_writes)."""
    out = _interpret("""
        import torch
        import triton.language as tl
        from triton.runtime import interpreter
        calls = []
        triton_patch = interpreter._patch_lang
        interpreter._patch_lang = lambda fn: calls.append(fn.__name__) or triton_patch(fn)
        from engines.models.fused_decode import qkv_rope_write  # installs the skip over the counting patch
        from engines.kernels.paged_attention import norm_rope
        torch.manual_seed(4)
        b, h, kvh, d = 5, 4, 2, 16
        qkv = torch.randn(b, (h + 2 * kvh) * d)
        qn, kn = torch.randn(d), torch.randn(d)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        pos, slots = torch.tensor([0, 5, 9, 200, 3]), torch.tensor([7, 2, 19, 12, 0])
        kc, vc = torch.zeros(6, 4, kvh, d), torch.zeros(6, 4, kvh, d)
        for launch in range(2):
            calls.clear()
            q = qkv_rope_write(qkv, qn, kn, pos, inv, slots, kc, vc, h, kvh, 1e-6)
            print(len(calls), ",".join(calls), tl.core.is_builtin(tl.program_id))
        print((q - norm_rope(qkv[:, :h * d].reshape(b, h, d), qn, pos, inv, 1e-6)).abs().max().item())
    """)
    *launches, worst = out.strip().splitlines()
    for line in launches:
        count, names, undone = line.split()
        assert 1 <= int(count) <= 2 and names.startswith("_qkv_rope_kernel") and undone == "True", line
    assert float(worst) < 1e-5


def test_fused_prefill_matches_the_torch_prefill(tmp_path):
    """The prefill through the decode step's kernels (engines/models/fused_decode.py
    ``prefill_fused``: RMSNorm with the residual sum, one q/k/v GEMM, ``qkv_rope_write``,
    grouped-query attention unexpanded, silu_mul) gives the torch prefill's last-token logits
    and writes the same K and V into every real token's slot, for right-padded prompts of
    three lengths, with q/k norms (qwen3), q/k/v biases (qwen2), neither (llama) and MoE layers
    (qwen3_moe)."""
    out = _interpret(f"""
        import asyncio, os, torch
        from engines.builtin import TorchEngine
        from engines.models import fused_decode
        from engines.models.model_builder import make_model
        torch.manual_seed(0)
        for arch in ("qwen3", "qwen2", "llama", "qwen3_moe"):
            eng = TorchEngine(make_model(arch, "tiny", {str(tmp_path)!r} + "/" + arch, seed=3), kv_cache_tokens=1024,
                              block_size=8)
            model, runner = eng.runner.model, eng.runner
            ids, lens = torch.randint(5, 90, (3, 21)), torch.tensor([21, 13, 7])
            scratch = runner.blocks.scratch_block * 8
            slots = torch.randperm(scratch)[:63].view(3, 21)
            slots[1, 13:] = slots[2, 7:] = scratch  # padding
            caches = [(torch.zeros_like(runner.k), torch.zeros_like(runner.v)) for _ in range(2)]
            os.environ["TRITON_INTERPRET"] = "0"  # the torch prefill (triton_usable reads it per call)
            ref = model.prefill(ids, lens, slots, *caches[0])
            os.environ["TRITON_INTERPRET"] = "1"
            fused = model.prefill(ids, lens, slots, *caches[1])
            real = slots[slots != scratch]
            kv = lambda c: c.view(c.shape[0], -1, *c.shape[3:])[:, real]
            gap = max((fused - ref).abs().max().item(), *((kv(a) - kv(b)).abs().max().item()
                                                          for a, b in zip(caches[0], caches[1])))
            print(arch, int(fused_decode.prefill_fits(model)), model.cfg.num_heads // model.cfg.num_kv_heads, gap,
                  ref.abs().max().item())
            asyncio.run(eng.close())
    """)
    rows = [line.split() for line in out.strip().splitlines()[-4:]]
    assert [r[0] for r in rows] == ["qwen3", "qwen2", "llama", "qwen3_moe"], out
    for arch, fits, groups, gap, scale in rows:
        assert fits == "1" and int(groups) > 1, (arch, fits, groups)  # the fused path ran, with GQA
        assert float(gap) < 1e-5 and float(scale) > 0.1, (arch, gap, scale)


def test_packed_projections_follow_loads_updates_and_sleep(tmp_path):
    """Each layer's q/k/v and gate/up parameters are views of one packed tensor (what the
    fused decode step multiplies by): equal to the parameters after loading, after a weight
    update of one of them, released with them by a discarding sleep, packed again on wake
    and equal to the parameters once a full update refills them."""
    import asyncio

    import torch

    from engines.builtin import TorchEngine
    from engines.models.model_builder import make_model

    path = make_model("qwen2", "tiny", str(tmp_path / "m"), seed=1)  # q/k/v biases too

    def check(model) -> None:
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            assert torch.equal(a.qkv_weight, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            assert torch.equal(a.qkv_bias, torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            assert torch.equal(m.gate_up_weight, torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            assert a.k_proj.weight.untyped_storage().data_ptr() == a.qkv_weight.untyped_storage().data_ptr()

    async def main():
        eng = TorchEngine(path, kv_cache_tokens=256)
        model = eng.runner.model
        check(model)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        new_k = torch.randn_like(full["model.layers.1.self_attn.k_proj.weight"])
        await eng.update_weights([{"model.layers.1.self_attn.k_proj.weight": new_k}], 1)
        check(model)
        a = model.model.layers[1].self_attn
        assert torch.equal(a.qkv_weight[a.q_proj.weight.shape[0]:][: new_k.shape[0]], new_k)
        await eng.sleep()
        assert model.model.layers[0].self_attn.qkv_weight is None and model.model.layers[0].mlp.gate_up_weight is None
        await eng.wake()
        await eng.update_weights([full], 2)
        check(model)
        assert torch.equal(model.model.layers[0].mlp.up_proj.weight, full["model.layers.0.mlp.up_proj.weight"])
        await eng.close()

    asyncio.run(main())


def test_an_uninitialised_cache_never_reaches_the_output(tmp_path):
    """The KV cache is allocated without zeroing: every slot a step reads was written first.
    An engine whose cache is filled with NaN before any request (and again after a sleep
    and wake) gives exactly a fresh engine's greedy tokens and log-probs, on the torch path
    here and through the Triton kernels under the interpreter."""
    code = f"""
        import asyncio, json, torch
        from engines.models.model_builder import make_model
        from engines.builtin import TorchEngine
        path = make_model("qwen3", "tiny", {str(tmp_path / "m")!r}, seed=5)
        prompts = [[5 + (i * 7 + n) % 90 for i in range(n)] for n in (3, 11, 20, 37)]
        greedy = {{"temperature": 0, "max_new_tokens": 9, "ignore_eos": True}}
        async def main(poison):
            eng = TorchEngine(path, kv_cache_tokens=1024, block_size=8, weights_mode="backup")
            out = []
            for _ in range(2):
                if poison:
                    eng.runner.k.fill_(float("nan"))
                    eng.runner.v.fill_(float("nan"))
                res = await asyncio.gather(*(eng.generate(p, greedy) for p in prompts))
                out.append([(r.token_ids, r.logprobs) for r in res])
                await eng.sleep()
                await eng.wake()
            await eng.close()
            return out
        print(json.dumps([asyncio.run(main(False)), asyncio.run(main(True))]))
    """
    import json

    for interpret in (False, True):
        out = _interpret(code) if interpret else subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT)).stdout
        clean, poisoned = json.loads(out.strip().splitlines()[-1])
        assert clean == poisoned
        assert clean[0] == clean[1] and len(clean[0][0][0]) == 9


def test_a_padded_graph_batch_runs_the_attention_as_the_eager_batch_does():
    """A decode batch of n rows replays the CUDA graph of ``bucket(n)`` rows, whose padding
    rows are ignored: the attention's splits and launch configuration (tile, warps, stages:
    they set the order of the online softmax's sums, hence its rounding) depend on the
    batch only through the next power of two, so the graph's rows round as an eager batch of
    the same rows does (the graph-vs-eager GPU test compares them exactly)."""
    import torch

    from engines.builtin.model_runner import BUCKETS, bucket
    from engines.kernels.paged_attention import decode_config, decode_splits

    cpu = torch.device("cpu")  # 4 "SMs": both configurations occur below 256 rows
    seen = set()
    for kv_heads in (1, 2, 8):
        for n in range(1, BUCKETS[-1] + 1):
            for span in (256, 8192):
                assert decode_splits(n, kv_heads, cpu, span) == decode_splits(bucket(n), kv_heads, cpu, span), (n, span)
            assert decode_config(n, kv_heads, cpu) == decode_config(bucket(n), kv_heads, cpu), (n, kv_heads)
            seen.add(decode_config(n, kv_heads, cpu))
    assert len(seen) == 2, seen


def test_programmatic_dependent_launch_only_on_hopper_with_gdc_and_not_when_turned_off(monkeypatch):
    """``pdl_enabled``: CUDA of compute capability 9+ whose Triton has ``gdc_wait``; never on
    the CPU (the interpreter) or an Ampere; ``RELAY_DECODE_PDL=0`` turns it off; ``pdl_launch``
    then asks for ``launch_pdl`` only where it is on."""
    import torch

    from engines.kernels import paged_attention as pa

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("RELAY_DECODE_PDL", raising=False)
    monkeypatch.setattr(pa, "_triton_has_gdc", lambda: True)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    assert pa.pdl_enabled(cuda) and pa.pdl_launch(cuda) == {"PDL": True, "launch_pdl": True}
    assert not pa.pdl_enabled(cpu) and pa.pdl_launch(cpu) == {"PDL": False}
    capability[0] = (8, 0)
    assert not pa.pdl_enabled(cuda)
    capability[0] = (10, 0)
    assert pa.pdl_enabled(cuda)
    monkeypatch.setenv("RELAY_DECODE_PDL", "0")
    assert not pa.pdl_enabled(cuda) and pa.pdl_launch(cuda) == {"PDL": False}
    monkeypatch.delenv("RELAY_DECODE_PDL")
    monkeypatch.setattr(pa, "_triton_has_gdc", lambda: False)  # an older Triton
    assert not pa.pdl_enabled(cuda)
