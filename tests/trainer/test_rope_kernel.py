"""The fused RoPE (engines/kernels/rope.py; engines/trainer/fusions.py serves it to Megatron)
equals megatron-core's unfused RoPE to the bit in its forward, for padded rows and packed
ones (both of Megatron's position mappings), fp32 and bf16, contiguous or a view of a QKV
projection; its backward equals the exact transpose; the Triton kernel (under Triton's
interpreter on CPU, and on CUDA) equals the torch reference; what the kernel does not cover
goes to Megatron's code."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from engines.kernels import rope  # noqa: E402
from engines.trainer import fusions  # noqa: E402
from tests.helpers import under_triton_interpreter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def angles(positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Megatron's layout: ``[P, 1, 1, D]``, ``cat(f, f)`` of position x inverse frequency."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    f = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None]


class _CP:
    """A context-parallel group of one (Megatron's thd code asks its size and rank)."""

    def size(self):
        return 1

    def rank(self):
        return 0


def megatron_bshd(t, freqs):
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs)


def megatron_thd(t, cu, freqs):
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_CP())


def exact_grad(t, freqs, g, positions=None):
    """The gradient of the rotation, in float64 (the rotation's transpose applied to ``g``)."""
    rows = torch.arange(t.shape[0]) if positions is None else positions.long()
    f = freqs.reshape(freqs.shape[0], -1)[rows].double()[:, None, None]
    c, s = f.cos().to(t.dtype).double(), f.sin().to(t.dtype).double()
    x = t.double().detach().requires_grad_(True)
    x1, x2 = x.chunk(2, dim=-1)
    (((x * c + torch.cat((-x2, x1), -1) * s) * g.double()).sum()).backward()
    return x.grad


@pytest.fixture
def fused_path(monkeypatch):
    """The fused path on CPU: the custom autograd function with the kernel's torch reference
    inside (on CPU the trainer itself takes megatron-core's code:
    tests/trainer/test_megatron_model.py)."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(rope, "runs", lambda t: True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_equal_megatron_bit_for_bit(dtype, fused_path):
    torch.manual_seed(0)
    S, B, H, D = 37, 3, 5, 16
    t = (torch.randn(S, B, H, D) * 3).to(dtype).requires_grad_(True)
    freqs = angles(S + 4, D)[:S]
    ours = fusions.rope_bshd(t, freqs)
    assert ours.dtype == dtype and ours.shape == t.shape
    assert torch.equal(ours, megatron_bshd(t.detach(), freqs))
    g = torch.randn(S, B, H, D).to(dtype)
    ours.backward(g)
    ref = exact_grad(t, freqs, g)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # rounded once to the dtype
    assert (t.grad.double() - ref).abs().max() <= tol * (1 + ref.abs().max())


def test_a_view_of_a_qkv_projection_equals_the_contiguous_copy(fused_path):
    torch.manual_seed(1)
    S, B, H, D = 11, 2, 4, 8
    qkv = torch.randn(S, B, 3 * H * D)
    q = qkv[..., : H * D].view(S, B, H, D)  # strided: a slice of each token's row
    assert not q.is_contiguous()
    freqs = angles(S, D)
    assert torch.equal(fusions.rope_bshd(q, freqs), megatron_bshd(q.contiguous(), freqs))


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_equal_megatron_in_both_position_mappings(offsets, dtype, fused_path):
    """Angles for the longest sequence: each sequence starts at position 0; angles covering
    exactly the packed tokens: Megatron's offset mapping (token i takes row i)."""
    torch.manual_seed(2)
    lengths = [5, 1, 12, 7]
    T, H, D = sum(lengths), 3, 16
    cu = torch.tensor([0, 5, 6, 18, 25], dtype=torch.int32)
    freqs = angles(T if offsets else max(lengths), D)
    t = torch.randn(T, H, D).to(dtype).requires_grad_(True)
    ours = fusions.rope_thd(t, cu, freqs)
    assert torch.equal(ours, megatron_thd(t.detach(), cu, freqs))
    g = torch.randn(T, H, D).to(dtype)
    ours.backward(g)
    positions = torch.arange(T) if offsets else torch.cat([torch.arange(n) for n in lengths])
    ref = exact_grad(t[:, None], freqs, g[:, None], positions)[:, 0]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (t.grad.double() - ref).abs().max() <= tol * (1 + ref.abs().max())


