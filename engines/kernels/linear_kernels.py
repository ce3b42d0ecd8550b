"""Triton kernels of a Gated DeltaNet layer (engines/models/linear_attention.py). Decode: the
short causal conv1d update of the conv state and the one-token gated delta rule on the
recurrent state, both reading and writing the state rows ``rows`` (a device tensor) of the
layer's pool in place. Nothing there waits on the device (no ``.item()``, no data-dependent
shape), so the decode step can be captured in a CUDA graph. (Prefill runs the torch chunked
rule, engines/models/linear_attention.py; a Triton version was tried and was slower for
batched prompts: see git history, 2026-12-02.)

Both kernels follow :meth:`GatedDeltaNet.decode`'s reference math step for step:

* :func:`conv_decode`: ``window = [conv[row], x]`` (x in the conv state's dtype), the
  state becomes ``window[:, 1:]``, the output is ``silu(sum(window * weight))``, each product
  and the sum rounded to the input's dtype as torch's ops round them.
* :func:`recurrent_decode`: for each (sequence, value head, tile of ``BV`` value columns) one
  program: q and k of its key head (value head ``h`` reads key head ``h // (Hv // Hk)``, as
  ``repeat_interleave`` maps them), L2-normalised (``rsqrt(sum(x * x) + 1e-6)``, q also
  scaled by ``Dk ** -0.5``), ``beta = sigmoid(b)`` (rounded to b's dtype, as the reference's
  ``sigmoid(...).float()``), ``g = -exp(A_log) * softplus(a + dt_bias)``; then
  ``S = exp(g) S;  u = beta (v - S^T k);  S = S + k u^T;  o = S^T q`` on the float32 state.
  The state's columns evolve independently, so the tiles over ``Dv`` are exact.

Rows that appear twice in one batch (the padding row of a padded batch) race; their outputs
are garbage, as a padding row's may be; every other row is computed exactly.
"""

from __future__ import annotations

import torch

