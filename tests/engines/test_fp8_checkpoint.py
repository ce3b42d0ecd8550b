"""Block-FP8 checkpoints (as large judges ship them): ``relay make-model --fp8-block N``
writes one, and the built-in engine loads it dequantized, answering exactly as its
dequantized full-precision twin does."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engines.builtin import TorchEngine
from engines.models.checkpoint import checkpoint_tensors, fp8_block
from engines.models.model_builder import make_model
from tests.helpers import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
BLOCK = 24  # does not divide the tiny model's 64/128/32-wide projections: edge blocks are partial
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[5 + (i * 7 + n) % 90 for i in range(n)] for n in (3, 9, 17, 30)]


def _raw(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as h:
                out.update((k, h.get_tensor(k)) for k in h.keys())
    return out


def _dequantized_by_hand(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each BLOCK x BLOCK tile times its own scale, tile by tile."""
    out = torch.empty(weight.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = weight[rows, cols].float() * scale[i, j]
    return out


def _build(root, arch: str) -> dict[str, str]:
    """``relay make-model --arch ARCH --fp8-block 24``, its full-precision original and its
    twin (the FP8 checkpoint dequantized by hand, in float32)."""
    full = make_model(arch, "tiny", str(root / f"{arch}-full"), seed=3)
    fp8 = str(root / f"{arch}-fp8")
    p = subprocess.run([RELAY, "make-model", "--arch", arch, "--size", "tiny", "--seed", "3", "--fp8-block",
                        str(BLOCK), "--out", fp8], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "block-FP8 (24x24 blocks)" in p.stdout
    twin = str(root / f"{arch}-twin")
    os.makedirs(twin)
    raw = _raw(fp8)
    save_file({k: (_dequantized_by_hand(v, raw[k + "_scale_inv"]) if v.dtype == torch.float8_e4m3fn else v)
               for k, v in raw.items() if not k.endswith("_scale_inv")}, os.path.join(twin, "model.safetensors"))
    for f in os.listdir(fp8):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(fp8, f), os.path.join(twin, f))
    with open(os.path.join(twin, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(twin, "config.json"), "w") as f:
        json.dump(config, f)
    return {"full": full, "fp8": fp8, "twin": twin}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("fp8"), "qwen3")


async def _answers(path):
    eng = TorchEngine(path, kv_cache_tokens=4096)
    res = await asyncio.gather(*(eng.generate(p, GREEDY) for p in PROMPTS))
    await eng.close()
    return res


def test_the_checkpoint_is_block_fp8_as_real_ones_are(checkpoints):
    raw = _raw(checkpoints["fp8"])
    with open(os.path.join(checkpoints["fp8"], "config.json")) as f:
        assert fp8_block(json.load(f)) == (BLOCK, BLOCK)
    q = raw["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (64, 64)
    assert tuple(raw["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape) == (3, 3)
    assert tuple(raw["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == (3, 6)  # [64, 128]
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert raw[name].dtype == torch.float32 and name + "_scale_inv" not in raw
    # the quantization error is that of 3 mantissa bits, not garbage
    full = _raw(checkpoints["full"])["model.layers.0.mlp.up_proj.weight"]
    deq = dict((n, t) for _, n, t in checkpoint_tensors(checkpoints["fp8"]))["model.layers.0.mlp.up_proj.weight"]
    assert (deq - full).abs().max() <= 0.07 * full.abs().max() and not torch.equal(deq, full)


def test_the_engine_answers_as_the_dequantized_twin(checkpoints):
    fp8, twin = run(_answers(checkpoints["fp8"])), run(_answers(checkpoints["twin"]))
    for a, b in zip(fp8, twin):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bit for bit


def test_an_fp8_mixture_of_experts_checkpoint_answers_as_its_twin(tmp_path):
    """Each expert's projections quantized block by block (the router stays full precision)."""
    built = _build(tmp_path, "qwen3_moe")
    raw = _raw(built["fp8"])
    assert raw["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert raw["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    fp8, twin = run(_answers(built["fp8"])), run(_answers(built["twin"]))
    for a, b in zip(fp8, twin):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_an_fp8_weight_without_its_scale_is_refused_by_name(checkpoints, tmp_path):
    broken = str(tmp_path / "broken")
    shutil.copytree(checkpoints["fp8"], broken)
    raw = _raw(broken)
    del raw["model.layers.1.mlp.gate_proj.weight_scale_inv"]
    save_file(raw, os.path.join(broken, "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.1.mlp.gate_proj.weight is FP8 but "
                                       "model.layers.1.mlp.gate_proj.weight_scale_inv is not in the checkpoint"):
        list(checkpoint_tensors(broken))
