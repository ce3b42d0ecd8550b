"""The tensors of an HF checkpoint directory as the built-in engine loads them, block-FP8
weights dequantized.

Large judges ship block-quantized FP8 (DeepSeek-V3 / Qwen3 "FP8" checkpoints): their
``config.json`` says ``quantization_config: {"quant_method": "fp8", "weight_block_size":
[bo, bi], ...}``, each quantized linear weight ``W`` [out, in] is stored as float8 (e4m3)
beside ``W_scale_inv`` [ceil(out/bo), ceil(in/bi)] (float32), and its value is the float8
number times its block's scale. :func:`checkpoint_tensors` yields every weight dequantized
(float32; the engine then casts to its dtype) and never the scales, so a block-FP8
checkpoint loads as its dequantized twin does. :func:`quantize_fp8` writes such a
checkpoint from a full-precision one (tests, ``relay make-model --fp8-block N``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = 448.0  # the largest finite e4m3 value


def fp8_block(config: dict) -> tuple[int, int] | None:
    """``(bo, bi)`` of a block-FP8 checkpoint's ``config.json`` (a VL checkpoint's outer
    config included), else None. Raises ValueError for an FP8 scheme this loader does not
    read (per-tensor or per-channel scales)."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q or q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"quantization_config {q!r}: only block-wise FP8 (weight_block_size [bo, bi]) is read by "
                         "the built-in engine; use --engine sglang for other FP8 schemes")
    return int(block[0]), int(block[1])


def dequantize_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 ``weight`` (float8 [out, in]) times its blocks' ``scale`` [ceil(out/bo), ceil(in/bi)]."""
    bo, bi = block
    out, inp = weight.shape
    rows, cols = -(-out // bo), -(-inp // bi)
    if tuple(scale.shape) != (rows, cols):
        raise ValueError(f"a {out}x{inp} weight in {bo}x{bi} blocks needs {rows}x{cols} scales, not "
                         f"{tuple(scale.shape)}")
    full = scale.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return weight.float() * full


def checkpoint_tensors(path: str) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(file, name, tensor)`` for every tensor of the ``*.safetensors`` files of ``path``,
    FP8 weights dequantized with their block scales (the scales themselves not yielded).
    Raises FileNotFoundError without safetensors files, KeyError for an FP8 weight without
    its scale."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    with open(os.path.join(path, "config.json")) as f:
        block = fp8_block(json.load(f))
    where = {}  # a scale's name -> its file (a weight and its scale may sit in different shards)
    if block is not None:
        for name in files:
            with safe_open(os.path.join(path, name), "pt") as h:
                where.update((k, name) for k in h.keys() if k.endswith(SCALE_SUFFIX))
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as h:
            for key in h.keys():
                if block is not None and key.endswith(SCALE_SUFFIX):
                    continue
                tensor = h.get_tensor(key)
                if tensor.dtype in FP8_DTYPES:
                    scale_name = key + SCALE_SUFFIX
                    if block is None or scale_name not in where:
                        raise KeyError(f"{path}/{name}: {key} is FP8 but {scale_name} is not in the checkpoint (or "
                                       "config.json has no block-FP8 quantization_config)")
                    with safe_open(os.path.join(path, where[scale_name]), "pt") as s:
                        tensor = dequantize_block(tensor, s.get_tensor(scale_name), block)
                yield name, key, tensor


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    """Whether a real FP8 checkpoint quantizes this tensor: the 2-D projection weights of
    attention and MLPs (experts included); not embeddings, norms, the LM head or a router."""
    return tensor.dim() == 2 and name.endswith("proj.weight")


def quantize_fp8(src: str, dst: str, block: tuple[int, int] = (128, 128)) -> str:
    """Write ``dst``: the checkpoint ``src`` with its projection weights block-quantized to
    FP8 e4m3 (per-block scale = the block's largest magnitude / 448), ``config.json``'s
    ``quantization_config`` saying so, tokenizer and other files copied. Returns ``dst``."""
    from safetensors.torch import save_file

    bo, bi = block
    os.makedirs(dst, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for _, name, tensor in checkpoint_tensors(src):
        if not quantizable(name, tensor):
            out[name] = tensor.contiguous()
            continue
        w = tensor.float()
        rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
        padded = torch.zeros(rows * bo, cols * bi)
        padded[: w.shape[0], : w.shape[1]] = w
        amax = padded.view(rows, bo, cols, bi).abs().amax(dim=(1, 3)).clamp(min=1e-12)
        scale = amax / FP8_MAX
        q = (padded.view(rows, bo, cols, bi) / scale[:, None, :, None]).view(rows * bo, cols * bi)
        out[name] = q[: w.shape[0], : w.shape[1]].to(torch.float8_e4m3fn).contiguous()
        out[name + SCALE_SUFFIX] = scale.contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"))
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and f != "model.safetensors.index.json" and os.path.isfile(
                os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [bo, bi]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst
