"""The few-rows projection kernel (engines/kernels/skinny_gemm.py) and the decode step built on it
(engines/models/fused_decode.py ``_decode_few_rows``), under Triton's interpreter on CPU."""

from __future__ import annotations

import pytest

from tests.engines.test_decode_kernel import _interpret

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
pytest.importorskip("triton", reason="Triton is a dev dependency (pyproject [dev]); it runs under its interpreter here")


def test_skinny_linear_matches_torch_with_each_prologue():
    """Plain, with a bias, RMSNorm of x, RMSNorm of x + residual (the sum returned) and
    silu(gate) * up, for 1-8 rows, weights whose rows and columns are not multiples of the
    tiles, and tiles that take several passes over K."""
    out = _interpret("""
        import torch
        import torch.nn.functional as F
        from engines.kernels.paged_attention import rms_norm, silu_mul
        from engines.kernels.skinny_gemm import skinny_linear
        torch.manual_seed(0)
        worst, sums = 0.0, 0.0
        for rows, n, k, block in [(1, 37, 48, None), (3, 64, 80, (2, 16, 4)), (8, 19, 33, (4, 32, 4)),
                                  (5, 130, 128, (16, 64, 4))]:
            x, r, nw = torch.randn(rows, k), torch.randn(rows, k), torch.randn(k)
            w, bias = torch.randn(n, k), torch.randn(n)
            worst = max(worst, (skinny_linear(x, w, block=block) - x @ w.T).abs().max().item())
            worst = max(worst, (skinny_linear(x, w, bias, block=block) - F.linear(x, w, bias)).abs().max().item())
            y = skinny_linear(x, w, norm_weight=nw, eps=1e-6, block=block)
            worst = max(worst, (y - rms_norm(x, nw, 1e-6) @ w.T).abs().max().item())
            y, s = skinny_linear(x, w, bias, norm_weight=nw, residual=r, eps=1e-6, block=block)
            ref_y, ref_s = rms_norm(x, nw, 1e-6, residual=r)
            worst = max(worst, (y - F.linear(ref_y, w, bias)).abs().max().item())
            sums = max(sums, (s - ref_s).abs().max().item())
            gu = torch.randn(rows, 2 * k)
            y = skinny_linear(gu, w, silu_input=True, block=block)
            worst = max(worst, (y - silu_mul(gu[:, :k], gu[:, k:]) @ w.T).abs().max().item())
        print(worst, sums)
    """)
    worst, sums = map(float, out.split()[-2:])
    assert worst < 1e-3 and sums == 0.0, (worst, sums)


def test_a_rows_output_does_not_depend_on_the_other_rows():
    """Row i of a batch equals that row computed alone, bit for bit (a graph replays a batch
    padded with other rows; an eager step runs it unpadded)."""
    out = _interpret("""
        import torch
        from engines.kernels.skinny_gemm import skinny_linear
        torch.manual_seed(1)
        x, r, nw, w = torch.randn(6, 64), torch.randn(6, 64), torch.randn(64), torch.randn(40, 64)
        batch, _ = skinny_linear(x, w, norm_weight=nw, residual=r, eps=1e-6)
        alone = torch.cat([skinny_linear(x[i:i + 1], w, norm_weight=nw, residual=r[i:i + 1], eps=1e-6)[0]
                           for i in range(6)])
        print(int(torch.equal(batch, alone)))
    """)
    assert out.split()[-1] == "1"


def test_the_few_rows_decode_step_equals_the_fused_one(tmp_path):
    """An engine's model (packed q/k/v and gate/up, q/k/v biases) decodes 3 rows through the
    few-rows step (RMSNorms and SiLU folded into the projections; ``MAX_ROWS`` raised to 3
    for it) to the logits of the fused step with separate kernels and GEMMs; above
    ``MAX_ROWS`` rows it is not used."""
    out = _interpret(f"""
        import torch
        from engines.kernels import skinny_gemm
        from engines.models import fused_decode
        from engines.models.model_builder import make_model
        from engines.builtin import TorchEngine
        eng = TorchEngine(make_model("qwen2", "tiny", {str(tmp_path / "m")!r}, seed=2), kv_cache_tokens=256)
        r, model = eng.runner, eng.runner.model
        r.k.zero_(), r.v.zero_()  # the context slots before each row's own are read too (not written here)
        skinny_gemm.MAX_ROWS = 3
        ids = torch.tensor([5, 17, 40])
        pos = torch.tensor([0, 4, 9])
        tables = torch.arange(3 * 4, dtype=torch.int32).view(3, 4)
        slots = tables[:, 0].long() * r.blocks.block_size + pos
        lens = (pos + 1).to(torch.int32)
        x = model.model.embed_tokens(ids)
        print(int(fused_decode.few_rows(model, x)), int(fused_decode.few_rows(model, x.new_zeros(9, x.shape[1]))))
        with torch.inference_mode():
            few = model.decode(ids, pos, slots, tables, lens, r.k, r.v)
            skinny_gemm.MAX_ROWS = 0
            fused = model.decode(ids, pos, slots, tables, lens, r.k, r.v)
        print((few - fused).abs().max().item(), fused.abs().max().item())
    """)
    used, not_above = map(int, out.split()[-4:-2])
    diff, scale = map(float, out.split()[-2:])
    assert (used, not_above) == (1, 0)
    assert diff < 1e-4 * max(1.0, scale), (diff, scale)
