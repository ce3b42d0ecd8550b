"""GPU checks of Qwen3.5's linear-attention kernels (decode and prefill) and the hybrid decode step's CUDA
graphs (marker ``gpu``: run on the H200 machine, not in CI; passed there 2026-12-02): the
kernels at Qwen3.5-35B-A3B's layer shape against the reference, and a tiny
qwen3_5_moe through the graph-decoding engine against eager decoding and transformers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from engines.builtin import TorchEngine
from engines.models.linear_attention import GatedDeltaNet
from tests.engines.test_qwen35 import GREEDY, hf_greedy, hf_model, hybrid_model
from tests.helpers import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernels_match_the_reference_at_35b_a3b_layer_shape(dtype):
    """16 key heads, 32 value heads, head dims 128, conv kernel 4; 64 sequences on scattered
    rows of a 300-row pool, four steps: conv states exactly, recurrent states (float32) and
    outputs within float32 or bf16 tolerances of the reference."""
    torch.manual_seed(0)
    cfg = SimpleNamespace(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
                          linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel=4,
                          rms_norm_eps=1e-6)
    m = GatedDeltaNet(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.02 if p.dim() > 1 else torch.randn_like(p) * 0.3)
    m = m.to("cuda", dtype).eval()
    conv = torch.randn(300, 2 * 16 * 128 + 32 * 128, 3, device="cuda").to(dtype)
    rec = torch.randn(300, 32, 128, 128, device="cuda") * 0.1
    c2, r2 = conv.clone(), rec.clone()
    rows = torch.randperm(300, device="cuda")[:64]
    worst_out = worst_state = 0.0
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(64, 2048, device="cuda").to(dtype)
            out, ref = m.decode(x, conv, rec, rows), m.decode_reference(x, c2, r2, rows)
            worst_out = max(worst_out, ((out.float() - ref.float()).abs() / (ref.float().abs() + 0.1)).max().item())
            worst_state = max(worst_state, (rec - r2).abs().max().item())
    assert (conv == c2).all()
    # bf16: a conv output one rounding apart (sums in another order) moves q, k or v by 2 ** -8
    assert worst_state <= (1e-4 if dtype == torch.float32 else 1e-2), worst_state
    assert worst_out <= (1e-4 if dtype == torch.float32 else 2e-2), worst_out


def test_graph_decode_equals_eager_decode_and_transformers(tmp_path):
    """fp32: four prompts (batch 4, no padding) give exactly the eager step's tokens and
    log-probs through the captured graph; three prompts (padded to 4: the padding row) give
    transformers' greedy tokens."""
    path = hybrid_model(str(tmp_path / "m"), 1)
    prompts = [[5 + (i * 7 + n) % 90 for i in range(n)] for n in (2, 5, 17, 70)]

    async def main(graph, batch):
        eng = TorchEngine(path, device="cuda", dtype="float32", kv_cache_tokens=4096, cuda_graph=graph)
        try:
            res = await asyncio.gather(*(eng.generate(p, GREEDY) for p in batch))
            return res, (await eng.stats())["cuda_graphs"]
        finally:
            await eng.close()

    eager, none = run(main(False, prompts), 300)
    graphed, held = run(main(True, prompts), 300)
    assert none == [] and held == [4]
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert [r.logprobs for r in graphed] == [r.logprobs for r in eager]
    padded, held = run(main(True, prompts[:3]), 300)
    assert held == [4]
    hf = hf_model(path)
    assert [r.token_ids for r in padded] == [hf_greedy(hf, p, GREEDY["max_new_tokens"]) for p in prompts[:3]]
