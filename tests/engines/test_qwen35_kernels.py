"""The Triton kernels of a Gated DeltaNet layer's decode step (engines/kernels/linear_kernels.py)
against the torch reference (engines/models/linear_attention.py), under Triton's interpreter on CPU
(``TRITON_INTERPRET=1`` must be set before Triton loads, so each check runs in a fresh
interpreter): the chunked prefill rule; the conv1d state update and the one-token gated delta rule for several shapes
(key heads fewer than value heads, head dims not powers of two, conv kernels 3 and 4), state
rows out of order and carried over several steps, a row repeated in a batch (the padding
row), bf16 inputs on a float32 state; a tiny qwen3_5_moe model decoding through the
kernel path with the reference path's logits, and TorchEngine generating transformers'
greedy tokens through it. Then, without the interpreter, both kernels compiled for sm_90."""

from __future__ import annotations

import json

import pytest
import torch

from tests.engines.test_decode_kernel import _interpret
from tests.engines.test_qwen35 import GREEDY, PROMPTS, Harness, engine_model, hf_greedy, hf_model, hybrid_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
triton = pytest.importorskip(
    "triton", reason="Triton is a dev dependency (pyproject [dev]); the kernels run under its interpreter here"
)

#: what both interpreter checks set up: a random layer of the given shape and dtype, a pool
LAYER = """
    import torch
    from types import SimpleNamespace
    from engines.models.linear_attention import GatedDeltaNet, recurrent_step
    from engines.kernels.linear_kernels import conv_decode, recurrent_decode

    def layer(hk, hv, dk, dv, kernel, dtype, hidden=32):
        cfg = SimpleNamespace(hidden_size=hidden, linear_num_key_heads=hk, linear_num_value_heads=hv,
                              linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel=kernel,
                              rms_norm_eps=1e-6)
        m = GatedDeltaNet(cfg)
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn_like(p) * 0.3)
        return m.to(dtype).eval()

    def pool(m, n, dtype):
        c = 2 * m.hk * m.dk + m.hv * m.dv
        return torch.randn(n, c, m.kernel - 1).to(dtype), torch.randn(n, m.hv, m.dk, m.dv)

    def conv_ref(m, mixed, conv, rows):  # GatedDeltaNet.decode_reference's conv update
        window = torch.cat([conv.index_select(0, rows), mixed[:, :, None].to(conv.dtype)], dim=2)
        conv.index_copy_(0, rows, window[:, :, 1:])
        return torch.nn.functional.silu((window.to(mixed.dtype) * m.conv1d.weight[:, 0]).sum(-1))

    def rec_ref(m, mixed, x, rec, rows):  # ... and its recurrence
        q, k, v, beta, g = m._heads(mixed, x)
        o, state = recurrent_step(q, k, v, beta, g, rec.index_select(0, rows).float())
        rec.index_copy_(0, rows, state)
        return o

    def gap(a, b):
        return (a.float() - b.float()).abs().max().item()
"""

SHAPES = "[(2, 2, 16, 16, 4), (2, 4, 16, 24, 4), (1, 3, 24, 8, 3), (4, 8, 32, 64, 4), (2, 6, 128, 128, 4)]"


def test_kernels_equal_the_reference_in_float32():
    """Each kernel alone and the layer's whole decode step against the reference, three
    steps on the same (out-of-order) rows, for every shape: within 1e-5."""
    out = _interpret(LAYER + f"""
    torch.manual_seed(0)
    worst = 0.0
    with torch.no_grad():
        for hk, hv, dk, dv, kernel in {SHAPES}:
            m = layer(hk, hv, dk, dv, kernel, torch.float32)
            conv, rec = pool(m, 9, torch.float32)
            rows = torch.tensor([6, 1, 8, 3])
            states = [(conv.clone(), rec.clone()) for _ in range(4)]
            for step in range(3):
                x = torch.randn(4, 32)
                mixed = m.in_proj_qkv(x)
                (c1, r1), (c2, r2), (c3, r3), (c4, r4) = states
                got, want = conv_decode(mixed, c1, m.conv1d.weight, rows), conv_ref(m, mixed, c2, rows)
                worst = max(worst, gap(got, want), gap(c1, c2))
                o = recurrent_decode(want, m.in_proj_a(x), m.in_proj_b(x), m.A_log, m.dt_bias, r1, rows, hk, dk)
                worst = max(worst, gap(o, rec_ref(m, want, x, r2, rows)), gap(r1, r2))
                worst = max(worst, gap(m.decode(x, c3, r3, rows), m.decode_reference(x, c4, r4, rows)))
                worst = max(worst, gap(c3, c4), gap(r3, r4))
            untouched = torch.tensor([0, 2, 4, 5, 7])
            assert gap(r1[untouched], rec[untouched]) == 0 and gap(c3[untouched], conv[untouched]) == 0
    print(worst)
    """)
    assert float(out.split()[-1]) <= 1e-5


