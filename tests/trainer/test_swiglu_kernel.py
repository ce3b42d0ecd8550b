"""The fused SwiGLU (engines/kernels/swiglu.py; engines/trainer/fusions.py serves it to Megatron)
equals megatron-core's unfused ``silu(a) * b`` forward to the bit on CPU and its gradient
within one rounding; the Triton kernel (under Triton's interpreter, and on CUDA) equals the
torch reference; a bias goes to Megatron's code; the trainer's MLPs call it."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from engines.kernels import swiglu  # noqa: E402
from engines.trainer import fusions  # noqa: E402
from tests.helpers import under_triton_interpreter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def unfused(x):
    a, b = torch.chunk(x, 2, dim=-1)
    return torch.nn.functional.silu(a) * b


@pytest.fixture(params=["torch", "fused"])
def path(request, monkeypatch):
    """Both paths on CPU: torch's ops (what the trainer runs there) and the custom autograd
    function with the kernel's torch reference inside (what runs around the kernel on CUDA)."""
    if request.param == "fused" and not torch.cuda.is_available():
        monkeypatch.setattr(swiglu, "runs", lambda x: True)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_unfused_code(dtype, path):
    torch.manual_seed(0)
    x = (torch.randn(7, 3, 2 * 40) * 4).to(dtype)
    mine = x.clone().requires_grad_(True)
    theirs = x.double().requires_grad_(True)
    y = swiglu.swiglu(mine)
    assert y.shape == (7, 3, 40) and y.dtype == dtype
    assert torch.equal(y, unfused(x))
    g = torch.randn(7, 3, 40).to(dtype)
    y.backward(g)
    unfused(theirs).backward(g.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # float32 math, rounded once to the dtype
    assert (mine.grad.double() - theirs.grad).abs().max() <= tol * (1 + theirs.grad.abs().max())


def test_odd_width_is_refused_and_a_bias_goes_to_megatron():
    with pytest.raises(ValueError, match="even"):
        swiglu.swiglu(torch.randn(2, 5))
    fusions.install()
    x, bias = torch.randn(4, 8), torch.randn(8)
    assert torch.allclose(fusions.bias_swiglu(x, bias), unfused(x + bias), atol=1e-6)


def test_the_trainers_mlp_calls_the_fused_swiglu(tmp_path, monkeypatch):
    from megatron.core.transformer import mlp

    from engines.models.model import ModelConfig
    from engines.models.model_builder import make_model
    from engines.trainer import cpu_shim
    from engines.trainer.megatron_model import transformer_config

    cpu_shim.install()
    cfg = ModelConfig.from_dir(make_model("qwen3", "tiny", str(tmp_path / "m"), seed=0))
    assert transformer_config(cfg).bias_activation_fusion
    assert mlp.bias_swiglu_impl is fusions.bias_swiglu


KERNEL_CHECK = r"""
import torch
from engines.kernels import swiglu
torch.manual_seed(0)
worst = 0.0
for dtype in (torch.float32, torch.bfloat16):
    x = (torch.randn(5, 2 * 1500) * 3).to(dtype)   # two blocks a row, the second one partly live
    g = torch.randn(5, 1500).to(dtype)
    for grad in (None, g):
        k = swiglu._swiglu(x, grad, use_triton=True)
        r = swiglu._swiglu(x, grad, use_triton=False)
        assert k.shape == r.shape and k.dtype == r.dtype
        step = 2.0 ** (-7 if dtype == torch.bfloat16 else -20) * (1 + float(r.float().abs().max()))
        worst = max(worst, float((k.float() - r.float()).abs().max()) / step)
# no rows (an expert no token was routed to): an empty result, and the kernel still trusted
empty = torch.zeros(0, 2 * 1500)
assert swiglu._swiglu(empty, None, use_triton=True).shape == (0, 1500)
assert swiglu._swiglu(empty, torch.zeros(0, 1500), use_triton=True).shape == (0, 3000)
assert swiglu._KERNEL_OK[0]
print(worst)
"""


def test_triton_kernel_equals_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    assert under_triton_interpreter(KERNEL_CHECK) <= 2.0  # within two rounding steps of the output's scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_equals_the_unfused_code_at_a_real_shape():
    torch.manual_seed(1)
    x = torch.randn(8192, 2 * 3072, device="cuda", dtype=torch.bfloat16) * 3
    y = swiglu.swiglu(x)
    ref = unfused(x)
    assert swiglu._KERNEL_OK[0]
    # bf16: at most one rounding step apart (Triton's exp against CUDA's expf), nearly all equal
    assert ((y.float() - ref.float()).abs() <= 2.0 ** -7 * ref.float().abs() + 1e-30).all()
    assert (y != ref).float().mean() < 0.01
