"""The fused RMSNorm (engines/kernels/rms_norm.py; engines/trainer/fusions.py puts it in the
trainer's model) equals ``torch.nn.RMSNorm`` to the bit on CPU and its gradients within one
rounding; the Triton kernels (under Triton's interpreter on CPU, and on CUDA) equal the torch
reference; the model's norms become fused ones with the same parameters."""

from __future__ import annotations

import os

import pytest
import torch

from engines.kernels import rms_norm
from tests.helpers import under_triton_interpreter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(params=["torch", "fused"])
def path(request, monkeypatch):
    """Both paths on CPU: torch's own rms_norm (what the trainer runs there) and the custom
    autograd function with the kernels' torch reference inside (what runs around them on CUDA)."""
    if request.param == "fused" and not torch.cuda.is_available():
        monkeypatch.setattr(rms_norm, "runs", lambda x: True)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 2, 40), (33, 4, 16)])  # a hidden row; per-head rows (q/k norms)
def test_equals_torch_rmsnorm(dtype, shape, path):
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm(shape[-1], eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    x = (torch.randn(shape) * 3).to(dtype)
    ours_x, ref_x = x.clone().requires_grad_(True), x.double().requires_grad_(True)
    w = norm.weight.detach().clone().requires_grad_(True)
    y = rms_norm.rms_norm(ours_x, w, 1e-6)
    assert y.dtype == dtype and torch.equal(y, norm(x))
    g = torch.randn(shape).to(dtype)
    y.backward(g)
    ref_w = norm.weight.detach().double().requires_grad_(True)
    torch.nn.functional.rms_norm(ref_x, (shape[-1],), ref_w, 1e-6).backward(g.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # float32 math, rounded once to the dtype
    assert (ours_x.grad.double() - ref_x.grad).abs().max() <= tol * (1 + ref_x.grad.abs().max())
    assert (w.grad.double() - ref_w.grad).abs().max() <= tol * (1 + ref_w.grad.abs().max())


def test_a_weight_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="weight of shape"):
        rms_norm.rms_norm(torch.randn(3, 8), torch.ones(4), 1e-6)


def test_the_trainers_model_norms_become_fused_with_the_same_parameters(tmp_path):
    pytest.importorskip("megatron.core")
    from engines.trainer.fusions import FusedRMSNorm, fuse_norms

    model = torch.nn.Sequential(torch.nn.RMSNorm(8, eps=1e-5), torch.nn.Linear(8, 8), torch.nn.RMSNorm(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 8)
    want = model(x)
    assert fuse_norms(model) == 2
    assert isinstance(model[0], FusedRMSNorm) and isinstance(model[2], FusedRMSNorm)
    assert model.state_dict().keys() == before.keys()
    assert torch.equal(model(x), want)


KERNEL_CHECK = r"""
import torch
from engines.kernels import rms_norm
torch.manual_seed(0)
worst = 0.0
for dtype in (torch.float32, torch.bfloat16):
    for rows, n in ((70, 48), (5, 200)):   # several programs, a partial last one; a partial column block
        x = (torch.randn(rows, n) * 2).to(dtype)
        w = torch.randn(n).to(dtype)
        g = torch.randn(rows, n).to(dtype)
        yk, rk = rms_norm.forward(x, w, 1e-6, use_triton=True)
        yr, rr = rms_norm.forward(x, w, 1e-6, use_triton=False)
        dxk, dwk = rms_norm.backward(x, w, rr, g, use_triton=True)
        dxr, dwr = rms_norm.backward(x, w, rr, g, use_triton=False)
        step = 2.0 ** (-7 if dtype == torch.bfloat16 else -18)
        for k, r in ((yk, yr), (rk, rr), (dxk, dxr), (dwk, dwr)):
            assert k.shape == r.shape and k.dtype == r.dtype, (k.shape, r.shape, k.dtype, r.dtype)
            worst = max(worst, float((k.float() - r.float()).abs().max()) / (step * (1 + float(r.float().abs().max()))))
empty = torch.zeros(0, 48)  # no rows: empty results, and the kernels still trusted
y, r = rms_norm.forward(empty, torch.ones(48), 1e-6, use_triton=True)
dx, dw = rms_norm.backward(empty, torch.ones(48), r, empty, use_triton=True)
assert y.shape == (0, 48) and dx.shape == (0, 48) and torch.equal(dw, torch.zeros(48))
assert rms_norm._KERNEL_OK[0]
print(worst)
"""


def test_triton_kernels_equal_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    assert under_triton_interpreter(KERNEL_CHECK) <= 2.0  # within two rounding steps of the scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernels_equal_torch_at_real_shapes():
    torch.manual_seed(1)
    for shape in ((8192, 1024), (8192, 16, 128)):
        norm = torch.nn.RMSNorm(shape[-1], eps=1e-6).cuda().bfloat16()
        with torch.no_grad():
            norm.weight.copy_(torch.randn(shape[-1]))
        x = (torch.randn(shape, device="cuda") * 3).bfloat16().requires_grad_(True)
        w = norm.weight.detach().clone().requires_grad_(True)
        y = rms_norm.rms_norm(x, w, 1e-6)
        ref_x = x.detach().clone().requires_grad_(True)
        ref = norm(ref_x)
        assert ((y.float() - ref.float()).abs() <= 2.0 ** -7 * ref.float().abs() + 1e-6).all()
        g = torch.randn(shape, device="cuda").bfloat16()
        y.backward(g)
        ref.backward(g)
        for mine, theirs in ((x.grad, ref_x.grad), (w.grad, norm.weight.grad)):
            assert (mine.float() - theirs.float()).abs().max() <= 2e-2 * (1 + theirs.float().abs().max())
    assert rms_norm._KERNEL_OK[0]
