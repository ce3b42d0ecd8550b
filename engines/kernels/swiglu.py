"""SwiGLU in one pass each way: ``silu(a) * b`` of the halves ``[a, b]`` of an MLP's fc1
output, where megatron-core's unfused code runs a chunk, a SiLU and a product forward and five
kernels back, and keeps ``a``, ``b`` and ``silu(a)`` for the backward (this keeps the input
only). The trainer serves megatron-core's fused-SwiGLU call with it (engines/trainer/fusions.py).

Rounding as the unfused bf16 code's: ``silu(a)`` rounded to the dtype, then the product
rounded (math in float32 between). The backward, ``da = g b silu'(a)``, ``db = g silu(a)``,
is float32 rounded once. On CUDA a Triton kernel; elsewhere :func:`swiglu` runs the unfused
torch ops under autograd (their values and gradients to the bit); the kernel is tested
against its torch reference under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch

from engines.kernels.paged_attention import launch_or_fall_back, triton, triton_usable

# ----------------------------------------------------------------------------- torch reference


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` of ``x = [a, b]`` (last dimension), rounded as the unfused code rounds."""
    a, b = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(a) * b


def swiglu_grad_ref(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`swiglu_ref` with respect to ``x`` (float32, rounded once)."""
    a, b = x.float().chunk(2, dim=-1)
    g = g.float()
    sig = torch.sigmoid(a)
    silu = a * sig
    return torch.cat((g * b * sig * (1 + a * (1 - sig)), g * silu), dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------- Triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _swiglu_kernel(x, g, out, n_half, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < n_half
        src = x + row * (2 * n_half) + cols
        a = tl.load(src, mask=live, other=0.0)
        dtype = a.dtype
        a = a.to(tl.float32)
        b = tl.load(src + n_half, mask=live, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-a))
        if BACKWARD:
            gy = tl.load(g + row * n_half + cols, mask=live, other=0.0).to(tl.float32)
            da = gy * b * sig * (1.0 + a * (1.0 - sig))
            dst = out + row * (2 * n_half) + cols
            tl.store(dst, da.to(dtype, fp_downcast_rounding="rtne"), mask=live)
            tl.store(dst + n_half, (gy * a * sig).to(dtype, fp_downcast_rounding="rtne"), mask=live)
        else:
            silu = (a * sig).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
            tl.store(out + row * n_half + cols, (silu * b).to(dtype, fp_downcast_rounding="rtne"), mask=live)


#: whether the kernel may run: a launch that fails says so once on stderr and leaves the torch
#: reference to every later call of the process
_KERNEL_OK = [True]
_BLOCK = 1024


def _swiglu(x: torch.Tensor, g: torch.Tensor | None, use_triton: bool | None = None) -> torch.Tensor:
    """Forward (``g`` None: ``[..., n]`` of ``x`` ``[..., 2n]``) or backward (``[..., 2n]``)."""
    usable = (triton_usable(x.device) and _KERNEL_OK[0]) if use_triton is None else use_triton
    if usable and x.numel():  # nothing to launch for no rows (an expert no token was routed to)
        n = x.shape[-1] // 2
        rows = x.numel() // (2 * n)
        xc = x.contiguous()
        out = torch.empty((*x.shape[:-1], 2 * n if g is not None else n), dtype=x.dtype, device=x.device)
        if launch_or_fall_back(_KERNEL_OK, "SwiGLU", _swiglu_kernel, (rows, triton.cdiv(n, _BLOCK)), xc,
                               g.contiguous() if g is not None else xc, out, n, BACKWARD=g is not None, BLOCK=_BLOCK):
            return out
    return swiglu_ref(x) if g is None else swiglu_grad_ref(x, g)


def runs(x: torch.Tensor) -> bool:
    """Whether the kernels run for ``x`` (CUDA, or Triton's interpreter)."""
    return triton_usable(x.device) and _KERNEL_OK[0]


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _swiglu(x, None)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _swiglu(x, g)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` of ``x = [a, b]`` (last dimension, even), differentiable."""
    if x.shape[-1] % 2:
        raise ValueError(f"SwiGLU needs an even last dimension, not {x.shape[-1]}")
    if runs(x):
        return _SwiGLU.apply(x)
    return swiglu_ref(x)  # torch's ops under autograd: the unfused code's gradient to the bit