def test_the_tables_follow_new_angles_and_a_new_packing(fused_path):
    torch.manual_seed(3)
    t = torch.randn(6, 1, 2, 8)
    a, b = angles(6, 8), angles(6, 8, base=500.0)
    assert torch.equal(fusions.rope_bshd(t, a), megatron_bshd(t, a))
    assert torch.equal(fusions.rope_bshd(t, b), megatron_bshd(t, b))
    b.mul_(0.5)  # changed in place: the cached cos / sin must not be reused
    assert torch.equal(fusions.rope_bshd(t, b), megatron_bshd(t, b))
    p = torch.randn(6, 2, 8)
    long = angles(6, 8)
    for cu in (torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 4, 6], dtype=torch.int32)):
        assert torch.equal(fusions.rope_thd(p, cu, long[:4]), megatron_thd(p, cu, long[:4]))


def test_what_the_kernel_does_not_cover_goes_to_megatron(fused_path):
    torch.manual_seed(4)
    t = torch.randn(5, 1, 2, 8)
    partial = angles(5, 4)  # rotary_percent < 1: only the first 4 of 8 channels turn
    assert torch.equal(fusions.rope_bshd(t, partial), megatron_bshd(t, partial))
    from megatron.core.models.common.embeddings import rope_utils

    full = angles(5, 8)
    assert torch.equal(fusions.rope_bshd(t, full, interleaved=True),
                       rope_utils._apply_rotary_pos_emb_bshd(t, full, rotary_interleaved=True))


def test_install_serves_megatrons_hook_and_the_trainer_turns_fusion_on(tmp_path):
    from megatron.core.models.common.embeddings import rope_utils

    from engines.models.model import ModelConfig
    from engines.models.model_builder import make_model
    from engines.trainer import cpu_shim
    from engines.trainer.megatron_model import transformer_config

    cpu_shim.install()
    cfg = ModelConfig.from_dir(make_model("qwen3", "tiny", str(tmp_path / "m"), seed=0))
    assert transformer_config(cfg).apply_rope_fusion
    assert rope_utils.fused_apply_rotary_pos_emb is fusions.rope_bshd  # no TransformerEngine here
    assert rope_utils.fused_apply_rotary_pos_emb_thd is fusions.rope_thd


KERNEL_CHECK = r"""
import torch
from engines.kernels import rope
from engines.kernels.paged_attention import triton_usable
assert triton_usable(torch.device("cpu"))
torch.manual_seed(0)
worst = 0.0
for dtype in (torch.float32, torch.bfloat16):
    S, B, H, D = 9, 2, 3, 16
    qkv = torch.randn(S, B, 3 * H * D).to(dtype)
    t = qkv[..., : H * D].view(S, B, H, D)
    f = torch.randn(S + 3, D)
    cos, sin = f.cos().to(dtype), f.sin().to(dtype)
    for positions in (None, torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3], dtype=torch.int32)):
        for backward in (False, True):
            k = rope._rope(t, cos, sin, positions, backward, use_triton=True)
            r = rope._rope(t, cos, sin, positions, backward, use_triton=False)
            assert k.shape == r.shape and k.dtype == r.dtype and k.is_contiguous()
            if dtype == torch.float32 and not backward:
                assert torch.equal(k, r), positions
            # bf16: the interpreter's float32 -> bf16 conversion is its own (numpy): a rounding
            # step of the products apart here (bit-equal on CUDA: test_cuda_kernel_equals_megatron_*)
            step = 2.0 ** -7 * float(t.float().abs().max())
            worst = max(worst, float((k.float() - r.float()).abs().max()) / step)
none = torch.zeros(0, 1, 3, 16)  # no rows: an empty result, and the kernel still trusted
assert rope._rope(none, cos, sin, None, False, use_triton=True).shape == (0, 1, 3, 16)
assert rope._KERNEL_OK[0]
print(worst)
"""


def test_triton_kernel_equals_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    assert under_triton_interpreter(KERNEL_CHECK) <= 2.0  # at most two bf16 steps of the inputs' scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_equals_megatron_at_a_real_shape():
    torch.manual_seed(5)
    S, B, H, D = 4096, 2, 16, 128
    qkv = torch.randn(S, B, 3 * H * D, device="cuda", dtype=torch.bfloat16)
    q = qkv[..., : H * D].view(S, B, H, D)
    freqs = angles(S, D, base=1e6).cuda()
    assert torch.equal(fusions.rope_bshd(q, freqs), megatron_bshd(q.contiguous(), freqs))
    lengths = [1000, 3000, 96, 4096]
    cu = torch.tensor([0, 1000, 4000, 4096, 8192], dtype=torch.int32, device="cuda")
    p = torch.randn(8192, H, D, device="cuda", dtype=torch.bfloat16)
    long = angles(max(lengths), D, base=1e6).cuda()
    assert torch.equal(fusions.rope_thd(p, cu, long), megatron_thd(p, cu, long))
    assert rope._KERNEL_OK[0]