from engines.kernels.paged_attention import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """float32 ``x`` rounded to ``dtype``'s precision (to nearest, ties to even, as torch
        rounds), kept in float32. bf16 by hand: the interpreter's float32-to-bf16 cast truncates."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            y = bits.to(tl.float32, bitcast=True)
        elif dtype == tl.float16:
            y = x.to(tl.float16).to(tl.float32)
        else:
            y = x
        return y

    @triton.jit
    def _conv_decode_kernel(
        MIX, CONV, W, ROWS, OUT,
        s_mb, s_cn, s_cc, s_cj, s_wc, s_wj, s_ob,
        C,
        K: tl.constexpr, BLOCK_C: tl.constexpr,
    ):
        b = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = offs < C
        row = tl.load(ROWS + b).to(tl.int64)
        state = CONV + row * s_cn + offs * s_cc
        dtype = OUT.dtype.element_ty
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K - 1):  # window position j: state column j
            s = tl.load(state + j * s_cj, mask=mask, other=0.0)
            w = tl.load(W + offs * s_wc + j * s_wj, mask=mask, other=0.0)
            acc += _rounded(s.to(dtype).to(tl.float32) * w.to(tl.float32), dtype)
            if j > 0:  # shift left: column j moves to j - 1 (column j - 1 was read one step before)
                tl.store(state + (j - 1) * s_cj, s, mask=mask)
        new = tl.load(MIX + b * s_mb + offs, mask=mask, other=0.0).to(CONV.dtype.element_ty)
        w = tl.load(W + offs * s_wc + (K - 1) * s_wj, mask=mask, other=0.0)
        acc += _rounded(new.to(dtype).to(tl.float32) * w.to(tl.float32), dtype)
        if K > 1:
            tl.store(state + (K - 2) * s_cj, new, mask=mask)
        acc = _rounded(acc, dtype)
        tl.store(OUT + b * s_ob + offs, _rounded(acc * tl.sigmoid(acc), dtype).to(dtype), mask=mask)

    @triton.jit
    def _recurrent_decode_kernel(
        MIX, A, B, ALOG, DTB, REC, ROWS, OUT,
        s_mb, s_ab, s_bb, s_rn, s_rh, s_rk, s_ob, s_oh,
        DK, DV, GROUP, K_OFF, V_OFF, scale,
        BK: tl.constexpr, BV: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        kh = h // GROUP
        row = tl.load(ROWS + b).to(tl.int64)
        offs_k = tl.arange(0, BK)
        mk = offs_k < DK
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        mv = offs_v < DV
        mix = MIX + b * s_mb
        q = tl.load(mix + kh * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(mix + K_OFF + kh * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(mix + V_OFF + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
        braw = tl.load(B + b * s_bb + h)
        beta = _rounded(tl.sigmoid(braw.to(tl.float32)), braw.dtype)
        x = tl.load(A + b * s_ab + h).to(tl.float32) + tl.load(DTB + h).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(tl.load(ALOG + h).to(tl.float32)) * softplus
        ptrs = REC + row * s_rn + h * s_rh + offs_k[:, None] * s_rk + offs_v[None, :]
        m2 = mk[:, None] & mv[None, :]
        state = tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
        state = state * tl.exp(g)
        u = beta * (v - tl.sum(state * k[:, None], axis=0))
        state = state + k[:, None] * u[None, :]
        o = tl.sum(state * q[:, None], axis=0)
        tl.store(ptrs, state.to(REC.dtype.element_ty), mask=m2)
        out_ty = OUT.dtype.element_ty
        tl.store(OUT + b * s_ob + h * s_oh + offs_v, _rounded(o, out_ty).to(out_ty), mask=mv)


def conv_decode(mixed: torch.Tensor, conv: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The causal conv1d of one new token per sequence: ``mixed`` [B, C] (the new inputs),
    ``conv`` [N, C, K - 1] the pool's conv states (rows ``rows`` [B] shifted in place, the new
    input in), ``weight`` [C, 1, K] the depthwise kernel. Returns ``silu(conv)`` [B, C] in
    ``mixed``'s dtype."""
    b, c = mixed.shape
    kernel = weight.shape[-1]
    assert mixed.stride(1) == 1 and conv.shape[1:] == (c, kernel - 1), (mixed.shape, conv.shape, weight.shape)
    out = torch.empty_like(mixed, memory_format=torch.contiguous_format)
    block = min(256, triton.next_power_of_2(c))
    _conv_decode_kernel[(b, triton.cdiv(c, block))](
        mixed, conv, weight, rows, out,
        mixed.stride(0), conv.stride(0), conv.stride(1), conv.stride(2), weight.stride(0), weight.stride(2),
        out.stride(0), c, K=kernel, BLOCK_C=block,
    )
    return out


def recurrent_decode(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, rec: torch.Tensor, rows: torch.Tensor, hk: int, dk: int) -> torch.Tensor:
    """One token of the gated delta rule per sequence: ``mixed`` [B, 2 Hk Dk + Hv Dv] the conv's
    output (q, k, v), ``a`` and ``b`` [B, Hv] (``in_proj_a``/``in_proj_b`` of the layer input),
    ``A_log`` and ``dt_bias`` [Hv]; ``rec`` [N, Hv, Dk, Dv] the pool's states (rows ``rows`` [B]
    advanced in place). Returns the outputs [B, Hv, Dv] in ``mixed``'s dtype."""
    batch = mixed.shape[0]
    _, hv, dk_, dv = rec.shape
    assert dk_ == dk and hv % hk == 0 and mixed.shape[1] == 2 * hk * dk + hv * dv, (mixed.shape, rec.shape, hk)
    assert mixed.stride(1) == 1 and rec.stride(3) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    out = torch.empty((batch, hv, dv), dtype=mixed.dtype, device=mixed.device)
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 4096 // bk))  # a [Dk, BV] float32 tile of at most 4096
    _recurrent_decode_kernel[(batch, hv, triton.cdiv(dv, bv))](
        mixed, a, b, A_log, dt_bias, rec, rows, out,
        mixed.stride(0), a.stride(0), b.stride(0), rec.stride(0), rec.stride(1), rec.stride(2),
        out.stride(0), out.stride(1),
        dk, dv, hv // hk, hk * dk, 2 * hk * dk, dk**-0.5, BK=bk, BV=bv,
    )
    return out

