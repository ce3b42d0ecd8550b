"""Decode attention over the paged KV cache.

``paged_decode_attention`` computes, for every sequence in a decode batch, the attention of
its one new query token over its whole context, reading keys and values directly from the
cache blocks its block table names (no gather into a contiguous copy). On CUDA with Triton
it runs one fused kernel (flash-decoding style online softmax, one program per (sequence,
KV head), all query heads of a GQA group together); elsewhere a torch reference with the
same contract runs. The kernel can also run under Triton's interpreter
(``TRITON_INTERPRET=1``, CPU tensors), which is how CPU CI checks it against the reference.

Contract (both paths):
    q             [B, H, D]                  query of each sequence's new token
    k/v_cache     [N, P, KVH, D]             N blocks of P token slots
    block_tables  [B, W] int32               block ids of each sequence (row-major context)
    context_lens  [B] int32 (>= 1)           tokens of context, including the new one
    returns       [B, H, D]                  in q's dtype; softmax scale ``scale``
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton ships with CUDA builds of torch; on CPU it is optional (interpreter tests).
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
if triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
    from engines.kernels.triton_interpreter import skip_nested_language_patches

    skip_nested_language_patches()


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernel runs for tensors on ``device`` (CUDA, or the interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def pdl_enabled(device: torch.device) -> bool:
    """Whether the decode step's Triton kernels launch as programmatic dependents on
    ``device`` (each may start while the kernel before it finishes, and waits for it with
    ``gdc_wait`` before reading anything that kernel may have written): CUDA of compute
    capability 9 or more (Hopper) with a Triton that has ``gdc_wait`` (3.3 and later), unless
    ``RELAY_DECODE_PDL=0`` (listed in engines/settings.py; read here, as the kernels import
    no other concept)."""
    if device.type != "cuda" or os.environ.get("RELAY_DECODE_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9 and _triton_has_gdc()


@functools.cache
def _triton_has_gdc() -> bool:
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def pdl_launch(device: torch.device) -> dict:
    """The launch arguments of a kernel with a ``PDL`` switch (see :func:`pdl_enabled`)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}


def launch_or_fall_back(ok: list, what: str, kernel, grid, *args, **meta) -> bool:
    """Launch ``kernel[grid](*args, **meta)``; where it cannot compile or run here (never for
    out-of-memory, which is raised), set ``ok[0]`` False (the module's later calls take its
    torch path), say so once on stderr and return False."""
    try:
        kernel[grid](*args, **meta)
        return True
    except Exception as e:  # noqa: BLE001 - a compile/launch failure: the torch path is exact too
        if isinstance(e, torch.OutOfMemoryError):
            raise
        import sys

        ok[0] = False
        print(f"relay trainer: the fused {what} kernel cannot run here ({type(e).__name__}: {str(e)[:300]}); "
              "using the torch path", file=sys.stderr, flush=True)
        return False


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, context_lens, scale: float, use_triton: bool | None = None
):
    if use_triton is None:
        use_triton = triton_usable(q.device)
    if use_triton:
        return _triton_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale: float):
    """Torch reference: gathers each sequence's blocks, masks past its length. Slots past a
    length are zeroed after the gather: the cache is not initialised, and a NaN there would
    reach the output through the masked scores (NaN + -inf)."""
    b, h, d = q.shape
    n, page, kvh, _ = k_cache.shape
    width = block_tables.shape[1]
    tables = block_tables.reshape(-1).long()
    mask = torch.arange(width * page, device=q.device)[None, :] < context_lens.long()[:, None]
    keep = mask[:, None, :, None]
    keys = k_cache.view(n, -1).index_select(0, tables).view(b, width * page, kvh, d).transpose(1, 2)  # [B, KVH, ctx, D]
    keys = keys.masked_fill(~keep, 0)
    vals = v_cache.view(n, -1).index_select(0, tables).view(b, width * page, kvh, d).transpose(1, 2)
    vals = vals.masked_fill(~keep, 0)
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None, :],
        keys.to(q.dtype),
        vals.to(q.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :]


