"""The fused LM head (engines/kernels/token_logprobs.py): log-probs, entropies and their
gradients equal the plain formula (log-softmax of the whole float32 logits / T) at any
chunking, temperature and dtype; the Triton kernels (under Triton's interpreter on CPU) equal
the torch reference; a vocabulary split over two gloo ranks gives the whole-vocabulary result."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from engines.kernels import token_logprobs as K
from tests.helpers import under_triton_interpreter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plain(hidden, weight, targets, temperature):
    x = (hidden.float() @ weight.float().t()) / temperature
    logsm = x.log_softmax(-1)
    return logsm.gather(1, targets[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)


def grads_of(fn, hidden, weight, a, b):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    lp, ent = fn(h, w)
    (lp * a + ent * b).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("rows", [7, 64, None])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_equals_the_plain_formula_fp32(rows, temperature):
    torch.manual_seed(1)
    n, h, v = 53, 24, 397
    hidden, weight = torch.randn(n, h) * 2, torch.randn(v, h)
    targets = torch.randint(0, v, (n,))
    a, b = torch.randn(n), torch.randn(n)
    ours = grads_of(lambda x, w: K.lm_head_logprobs(x, w, targets, temperature, rows=rows), hidden, weight, a, b)
    ref = grads_of(lambda x, w: plain(x, w, targets, temperature), hidden, weight, a, b)
    for mine, theirs, what in zip(ours, ref, ("logp", "entropy", "grad hidden", "grad weight")):
        # float32 sums in another order: within 1e-5 of the tensor's scale
        assert (mine - theirs).abs().max() <= 1e-5 * (1 + theirs.abs().max()), (what, (mine - theirs).abs().max())


def test_bf16_rounds_only_the_logits():
    """bf16 weights: the logits are rounded to bf16 once (as a bf16 matmul's output is) and
    everything after is float32."""
    torch.manual_seed(2)
    n, h, v = 40, 32, 300
    hidden, weight = torch.randn(n, h).bfloat16(), torch.randn(v, h).bfloat16()
    targets = torch.randint(0, v, (n,))
    logp, ent = K.lm_head_logprobs(hidden, weight, targets, 0.8, rows=16)
    x = (hidden @ weight.t()).float() / 0.8  # bf16 logits, then float32
    logsm = x.log_softmax(-1)
    assert torch.allclose(logp, logsm.gather(1, targets[:, None])[:, 0], atol=1e-5)
    assert torch.allclose(ent, -(logsm.exp() * logsm).sum(-1), atol=1e-5)


def test_no_grad_saves_nothing_and_gives_the_same_values():
    torch.manual_seed(3)
    hidden, weight = torch.randn(9, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    targets = torch.randint(0, 50, (9,))
    with torch.no_grad():
        lp, ent = K.lm_head_logprobs(hidden, weight, targets, 1.3)
    assert lp.grad_fn is None
    lp2, ent2 = K.lm_head_logprobs(hidden, weight, targets, 1.3)
    assert torch.equal(lp, lp2.detach()) and torch.equal(ent, ent2.detach())


def test_bad_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature must be positive"):
        K.lm_head_logprobs(torch.randn(2, 4), torch.randn(5, 4), torch.zeros(2, dtype=torch.long), 0.0)


KERNEL_CHECK = r"""
import torch
from engines.kernels import token_logprobs as K
torch.manual_seed(0)
worst = 0.0
for dtype, v in ((torch.float32, 301), (torch.bfloat16, 4500)):  # 4500: more than one block of 4096
    n = 19
    logits = (torch.randn(n, v) * 3).to(dtype)
    targets = torch.randint(-50, v + 50, (n,))  # some outside this slice (another rank's)
    for t in (1.0, 0.7):
        ref, ker = K.row_stats_ref(logits, targets, 1 / t), K.row_stats(logits, targets, 1 / t, use_triton=True)
        worst = max(worst, float(((ref - ker).abs() / (1 + ref.abs())).max()))
        _, lse, ent = K._combine(ref, None)
        a, b = torch.randn(n), torch.randn(n)
        g_ref = K.logit_grads_ref(logits, targets, lse, ent, a, b, 1 / t).float()
        g_ker = K.logit_grads_(logits.clone(), targets, lse, ent, a, b, 1 / t, use_triton=True).float()
        tol = 1e-6 if dtype == torch.float32 else 8e-3
        worst = max(worst, float((g_ref - g_ker).abs().max()) * 1e-6 / tol)
print(worst)
"""


def test_triton_kernels_equal_the_reference_under_the_interpreter():
    pytest.importorskip("triton")
    assert under_triton_interpreter(KERNEL_CHECK) < 1e-5


TP_CHECK = r"""
import os, sys, torch, torch.distributed as dist
from engines.kernels import token_logprobs as K
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
n, h, v = 21, 16, 200
hidden, weight = torch.randn(n, h), torch.randn(v, h)
targets = torch.randint(0, v, (n,))
a, b = torch.randn(n), torch.randn(n)
half = v // 2
w = weight[rank * half:(rank + 1) * half].clone().requires_grad_(True)
x = hidden.clone().requires_grad_(True)
lp, ent = K.lm_head_logprobs(x, w, targets, 0.9, vocab_start=rank * half, tp_group=dist.group.WORLD, rows=8)
(lp * a + ent * b).sum().backward()
gx = x.grad.clone(); dist.all_reduce(gx)  # the column-parallel input's gradient: summed over TP
x2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
logsm = ((x2 @ w2.t()) / 0.9).log_softmax(-1)
lp2, ent2 = logsm.gather(1, targets[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)
(lp2 * a + ent2 * b).sum().backward()
worst = max(float((lp - lp2).abs().max()), float((ent - ent2).abs().max()), float((gx - x2.grad).abs().max()),
            float((w.grad - w2.grad[rank * half:(rank + 1) * half]).abs().max()))
print("WORST", worst)
dist.destroy_process_group()
"""


def test_vocabulary_split_over_two_ranks_equals_the_whole(tmp_path):
    script = tmp_path / "tp_check.py"
    script.write_text(TP_CHECK)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": ROOT, "RANK": str(r), "WORLD_SIZE": "2",
                                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        worst = float(out.split("WORST")[1])
        assert worst < 2e-5, worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_kernels_equal_the_reference_at_a_real_vocabulary():
    """On CUDA (not CI): Qwen3's vocabulary in bf16, the kernels against the torch reference,
    and the fused head's values and gradients against the plain float32 formula."""
    torch.manual_seed(0)
    n, h, v = 300, 256, 151936
    hidden = torch.randn(n, h, device="cuda").bfloat16()
    weight = (torch.randn(v, h, device="cuda") / 16).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda")
    logits = hidden @ weight.t()
    ref = K.row_stats_ref(logits, targets, 1 / 0.7)
    ker = K.row_stats(logits, targets, 1 / 0.7)
    assert ((ref - ker).abs() / (1 + ref.abs())).max() < 1e-5
    _, lse, ent = K._combine(ref, None)
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    g_ref = K.logit_grads_ref(logits, targets, lse, ent, a, b, 1 / 0.7).float()
    g_ker = K.logit_grads_(logits.clone(), targets, lse, ent, a, b, 1 / 0.7).float()
    assert (g_ref - g_ker).abs().max() < 1e-2 * g_ref.abs().max()
    ours = grads_of(lambda x, w: K.lm_head_logprobs(x, w, targets, 0.7, rows=128), hidden, weight, a, b)
    ref = grads_of(lambda x, w: plain(x.float(), w.float(), targets, 0.7), hidden.float(), weight.float(), a, b)
    for mine, theirs in zip(ours[:2], ref[:2]):
        assert (mine - theirs).abs().max() < 0.05  # bf16 logits against float32 ones


def test_a_kernel_that_cannot_run_falls_back_to_the_reference_with_one_warning(monkeypatch, capsys):
    """A Triton that cannot compile the kernels (simulated: the launch raises) leaves the
    exact torch path to the process, said once on stderr."""
    if K.triton is None:
        pytest.skip("Triton is not installed: the torch path is the only one, nothing falls back")

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise RuntimeError("PassManager::run failed")
            return launch

    monkeypatch.setattr(K, "_stats_kernel", Broken(), raising=False)
    monkeypatch.setattr(K, "_KERNELS_OK", [True])
    logits, targets = torch.randn(5, 40), torch.randint(0, 40, (5,))
    assert torch.equal(K.row_stats(logits, targets, 1.0, use_triton=True),
                       K.row_stats_ref(logits, targets, 1.0))
    assert K._KERNELS_OK == [False]
    assert "cannot run here (RuntimeError: PassManager::run failed); using the torch path" in capsys.readouterr().err
    assert not K._kernels(torch.device("cpu"), None)
