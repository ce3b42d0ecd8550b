"""RMSNorm in one pass each way: ``rms_norm(x, weight, eps)`` over the last dimension, where
torch's composite ``rms_norm`` runs six float32 elementwise kernels forward (and more back)
over the whole activation. The forward keeps each row's ``1 / rms`` (float32) for the
backward; nothing else is saved besides the input.

Rounding as torch's: ``x * rsqrt(mean(x^2) + eps) * weight`` in float32, rounded once to the
input's dtype. The backward (``dx = r (gw - x̂
mean(gw x̂))``, ``dw = sum g x̂``, ``x̂ = x r``, ``gw = g w``) is float32; ``dw`` is summed per
block of rows in float32, then over the blocks. On CUDA Triton kernels; elsewhere
:func:`rms_norm` is torch's own ``rms_norm`` (its values and gradients); the kernels are
tested against their torch reference under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from engines.kernels.paged_attention import launch_or_fall_back, triton, triton_usable

# ----------------------------------------------------------------------------- torch reference


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, 1 / rms)``: ``y`` rounded as torch's ``rms_norm`` rounds; ``1 / rms`` float32 per row."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype), rstd[..., 0]


def rms_norm_grad_ref(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, g: torch.Tensor):
    """``(dx, dw)`` of :func:`rms_norm_ref`: ``dx`` in ``x``'s dtype, ``dw`` float32."""
    n = x.shape[-1]
    xh = x.float() * rstd[..., None]
    gw = g.float() * weight.float()
    dx = rstd[..., None] * (gw - xh * (gw * xh).sum(-1, keepdim=True) / n)
    dw = (g.float() * xh).reshape(-1, n).sum(0)
    return dx.to(x.dtype), dw


# ----------------------------------------------------------------------------- Triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _forward_kernel(x, w, y, rstd_out, rows, N, eps, R: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0) * R + tl.arange(0, R)[:, None]
        c = tl.arange(0, BLOCK)[None, :]
        live = (r < rows) & (c < N)
        at = r.to(tl.int64) * N + c
        xv = tl.load(x + at, mask=live, other=0.0)
        dtype = xv.dtype
        x32 = xv.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / N + eps)
        wv = tl.load(w + c, mask=c < N, other=0.0).to(tl.float32)
        tl.store(y + at, (x32 * rstd[:, None] * wv).to(dtype, fp_downcast_rounding="rtne"), mask=live)
        rr = tl.program_id(0) * R + tl.arange(0, R)
        tl.store(rstd_out + rr, rstd, mask=rr < rows)

    @triton.jit
    def _backward_kernel(x, w, rstd_in, g, dx, dw_part, rows, N, R: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        r = pid * R + tl.arange(0, R)[:, None]
        c = tl.arange(0, BLOCK)[None, :]
        live = (r < rows) & (c < N)
        at = r.to(tl.int64) * N + c
        xv = tl.load(x + at, mask=live, other=0.0)
        dtype = xv.dtype
        rr = pid * R + tl.arange(0, R)
        rstd = tl.load(rstd_in + rr, mask=rr < rows, other=0.0)[:, None]
        xh = xv.to(tl.float32) * rstd
        gv = tl.load(g + at, mask=live, other=0.0).to(tl.float32)
        wv = tl.load(w + c, mask=c < N, other=0.0).to(tl.float32)
        gw = gv * wv
        dot = tl.sum(gw * xh, axis=1)[:, None] / N
        tl.store(dx + at, (rstd * (gw - xh * dot)).to(dtype, fp_downcast_rounding="rtne"), mask=live)
        part = tl.sum(gv * xh, axis=0)
        cc = tl.arange(0, BLOCK)
        tl.store(dw_part + pid.to(tl.int64) * N + cc, part, mask=cc < N)


#: whether the kernels may run: a launch that fails says so once on stderr and leaves the torch
#: reference to every later call of the process
_KERNEL_OK = [True]


def _shape(n: int) -> tuple[int, int]:
    """(rows a program, columns block) for rows of ``n``: about 4,096 elements a program."""
    block = triton.next_power_of_2(n)
    return max(1, min(64, 4096 // block)), block


def _usable(x: torch.Tensor, use_triton: bool | None) -> bool:
    return (triton_usable(x.device) and _KERNEL_OK[0]) if use_triton is None else use_triton


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float, use_triton: bool | None = None):
    """:func:`rms_norm_ref`'s contract, by the Triton kernel where usable."""
    if _usable(x, use_triton) and 0 < x.shape[-1] <= 65536 and x.numel():  # no rows: nothing to launch
        n = x.shape[-1]
        xc = x.contiguous()
        rows = xc.numel() // n
        y = torch.empty_like(xc)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        R, block = _shape(n)
        if launch_or_fall_back(_KERNEL_OK, "RMSNorm", _forward_kernel, (triton.cdiv(rows, R),), xc, weight, y, rstd,
                               rows, n, eps, R=R, BLOCK=block):
            return y, rstd
    return rms_norm_ref(x, weight, eps)


def backward(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, g: torch.Tensor,
             use_triton: bool | None = None):
    """:func:`rms_norm_grad_ref`'s contract, by the Triton kernel where usable."""
    if _usable(x, use_triton) and 0 < x.shape[-1] <= 65536 and x.numel():
        n = x.shape[-1]
        xc, gc = x.contiguous(), g.contiguous()
        rows = xc.numel() // n
        R, block = _shape(n)
        programs = triton.cdiv(rows, R)
        dx = torch.empty_like(xc)
        part = torch.empty(programs, n, dtype=torch.float32, device=x.device)
        if launch_or_fall_back(_KERNEL_OK, "RMSNorm", _backward_kernel, (programs,), xc, weight, rstd.contiguous(), gc,
                               dx, part, rows, n, R=R, BLOCK=block):
            return dx, part.sum(0)
    return rms_norm_grad_ref(x, weight, rstd, g)


def runs(x: torch.Tensor) -> bool:
    """Whether the kernels run for ``x`` (CUDA, or Triton's interpreter)."""
    return triton_usable(x.device) and _KERNEL_OK[0]


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = backward(x, weight, rstd, g)
        return dx, dw.to(weight.dtype) if ctx.needs_input_grad[1] else None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension, differentiable in ``x`` and ``weight``."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"RMSNorm weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]}")
    if runs(x):
        return _RMSNorm.apply(x, weight, eps)
    return torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)  # torch's own, gradient included