if triton is not None:

    @triton.jit
    def _decode_kernel(Q, K, V, BT, LENS, OUT, ML, PART, scale, s_qb, s_qh, s_kn, s_kt, s_kh, s_btb, s_ob, s_oh,
                       GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
                       PAGE: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr,
                       PDL: tl.constexpr):
        if PDL:  # a programmatic dependent launch (pdl_launch): nothing read before the wait
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        length = tl.load(LENS + seq)
        # split ``split`` of SPLITS takes consecutive tiles of the context (all of it when 1)
        split = tl.program_id(2)
        per = tl.cdiv(tl.cdiv(length, TILE), SPLITS) * TILE
        lo = split * per
        hi = tl.minimum(lo + per, length)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D_P)
        gmask = g < GROUP
        dmask = d < D
        heads = kvh * GROUP + g
        q = tl.load(
            Q + seq * s_qb + heads[:, None] * s_qh + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0
        )
        t = tl.arange(0, TILE)
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D_P], tl.float32)
        for start in range(lo, hi, TILE):
            pos = start + t
            valid = pos < hi
            block = tl.load(BT + seq * s_btb + pos // PAGE, mask=valid, other=0).to(tl.int64)
            off = block * s_kn + (pos % PAGE) * s_kt + kvh * s_kh
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(K + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V + off[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(
                OUT + seq * s_ob + heads[:, None] * s_oh + d[None, :],
                out.to(OUT.dtype.element_ty),
                mask=gmask[:, None] & dmask[None, :],
            )
        else:  # this split's softmax max, sum and normalised output, for _combine_kernel
            row = (seq * (tl.num_programs(1) * GROUP) + heads) * SPLITS + split
            tl.store(ML + row * 2, m_i, mask=gmask)
            tl.store(ML + row * 2 + 1, l_i, mask=gmask)
            part = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
            tl.store(PART + row[:, None] * D + d[None, :], part, mask=gmask[:, None] & dmask[None, :])

    @triton.jit
    def _combine_kernel(ML, PART, OUT, s_ob, s_oh, H, D: tl.constexpr, D_P: tl.constexpr, SPLITS: tl.constexpr,
                        SPLITS_P: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        seq = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS_P)
        d = tl.arange(0, D_P)
        smask = s < SPLITS
        row = (seq * H + head) * SPLITS + s
        m = tl.load(ML + row * 2, mask=smask, other=float("-inf"))
        l_s = tl.load(ML + row * 2 + 1, mask=smask, other=0.0)
        w = tl.where(l_s > 0, tl.exp(m - tl.max(m, axis=0)) * l_s, 0.0)  # an empty split weighs nothing
        part = tl.load(PART + row[:, None] * D + d[None, :], mask=smask[:, None] & (d < D)[None, :], other=0.0)
        out = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
        tl.store(OUT + seq * s_ob + head * s_oh + d, out.to(OUT.dtype.element_ty), mask=d < D)


#: split the context of each (sequence, KV head) over at most this many programs when there
#: are few of them (flash-decoding)
DECODE_SPLITS = 16
#: a block table spanning more tokens than this is a long context: its decode attention aims
#: for ``PROGRAMS_PER_SM`` programs an SM (one program reading 8k positions alone keeps its SM
#: far from its share of the read bandwidth); shorter ones split only when the batch has few
#: (sequence, KV head) programs, as measured at 128-token prompts (docs/PERFORMANCE.md)
LONG_CONTEXT_TOKENS = 2048
PROGRAMS_PER_SM = 8
#: a long context splits over at most this many programs (batch 1 of 8 KV heads at 8,192
#: positions on an H100: 32 splits read at 59% of the bandwidth, 16 at 45%; batch 2 a few %
#: faster, batch 4 alike: benchmarks/decode_kernel_sweep.py, docs/PERFORMANCE.md)
LONG_DECODE_SPLITS = 32


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's SM count (4 off CUDA: the interpreter's stand-in)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def decode_splits(rows: int, kv_heads: int, device: torch.device, span: int = 0) -> int:
    """The context splits of a decode batch of ``rows`` sequences whose block tables span
    ``span`` tokens (their width times the page). Short spans: ``DECODE_SPLITS`` when the
    (sequence, KV head) programs are at most a quarter of the SMs, else 1. Long spans
    (over ``LONG_CONTEXT_TOKENS``): the largest power of two, at most ``LONG_DECODE_SPLITS``, that
    keeps the (sequence, KV head, split) programs within ``PROGRAMS_PER_SM`` an SM; splits
    past a sequence's length are empty (they return at once). Programs are counted at the
    next power of two of ``rows``, so that a CUDA graph's padded batch (the graph buckets
    hold every power of two) splits as the same rows' eager batch does; the model runner
    captures short and long tables apart (engines/builtin/model_runner.py)."""
    programs = triton.next_power_of_2(rows) * kv_heads
    if span <= LONG_CONTEXT_TOKENS:
        return DECODE_SPLITS if programs * 4 <= multiprocessors(device) else 1
    room = PROGRAMS_PER_SM * multiprocessors(device) // programs
    return max(1, min(LONG_DECODE_SPLITS, 1 << (room.bit_length() - 1) if room else 1))


def decode_config(rows: int, kv_heads: int, device: torch.device) -> tuple[int, int, int]:
    """(context positions a tile, warps, pipeline stages) of an unsplit decode batch: with at
    least 8 (sequence, KV head) programs an SM (counted at the next power of two of ``rows``,
    as :func:`decode_splits`) 2 warps a program, else 4 (batch 64 was slower with 2). On an
    H200 at batch 256 (docs/PERFORMANCE.md): 2 warps 3-4% faster than 4 at contexts of 128-384
    mixed, as fast as tiles of 32 at an even 256 and 3% faster than them mixed."""
    if triton.next_power_of_2(rows) * kv_heads >= 8 * multiprocessors(device):
        return 64, 2, 3
    return 64, 4, 3


def split_config(splits: int) -> tuple[int, int, int]:
    """(tile, warps, stages) of a split decode: 8 warps at ``LONG_DECODE_SPLITS`` splits (batch 1
    at 8,192 positions, H100: as fast as the best choice swept, 24% faster than 4 warps), else
    4 (tuned at batch 1 of short contexts)."""
    return (64, 8, 3) if splits >= LONG_DECODE_SPLITS else (64, 4, 3)


def _triton_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, splits: int | None = None,
                   config: tuple[int, int, int] | None = None):
    """The Triton decode attention; ``splits`` and ``config`` ((tile, warps, stages)) override
    the tuned choices (benchmarks/decode_kernel_sweep.py)."""
    b, h, d = q.shape
    _, page, kvh, _ = k_cache.shape
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} KV heads")
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "paged_decode_attention: q and the caches must be contiguous in the head dimension, k and v alike"
        )
    group = h // kvh
    out = torch.empty_like(q)
    ieee = q.dtype == torch.float32
    splits = decode_splits(b, kvh, q.device, block_tables.shape[1] * page) if splits is None else splits
    ml = part = out
    if splits > 1:
        ml = torch.empty((b, h, splits, 2), dtype=torch.float32, device=q.device)
        part = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    d_p = max(16, triton.next_power_of_2(d))
    if config is None:
        config = decode_config(b, kvh, q.device) if splits == 1 else split_config(splits)
    tile, warps, stages = config
    _decode_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, ml, part, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), D=d, D_P=d_p, PAGE=page, TILE=tile, IEEE=ieee,
        SPLITS=splits, num_warps=warps, num_stages=stages, **pdl_launch(q.device),
    )
    if splits > 1:
        _combine_kernel[(b, h)](ml, part, out, out.stride(0), out.stride(1), h, D=d, D_P=d_p, SPLITS=splits,
                                SPLITS_P=triton.next_power_of_2(splits), num_warps=1, **pdl_launch(q.device))
    return out


