"""Rotary position embedding in one pass: :func:`rope` rotates ``t`` ``[S, B, H, D]`` by the
angles of Megatron-core's layout (``t * cos + rotate_half(t) * sin``, non-interleaved, the
whole head), each row by its own position, where Megatron's unfused code runs eight
elementwise kernels a call (and for packed rows a loop over the sequences). The trainer
serves megatron-core's fused-RoPE hook with it (engines/trainer/fusions.py).

The values are Megatron's to the bit: ``cos`` and ``sin`` of the angles are rounded to the
activations' dtype once a forward (computed for the first layer's call, then reused while
the same angle tensor comes), each product is rounded to that dtype and their sum again,
as the unfused code's bf16 ops round. The backward (``dx1 = g1 cos1 + g2 sin2``, ``dx2 = g2
cos2 - g1 sin1``) is computed in float32 and rounded once. On CUDA one Triton program rotates
every head of one token. Elsewhere :func:`rope` runs the same rotation in torch ops under
autograd (Megatron's values and gradients to the bit); the kernel's torch reference
(``rope_ref`` / ``rope_grad_ref``) is what it is tested against under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch

from engines.kernels.paged_attention import launch_or_fall_back, triton, triton_usable

# ----------------------------------------------------------------------------- tables


class _Tables:
    """``cos`` / ``sin`` of the last angle tensor seen (per dtype), and the positions of the
    last packing seen: every layer of one forward passes the same tensors. Each entry is one
    tuple, swapped whole (two models' forwards in threads of one process never mix entries)."""

    def __init__(self) -> None:
        self.tables: tuple = (None, (), ())  # (angles, key, (cos, sin))
        self.packing: tuple = (None, (), None)  # (cu_seqlens, key, positions)

    def cos_sin(self, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[P, D]`` rows of ``(cos(freqs), sin(freqs))`` rounded to ``dtype``."""
        key = (freqs._version, freqs.shape, dtype)
        angles, seen, value = self.tables
        if angles is not freqs or seen != key:
            flat = freqs.reshape(freqs.shape[0], freqs.shape[-1])
            value = (flat.cos().to(dtype).contiguous(), flat.sin().to(dtype).contiguous())
            self.tables = (freqs, key, value)
        return value

    def packed_positions(self, cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
        """Each token's position in its own sequence (``int32 [tokens]``) of the packing ``cu_seqlens``."""
        key = (cu_seqlens._version, cu_seqlens.shape, tokens)
        bounds, seen, positions = self.packing
        if bounds is not cu_seqlens or seen != key:
            starts = cu_seqlens[:-1].long()
            lengths = cu_seqlens[1:].long() - starts
            index = torch.arange(tokens, device=cu_seqlens.device)
            positions = (index - starts.repeat_interleave(lengths, output_size=tokens)).to(torch.int32)
            self.packing = (cu_seqlens, key, positions)
        return positions


_TABLES = _Tables()


# ----------------------------------------------------------------------------- torch reference

def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (``sign`` -1: the transpose, ``rotate_half`` the
    other way) with ``cos``/``sin`` broadcast over the heads; rounded as the inputs' dtype rounds."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1) if sign > 0 else torch.cat((x2, -x1), dim=-1)
    return x * cos + rotated * sin


def rope_ref(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """``t`` ``[S, B, H, D]`` rotated: row ``(s, b)`` by table row ``positions[s]`` (``s``
    where None), exactly as Megatron's unfused code computes it."""
    rows = torch.arange(t.shape[0], device=t.device) if positions is None else positions.long()
    return _rotate(t, cos[rows][:, None, None], sin[rows][:, None, None], 1.0)


def rope_grad_ref(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None):
    """The gradient of :func:`rope_ref` with respect to ``t``, in float32 rounded once."""
    rows = torch.arange(g.shape[0], device=g.device) if positions is None else positions.long()
    c, s = cos[rows][:, None, None].float(), sin[rows][:, None, None].float()
    g32 = g.float()
    g1, g2 = g32.chunk(2, dim=-1)
    c1, c2 = c.chunk(2, dim=-1)
    s1, s2 = s.chunk(2, dim=-1)
    return torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), dim=-1).to(g.dtype)


# ----------------------------------------------------------------------------- Triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rope_kernel(x, x_s, x_b, x_h, out, cos, sin, positions, B, H,
                     HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        token = tl.program_id(0)
        s = token // B
        b = token % B
        if HAS_POS:
            p = tl.load(positions + s).to(tl.int64)
        else:
            p = s.to(tl.int64)
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = tl.arange(0, HALF)[None, :]
        live = heads < H
        src = x + s.to(tl.int64) * x_s + b.to(tl.int64) * x_b + heads * x_h + cols
        x1 = tl.load(src, mask=live, other=0.0)
        x2 = tl.load(src + HALF, mask=live, other=0.0)
        row = p * (2 * HALF) + cols
        c1 = tl.load(cos + row)
        c2 = tl.load(cos + row + HALF)
        s1 = tl.load(sin + row)
        s2 = tl.load(sin + row + HALF)
        dtype = x1.dtype  # math in float32 (a product of two bf16/fp16 values is exact there)
        a, bb = x1.to(tl.float32), x2.to(tl.float32)
        c1, c2, s1, s2 = c1.to(tl.float32), c2.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32)
        if BACKWARD:
            y1 = (a * c1 + bb * s2).to(dtype, fp_downcast_rounding="rtne")
            y2 = (bb * c2 - a * s1).to(dtype, fp_downcast_rounding="rtne")
        else:  # Megatron's rounding: each product to the dtype (to nearest even), then their sum
            p1 = (a * c1).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
            p2 = (-bb * s1).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
            p3 = (bb * c2).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
            p4 = (a * s2).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
            y1 = (p1 + p2).to(dtype, fp_downcast_rounding="rtne")
            y2 = (p3 + p4).to(dtype, fp_downcast_rounding="rtne")
        dst = out + token.to(tl.int64) * H * (2 * HALF) + heads * (2 * HALF) + cols
        tl.store(dst, y1, mask=live)
        tl.store(dst + HALF, y2, mask=live)