def test_bf16_inputs_on_a_float32_state_and_a_repeated_padding_row():
    """bf16 activations and weights with the pool's float32 recurrent state: the recurrence
    from the same conv output keeps the state within 1e-5 and its bf16 output within a bf16
    rounding; the conv output and the whole step within bf16 tolerances. A batch whose last
    three rows all name the padding row leaves the other rows exact and gives finite numbers."""
    out = _interpret(LAYER + f"""
    torch.manual_seed(1)
    state_gap, rel = 0.0, 0.0
    def rgap(a, b):
        return ((a.float() - b.float()).abs() / (b.float().abs() + 0.1)).max().item()
    with torch.no_grad():
        for hk, hv, dk, dv, kernel in {SHAPES}:
            m = layer(hk, hv, dk, dv, kernel, torch.bfloat16)
            conv, rec = pool(m, 9, torch.bfloat16)
            rows = torch.tensor([2, 7, 0])
            (c1, r1), (c2, r2), (c3, r3), (c4, r4) = [(conv.clone(), rec.clone()) for _ in range(4)]
            for step in range(3):
                x = torch.randn(3, 32).to(torch.bfloat16)
                mixed = m.in_proj_qkv(x)
                got, want = conv_decode(mixed, c1, m.conv1d.weight, rows), conv_ref(m, mixed, c2, rows)
                assert got.dtype == torch.bfloat16 and gap(c1, c2) == 0
                rel = max(rel, rgap(got, want))
                o = recurrent_decode(want, m.in_proj_a(x), m.in_proj_b(x), m.A_log, m.dt_bias, r1, rows, hk, dk)
                assert o.dtype == torch.bfloat16 and r1.dtype == torch.float32
                rel = max(rel, rgap(o, rec_ref(m, want, x, r2, rows)))
                state_gap = max(state_gap, gap(r1, r2))
                rel = max(rel, rgap(m.decode(x, c3, r3, rows), m.decode_reference(x, c4, r4, rows)))
            # a padded batch: rows 5 and 3 real, the padding row 8 three times
            m = layer(hk, hv, dk, dv, kernel, torch.float32)
            conv, rec = pool(m, 9, torch.float32)
            (c1, r1), (c2, r2) = (conv.clone(), rec.clone()), (conv.clone(), rec.clone())
            x = torch.randn(5, 32)
            padded = m.decode(x, c1, r1, torch.tensor([5, 3, 8, 8, 8]))
            real = m.decode_reference(x[:2], c2, r2, torch.tensor([5, 3]))
            assert gap(padded[:2], real) <= 1e-5 and torch.isfinite(padded).all()
            assert gap(r1[:8], r2[:8]) <= 1e-5 and gap(c1[:8], c2[:8]) <= 1e-5
    print(state_gap, rel)
    """)
    state_gap, rel = map(float, out.split()[-2:])
    assert state_gap <= 1e-5
    assert rel <= 1e-2  # a bf16 rounding (2 ** -8) or two: sums taken in another order


