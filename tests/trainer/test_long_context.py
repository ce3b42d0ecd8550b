"""Trainer memory at real lengths: torch's fused attention in Megatron's core-attention slot
and log-probs from logits in chunks give what Megatron's own attention and whole logits give
(fp32, 1e-5), forward and backward, dense, grouped-query and mixture-of-experts models."""

from __future__ import annotations

import pytest

from engines.models.model_builder import make_model
from relay import setup_torch_distributed, this_host
from tests.helpers import run
from tests.trainer.actors import LongContextCheck

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


RECOMPUTE = {"full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
             "selective": {"recompute_granularity": "selective"}, None: None}


@pytest.mark.parametrize("arch,recompute", [("qwen3", None), ("qwen3_moe", None), ("qwen3", "full"),
                                            ("qwen3_moe", "selective")])
def test_fused_attention_and_chunked_logprobs_equal_megatrons_attention_and_whole_logits(tmp_path, arch, recompute):
    """With activation recompute (Megatron's full or selective) too: the same gradients."""
    path = make_model(arch, "tiny", str(tmp_path / arch), seed=3)

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        check = procs.spawn("long", LongContextCheck)
        try:
            return await check.parity.call_one(path, recompute=RECOMPUTE[recompute]).result(240)
        finally:
            await procs.stop()

    r = run(main(), 280)
    assert r["same_grads"] and r["grads"] > 10, r
    assert r["logp"] < 1e-5 and r["entropy"] < 1e-5 and r["grad"] < 1e-5, r