#: float32 products and sums rounded one by one, as torch rounds them (no fused multiply-add);
#: the interpreter takes no compiler options
_NO_FMA = {} if triton is None or os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}

#: whether the kernel may run: a launch that fails says so once on stderr and leaves the torch
#: reference to every later call of the process
_KERNEL_OK = [True]


def _rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions, backward: bool,
          use_triton: bool | None = None) -> torch.Tensor:
    """``t`` (or, ``backward``, a gradient) rotated; a new contiguous ``[S, B, H, D]`` tensor."""
    usable = (triton_usable(t.device) and _KERNEL_OK[0]) if use_triton is None else use_triton
    if usable and t.stride(-1) == 1 and t.numel():  # nothing to launch for no rows
        S, B, H, D = t.shape
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        if launch_or_fall_back(_KERNEL_OK, "RoPE", _rope_kernel, (S * B,), t, t.stride(0), t.stride(1), t.stride(2),
                               out, cos, sin, positions if positions is not None else cos, B, H,
                               HAS_POS=positions is not None, BACKWARD=backward, HALF=D // 2,
                               BLOCK_H=triton.next_power_of_2(H), **_NO_FMA):
            return out
    return (rope_grad_ref if backward else rope_ref)(t, cos, sin, positions)


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin, positions):
        ctx.save_for_backward(cos, sin, positions)
        return _rope(t, cos, sin, positions, backward=False)

    @staticmethod
    def backward(ctx, g):
        cos, sin, positions = ctx.saved_tensors
        return _rope(g, cos, sin, positions, backward=True), None, None, None


def runs(t: torch.Tensor) -> bool:
    """Whether :func:`rope` runs the kernel for ``t`` (CUDA, or Triton's interpreter)."""
    return triton_usable(t.device) and _KERNEL_OK[0]


def covers(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether :func:`rope` takes ``t`` with ``freqs``: the whole head rotated, a power-of-two
    head size."""
    d = t.shape[-1]
    return freqs.shape[-1] == d and d >= 2 and d & (d - 1) == 0


def packed_positions(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """Each token's position in its own sequence (``int32 [tokens]``) of the packing
    ``cu_seqlens`` (cached while the same tensor comes)."""
    return _TABLES.packed_positions(cu_seqlens, tokens)


def rope(t: torch.Tensor, freqs: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` ``[S, B, H, D]`` rotated by the angles ``freqs`` ``[P, 1, 1, D]`` (Megatron's
    layout: ``cat(f, f)``), row ``s`` by angle row ``positions[s]`` (``s`` where None)."""
    cos, sin = _TABLES.cos_sin(freqs, t.dtype)
    if runs(t):
        return _RoPE.apply(t, cos, sin, positions)
    return rope_ref(t, cos, sin, positions)  # torch's ops under autograd: Megatron's gradient to the bit