def test_a_tiny_qwen3_5_moe_decodes_through_the_kernels_as_the_reference_does(tmp_path):
    """The engine model's prefill and 8 decode steps on out-of-order state rows, every layer
    on its Triton path under the interpreter (linear-attention decode kernels, paged decode
    attention, fused MoE), give this process's reference-path logits within 1e-5."""
    path = hybrid_model(str(tmp_path / "m"), 5)
    steps = 8
    code = f"""
    import json
    from tests.engines.test_qwen35 import PROMPTS, Harness, engine_model
    from engines.kernels.paged_attention import triton_usable
    import torch
    assert triton_usable(torch.device("cpu"))
    h = Harness(engine_model({path!r}), len(PROMPTS))
    seqs = [list(p) for p in PROMPTS]
    out = [h.prefill(seqs, list(range(len(seqs))))]
    for _ in range({steps}):
        for q, t in zip(seqs, out[-1].argmax(-1).tolist()):
            q.append(t)
        out.append(h.decode(seqs))
    print(json.dumps([o.tolist() for o in out]))
    """
    kernel_path = json.loads(_interpret(code).strip().splitlines()[-1])
    h = Harness(engine_model(path), len(PROMPTS))
    seqs = [list(p) for p in PROMPTS]
    ref = [h.prefill(seqs, list(range(len(seqs))))]
    for step in range(steps):
        # the reference follows the kernel path's tokens (equal unless a logit gap flips a greedy pick)
        for q, t in zip(seqs, torch.tensor(kernel_path[step]).argmax(-1).tolist()):
            q.append(t)
        ref.append(h.decode(seqs))
    assert len(ref) == len(kernel_path) == steps + 1
    worst = max((torch.tensor(k) - r).abs().max().item() for k, r in zip(kernel_path, ref))
    assert worst <= 1e-5
    assert max(r.abs().max().item() for r in ref) > 0.5


def test_the_engine_generates_transformers_greedy_tokens_through_the_kernels(tmp_path):
    """Through TorchEngine (the runner's hybrid decode path) under the interpreter: a batch of
    prompts, and three copies of one prompt sharing its prefill (the copies take its state
    row), give transformers' greedy tokens."""
    path = hybrid_model(str(tmp_path / "m"), 6)
    out = _interpret(f"""
        import asyncio, json
        from engines.builtin import TorchEngine
        from tests.engines.test_qwen35 import GREEDY, PROMPTS
        async def main(prompts):
            eng = TorchEngine({path!r}, kv_cache_tokens=2048, block_size=16)
            try:
                return [r.token_ids for r in await asyncio.gather(*(eng.generate(p, GREEDY) for p in prompts))]
            finally:
                await eng.close()
        print(json.dumps([asyncio.run(main(PROMPTS)), asyncio.run(main([PROMPTS[2]] * 3 + [PROMPTS[3]]))]))
    """)
    batch, shared = json.loads(out.strip().splitlines()[-1])
    hf = hf_model(path)
    want = [hf_greedy(hf, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    assert batch == want
    assert shared == [want[2]] * 3 + [want[3]]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_kernels_compile_for_an_h200_without_one(dtype):
    """The interpreter runs kernels as Python and forgives what the compiler does not: the
    decode and prefill kernels compiled through Triton's CUDA backend for sm_90 (H100/H200) at
    35B-A3B's shapes, down to a cubin, without spilling to local memory, within a block's
    shared memory."""
    from triton.compiler import ASTSource

    from engines.kernels import linear_kernels as lk
    from tests.helpers import compile_for_h200

    ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
    conv = ASTSource(fn=lk._conv_decode_kernel, constexprs={"K": 4, "BLOCK_C": 256}, signature={
        "MIX": f"*{dtype}", "CONV": f"*{dtype}", "W": f"*{dtype}", "ROWS": "*i64", "OUT": f"*{dtype}",
        **ints("s_mb", "s_cn", "s_cc", "s_cj", "s_wc", "s_wj", "s_ob", "C"), "K": "constexpr", "BLOCK_C": "constexpr"})
    rec = ASTSource(fn=lk._recurrent_decode_kernel, constexprs={"BK": 128, "BV": 32}, signature={
        **{n: f"*{dtype}" for n in ("MIX", "A", "B", "ALOG", "DTB")}, "REC": "*fp32", "ROWS": "*i64",
        "OUT": f"*{dtype}", **ints("s_mb", "s_ab", "s_bb", "s_rn", "s_rh", "s_rk", "s_ob", "s_oh", "DK", "DV", "GROUP",
                                   "K_OFF", "V_OFF"), "scale": "fp32", "BK": "constexpr", "BV": "constexpr"})
    kernels = [(conv, {}), (rec, {})]
    for src, options in kernels:
        kernel = compile_for_h200(src, options)
        assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"]
        assert kernel.metadata.shared <= 232448  # a Hopper block's shared memory (227 KB)