# ---------------------------------------------------------------------- fused decode-step ops
#
# On CUDA a decode step is dozens of tiny kernels per layer; these fuse the elementwise
# chains (RMSNorm; residual add + RMSNorm; q/k RMSNorm + rotary embedding; SiLU-and-multiply)
# into one kernel each. Numerics follow the torch/HF code: statistics in float32, the
# normalised activations rounded to the model dtype before the weight multiply.

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, R, W, Y, S, s_x, s_r, s_y, s_s, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * s_x + cols, mask=mask, other=0.0)
        if HAS_RES:  # s = x + r (rounded to the model dtype, as torch adds), then normalise s
            x = (x.to(tl.float32) + tl.load(R + row * s_r + cols, mask=mask, other=0.0).to(tl.float32)).to(
                X.dtype.element_ty
            )
            tl.store(S + row * s_s + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n
        normed = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
        w = tl.load(W + cols, mask=mask, other=0.0)
        tl.store(Y + row * s_y + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_rope_kernel(
        X,
        W,
        POS,
        INV,
        Y,
        s_xb,
        s_xh,
        s_yb,
        s_yh,
        eps,
        HEADS: tl.constexpr,
        D: tl.constexpr,
        HALF_P: tl.constexpr,
        NORM: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid // HEADS
        h = pid % HEADS
        half: tl.constexpr = D // 2
        i = tl.arange(0, HALF_P)
        mask = i < half
        out1, out2 = normed_rotated(X + b * s_xb + h * s_xh, W, tl.load(POS + b), INV, eps, D, HALF_P, NORM)
        out = Y + b * s_yb + h * s_yh
        tl.store(out + i, out1.to(Y.dtype.element_ty), mask=mask)
        tl.store(out + half + i, out2.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def normed_rotated(base, W, pos, INV, eps, D: tl.constexpr, HALF_P: tl.constexpr, NORM: tl.constexpr):
        """One head at ``base`` (D values, rotate-half convention) as its float32 halves: when
        ``NORM``, RMSNorm with weight ``W`` (statistics in float32, the normalised values
        rounded to the input's dtype before the weight, as torch); then the rotary embedding
        at position ``pos``."""
        half: tl.constexpr = D // 2
        i = tl.arange(0, HALF_P)
        mask = i < half
        x1 = tl.load(base + i, mask=mask, other=0.0)
        x2 = tl.load(base + half + i, mask=mask, other=0.0)
        if NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            r = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
            w1 = tl.load(W + i, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(W + half + i, mask=mask, other=0.0).to(tl.float32)
            x1 = (w1 * (f1 * r).to(x1.dtype).to(tl.float32)).to(x1.dtype)
            x2 = (w2 * (f2 * r).to(x2.dtype).to(tl.float32)).to(x2.dtype)
        angle = pos.to(tl.float32) * tl.load(INV + i, mask=mask, other=0.0)
        c = tl.cos(angle)
        s = tl.sin(angle)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        return f1 * c - f2 * s, f2 * c + f1 * s

    @triton.jit
    def _silu_mul_kernel(G, U, Y, s_g, s_u, s_y, n, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(G + row * s_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * s_u + cols, mask=mask, other=0.0)
        silu = (g / (1.0 + tl.exp(-g))).to(U.dtype.element_ty)  # torch rounds silu(g), then multiplies
        tl.store(Y + row * s_y + cols, (silu.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``weight * normalise(x)`` over the last dim of ``x`` [N, D]; with ``residual``,
    normalises ``x + residual`` and returns ``(normed, x + residual)``."""
    n = x.shape[-1]
    y = torch.empty_like(x)
    s = torch.empty_like(x) if residual is not None else y
    r = residual if residual is not None else x
    _rms_norm_kernel[(x.shape[0],)](
        x,
        r,
        weight,
        y,
        s,
        x.stride(0),
        r.stride(0),
        y.stride(0),
        s.stride(0),
        n,
        eps,
        HAS_RES=residual is not None,
        BLOCK=triton.next_power_of_2(n),
        num_warps=4,
    )
    return (y, s) if residual is not None else y


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float
):
    """Per head of ``x`` [B, H, D]: RMSNorm with ``weight`` (skipped when None), then the
    rotary embedding at ``positions`` [B] (rotate-half convention, ``inv_freq`` [D/2])."""
    b, h, d = x.shape
    y = torch.empty((b, h, d), dtype=x.dtype, device=x.device)
    _norm_rope_kernel[(b * h,)](
        x,
        weight if weight is not None else x,
        positions,
        inv_freq,
        y,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
        eps,
        HEADS=h,
        D=d,
        HALF_P=triton.next_power_of_2(d // 2),
        NORM=weight is not None,
        num_warps=1,
    )
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for [N, F] tensors."""
    n = gate.shape[-1]
    y = torch.empty_like(up)
    block = 1024
    _silu_mul_kernel[(gate.shape[0], triton.cdiv(n, block))](
        gate, up, y, gate.stride(0), up.stride(0), y.stride(0), n, BLOCK=block, num_warps=4
    )
    return y
