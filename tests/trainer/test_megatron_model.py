"""Megatron-core GPTModel built from HF configs: weights round-trip bit-exactly and the
logits equal transformers' (fp32, CPU/gloo, TP=1)."""

from __future__ import annotations

import pytest

from engines.models.model_builder import make_model
from relay import setup_torch_distributed, this_host
from tests.helpers import run
from tests.trainer.actors import MegatronCheck

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_hf_megatron_hf_roundtrip_and_logits(tmp_path):
    paths = {arch: make_model(arch, "tiny", str(tmp_path / arch), seed=4) for arch in ("qwen3", "qwen2", "llama")}

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        check = procs.spawn("megatron", MegatronCheck)
        out = {arch: await check.hf_roundtrip_and_logits.call_one(p).result(240) for arch, p in paths.items()}
        await procs.stop()
        return out

    for arch, r in run(main(), 280).items():
        assert r["missing"] == [] and r["unexpected"] == [], arch
        assert r["exact"], f"{arch}: HF -> Megatron -> HF is not bit-exact"
        assert r["max_diff"] < 1e-5, (arch, r["max_diff"])


def test_the_fused_ops_train_exactly_as_megatrons_unfused_code_where_no_kernel_runs(tmp_path):
    """On CPU the fused RoPE, SwiGLU and RMSNorm run torch's ops under autograd: the logits
    and every gradient of a padded and a packed batch are megatron-core's own, bit for bit
    (a CPU run trains exactly as before the fusions)."""
    path = make_model("qwen3", "tiny", str(tmp_path / "m"), seed=5)

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(procs)
        check = procs.spawn("megatron", MegatronCheck)
        out = await check.fused_ops_parity.call_one(path).result(240)
        await procs.stop()
        return out

    r = run(main(), 280)
    assert r["logits"] and r["packed"] and r["grads"], r
    assert r["unequal_grads"] == [], r
