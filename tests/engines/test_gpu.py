"""GPU checks of the built-in engine (marker ``gpu``: run on the H200 machine, not in CI)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.model_builder import make_model
from engines.torch_engine import TorchEngine
from tests.helpers import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model_06b(tmp_path_factory):
    return make_model("qwen3", "0.6b", str(tmp_path_factory.mktemp("m") / "q06"), seed=0, dtype="bfloat16", init_device="cuda")


@pytest.mark.parametrize("mode", ["backup", "discard"])
def test_sleep_really_releases_gpu_memory(model_06b, mode):
    async def main():
        eng = TorchEngine(model_06b, device="cuda", mem_fraction_static=0.3, weights_mode=mode)
        prompt = list(range(5, 40))
        before = await eng.generate(prompt, {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True})
        held = (await eng.stats())["bytes"]
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
        await eng.close()
        return before, after, held, free_awake, free_asleep

    before, after, held, free_awake, free_asleep = run(main(), 500)
    released = free_asleep - free_awake
    assert released >= 0.95 * (held["weights"] + held["kv_cache"]), (released, held)
    assert after.token_ids == before.token_ids


def test_bf16_output_close_to_transformers(model_06b):
    import transformers

    prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((8, 21, 40, 77))]

    async def main():
        eng = TorchEngine(model_06b, device="cuda", kv_cache_tokens=8192)
        res = await asyncio.gather(*(eng.generate(p, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}) for p in prompts))
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
        diffs.append((ours - ref.gather(1, torch.tensor(r.token_ids, device="cuda")[:, None])[:, 0]).abs().mean().item())
        agree += sum(int(a == b) for a, b in zip(ref.argmax(-1).tolist(), r.token_ids))
        total += len(r.token_ids)
    assert max(diffs) < 0.05, diffs  # bf16: same distribution up to rounding
    assert agree / total >= 0.9, agree / total  # teacher-forced argmax agrees on >= 90% of steps
