"""Triton kernels of a Gated DeltaNet layer (engines/models/linear_attention.py). Decode: the
short causal conv1d update of the conv state and the one-token gated delta rule on the
recurrent state, both reading and writing the state rows ``rows`` (a device tensor) of the
layer's pool in place. Nothing there waits on the device (no ``.item()``, no data-dependent
shape), so the decode step can be captured in a CUDA graph. Prefill: the chunked delta rule
over whole prompts (:func:`chunked_prefill`, described where it is defined).

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


# ---------------------------------------------------------------------- chunked prefill
#
# The gated delta rule over whole prompts (``chunked_delta_rule``'s maths, float32 state) in
# two kernels. The triangular system of a chunk depends only on its keys, betas and decays,
# so ``_chunk_solve_kernel`` inverts every 64-position chunk's ``I + A`` at once (one program
# per (sequence, head, chunk), by 16 x 16 blocks); ``_chunk_scan_kernel`` then
# walks the chunks of one (sequence, head, tile of ``BV`` value columns) in order, carrying
# its [Dk, BV] slice of the state in registers: every chunk is six small matrix products.
#
# Not used by the engine yet (it runs the torch rule). On an H200, 32 heads of 128, float32
# inputs (docs/PERFORMANCE.md): with TF32 products (``tf32=True``, max error 1e-3 - 3e-3) 3.7x
# faster than the torch rule for one 1,024-token prompt, 0.85-0.92x for batches (8 x 512,
# 32 x 256, 64 x 1,024); with float32 products 0.16-0.78x. The first version's row-by-row
# 64 x 64 solve took 5.4 ms at 8 x 512; this one solves 16 x 16 blocks and merges them.

if triton is not None:

    @triton.jit
    def _block_in(K, BETA, G, s, h, first, L, DK, s_ks, s_kl, s_kh, s_bs, s_bl, s_bh, BK: tl.constexpr):
        """Keys [16, BK], betas and log-decays [16] of the 16 positions from ``first``."""
        t = tl.arange(0, 16)
        pos = first + t
        valid = pos < L
        dk = tl.arange(0, BK)
        k = tl.load(K + s * s_ks + pos[:, None] * s_kl + h * s_kh + dk[None, :],
                    mask=valid[:, None] & (dk[None, :] < DK), other=0.0)
        beta = tl.load(BETA + s * s_bs + pos * s_bl + h * s_bh, mask=valid, other=0.0)
        g = tl.load(G + s * s_bs + pos * s_bl + h * s_bh, mask=valid, other=0.0)
        return k, beta, g

    @triton.jit
    def _a_block(k_i, k_j, beta_i, c_i, c_j, DIAG: tl.constexpr):
        """Block (i, j) of ``A``: ``beta_r exp(c_r - c_s) k_r . k_s`` for rows r after columns s."""
        t = tl.arange(0, 16)
        later = (t[:, None] > t[None, :]) if DIAG else (t[:, None] >= 0)
        decay = tl.exp(tl.where(later, c_i[:, None] - c_j[None, :], 0.0))
        return tl.where(later, beta_i[:, None] * decay * tl.dot(k_i, tl.trans(k_j), input_precision="ieee"), 0.0)

    @triton.jit
    def _inv_unit_lower(a):
        """``(I + a)^-1`` of a strictly lower [16, 16] ``a``, row by row (rows >= i still zero)."""
        t = tl.arange(0, 16)
        inv = tl.zeros([16, 16], tl.float32)
        for i in range(16):
            a_i = tl.sum(tl.where(t[:, None] == i, a, 0.0), axis=0)
            row = tl.where(t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * inv, axis=0)
            inv = tl.where(t[:, None] == i, row[None, :], inv)
        return inv

    @triton.jit
    def _mm(a, b):
        return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _chunk_solve_kernel(
        K, BETA, G, T, CUM,
        s_ks, s_kl, s_kh, s_bs, s_bl, s_bh, s_ts, s_th, s_tc, s_cs, s_ch,
        L, DK,
        BK: tl.constexpr,
    ):
        """One 64-position chunk: ``T = (I + A)^-1`` by 16 x 16 blocks (the diagonal blocks
        inverted row by row, the blocks below from ``X_ij = -X_ii sum_k A_ik X_kj``) and the
        cumulative log-decays ``c``."""
        s = tl.program_id(0)
        h = tl.program_id(1)
        ch = tl.program_id(2)
        first = ch * 64
        args = (L, DK, s_ks, s_kl, s_kh, s_bs, s_bl, s_bh)
        k0, b0, g0 = _block_in(K, BETA, G, s, h, first, *args, BK)
        k1, b1, g1 = _block_in(K, BETA, G, s, h, first + 16, *args, BK)
        k2, b2, g2 = _block_in(K, BETA, G, s, h, first + 32, *args, BK)
        k3, b3, g3 = _block_in(K, BETA, G, s, h, first + 48, *args, BK)
        # padding: g = 0 carries the last real decay on
        c0 = tl.cumsum(g0, axis=0)
        c1 = tl.cumsum(g1, axis=0) + tl.sum(g0, axis=0)
        c2 = tl.cumsum(g2, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0)
        c3 = tl.cumsum(g3, axis=0) + tl.sum(g0, axis=0) + tl.sum(g1, axis=0) + tl.sum(g2, axis=0)
        x00 = _inv_unit_lower(_a_block(k0, k0, b0, c0, c0, True))
        x11 = _inv_unit_lower(_a_block(k1, k1, b1, c1, c1, True))
        x22 = _inv_unit_lower(_a_block(k2, k2, b2, c2, c2, True))
        x33 = _inv_unit_lower(_a_block(k3, k3, b3, c3, c3, True))
        a10 = _a_block(k1, k0, b1, c1, c0, False)
        a20 = _a_block(k2, k0, b2, c2, c0, False)
        a21 = _a_block(k2, k1, b2, c2, c1, False)
        a30 = _a_block(k3, k0, b3, c3, c0, False)
        a31 = _a_block(k3, k1, b3, c3, c1, False)
        a32 = _a_block(k3, k2, b3, c3, c2, False)
        x10 = -_mm(x11, _mm(a10, x00))
        x21 = -_mm(x22, _mm(a21, x11))
        x20 = -_mm(x22, _mm(a20, x00) + _mm(a21, x10))
        x32 = -_mm(x33, _mm(a32, x22))
        x31 = -_mm(x33, _mm(a31, x11) + _mm(a32, x21))
        x30 = -_mm(x33, _mm(a30, x00) + _mm(a31, x10) + _mm(a32, x20))
        t = tl.arange(0, 16)
        base = T + s * s_ts + h * s_th + ch * s_tc
        zero = tl.zeros([16, 16], tl.float32)
        rows = (x00, zero, zero, zero, x10, x11, zero, zero, x20, x21, x22, zero, x30, x31, x32, x33)
        for i in tl.static_range(4):
            for j in tl.static_range(4):
                tl.store(base + (i * 16 + t)[:, None] * 64 + (j * 16 + t)[None, :], rows[i * 4 + j])
        cum = CUM + s * s_cs + h * s_ch + first + t
        tl.store(cum, c0)
        tl.store(cum + 16, c1)
        tl.store(cum + 32, c2)
        tl.store(cum + 48, c3)

    @triton.jit
    def _chunk_scan_kernel(
        Q, K, V, BETA, T, CUM, OUT, STATE,
        s_ks, s_kl, s_kh, s_vs, s_vl, s_vh, s_bs, s_bl, s_bh, s_ts, s_th, s_tc, s_cs, s_ch,
        s_os, s_ol, s_oh, s_ss, s_sh, s_sk,
        L, DK, DV, CHUNKS,
        C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr = "ieee",
    ):
        s = tl.program_id(0)
        h = tl.program_id(1)
        t = tl.arange(0, C)
        dk = tl.arange(0, BK)
        dv = tl.program_id(2) * BV + tl.arange(0, BV)
        mk = dk < DK
        mv = dv < DV
        causal = t[:, None] >= t[None, :]
        state = tl.zeros([BK, BV], tl.float32)  # S[:, this tile] before the chunk
        for ch in range(CHUNKS):
            pos = ch * C + t
            valid = pos < L
            qk_off = s * s_ks + pos[:, None] * s_kl + h * s_kh + dk[None, :]
            m_qk = valid[:, None] & mk[None, :]
            q = tl.load(Q + qk_off, mask=m_qk, other=0.0)
            k = tl.load(K + qk_off, mask=m_qk, other=0.0)
            v = tl.load(V + s * s_vs + pos[:, None] * s_vl + h * s_vh + dv[None, :],
                        mask=valid[:, None] & mv[None, :], other=0.0)
            beta = tl.load(BETA + s * s_bs + pos * s_bl + h * s_bh, mask=valid, other=0.0)
            c = tl.load(CUM + s * s_cs + h * s_ch + ch * C + t)
            inv = tl.load(T + s * s_ts + h * s_th + ch * s_tc + t[:, None] * C + t[None, :])
            last = tl.sum(tl.where(t == C - 1, c, 0.0), axis=0)
            # u = (I + A)^-1 (beta v - beta exp(c) K S)
            rhs = beta[:, None] * v - tl.dot(k * (beta * tl.exp(c))[:, None], state, input_precision=DOT)
            u = tl.dot(inv, rhs, input_precision=DOT)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT)
            qk = tl.where(causal, qk * tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0)), 0.0)
            o = tl.dot(q * tl.exp(c)[:, None], state, input_precision=DOT) + tl.dot(qk, u, input_precision=DOT)
            tl.store(OUT + s * s_os + pos[:, None] * s_ol + h * s_oh + dv[None, :], o,
                     mask=valid[:, None] & mv[None, :])
            k_out = k * tl.exp(last - c)[:, None]
            state = state * tl.exp(last) + tl.dot(tl.trans(k_out), u, input_precision=DOT)
        tl.store(STATE + s * s_ss + h * s_sh + dk[:, None] * s_sk + dv[None, :], state,
                 mask=mk[:, None] & mv[None, :])


#: the scan kernel's launch options: two pipeline stages keep its shared memory (~149 KB at
#: head dims 128) under a Hopper block's 227 KB (three took 235 KB: refused at launch)
SCAN_LAUNCH = {"num_warps": 8, "num_stages": 2}


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                    tf32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunked_delta_rule`` (engines/models/linear_attention.py) in Triton: ``q, k`` [S, L, H, Dk],
    ``v`` [S, L, H, Dv], ``beta, g`` [S, L, H], all float32, from a zero state. Returns
    (outputs [S, L, H, Dv], final states [S, H, Dk, Dv]), float32. Chunks of 64 positions.
    ``tf32``: the scan's matrix products on TF32 tensor cores (10-bit mantissas: for inputs
    that come from bf16 or fp16 activations, which carry 7 or 10 bits); else float32."""
    s, length, h, dk = k.shape
    dv = v.shape[-1]
    assert q.shape == k.shape and v.shape[:3] == k.shape[:3] and beta.shape == g.shape == k.shape[:3]
    assert all(x.dtype == torch.float32 for x in (q, k, v, beta, g)), "chunked_prefill takes float32"
    q, k, v, beta, g = (x.contiguous() for x in (q, k, v, beta, g))
    chunk = 64
    chunks = triton.cdiv(length, chunk)
    inv = torch.empty((s, h, chunks, chunk, chunk), dtype=torch.float32, device=k.device)
    cum = torch.empty((s, h, chunks * chunk), dtype=torch.float32, device=k.device)
    bk = max(16, triton.next_power_of_2(dk))
    _chunk_solve_kernel[(s, h, chunks)](
        k, beta, g, inv, cum,
        k.stride(0), k.stride(1), k.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
        inv.stride(0), inv.stride(1), inv.stride(2), cum.stride(0), cum.stride(1),
        length, dk, BK=bk, num_warps=4,
    )
    out = torch.empty_like(v)
    state = torch.empty((s, h, dk, dv), dtype=torch.float32, device=k.device)
    bv = min(max(16, triton.next_power_of_2(dv)), 32)
    _chunk_scan_kernel[(s, h, triton.cdiv(dv, bv))](
        q, k, v, beta, inv, cum, out, state,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2), inv.stride(0), inv.stride(1), inv.stride(2),
        cum.stride(0), cum.stride(1), out.stride(0), out.stride(1), out.stride(2),
        state.stride(0), state.stride(1), state.stride(2),
        length, dk, dv, chunks, C=chunk, BK=bk, BV=bv, DOT="tf32" if tf32 else "ieee", **SCAN_LAUNCH,
    )
    return out, state
