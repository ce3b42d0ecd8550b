"""Decode attention over the paged KV cache.

``paged_decode_attention`` computes, for every sequence in a decode batch, the attention of
its one new query token over its whole context, reading keys and values directly from the
cache blocks its block table names (no gather into a contiguous copy). On CUDA with Triton
it runs one kernel (flash-decoding style online softmax, one program per (sequence, KV head),
all query heads of a GQA group together); elsewhere a torch reference with the same contract
runs. The kernel also runs under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors),
which is how CPU CI checks it against the reference.

``rope_decode_attention`` is the same kernel taking a decode step's packed q/k/v projections
instead of ready queries: each program RMS-normalises and rotates its query heads and the new
token's key itself, writes that key and value into the token's cache slot and attends over
the cached context plus the new token (what took a kernel of its own before each attention).

When a batch has few (sequence, KV head) pairs the context of each is split over several
programs (:func:`decode_splits`); the last program of a pair to finish (an atomic counter per
pair) combines the splits' partial softmaxes, so a step is one kernel either way.

Contract (both paths of ``paged_decode_attention``):
    q             [B, H, D]                  query of each sequence's new token
    k/v_cache     [N, P, KVH, D]             N blocks of P token slots
    block_tables  [B, W] int32               block ids of each sequence (row-major context)
    context_lens  [B] int32 (>= 1)           tokens of context, including the new one
    returns       [B, H, D]                  in q's dtype; softmax scale ``scale``
"""

from __future__ import annotations

import torch

from .kernels import multiprocessors, triton, triton_usable

#: split the context of each (sequence, KV head) over this many programs when there are few
#: of them (flash-decoding): a batch of 1-4 sequences has too few to keep the GPU reading
DECODE_SPLITS = 16


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
    import triton.language as tl

    @triton.jit
    def _dims(j, HALF: tl.constexpr, HALF_P: tl.constexpr):
        """Column ``j`` of the "halves" layout: dims [0, D/2) then [D/2, D), each padded to
        ``HALF_P`` columns (so a rotation partner is ``HALF_P`` columns away): its head dim
        and whether it holds one."""
        if HALF == HALF_P:
            dim = j
            held = j < 2 * HALF
        else:
            dim = (j % HALF_P) + (j // HALF_P) * HALF
            held = (j % HALF_P) < HALF
        return dim, held

    @triton.jit
    def _normed_rotated(x, p, w, wp, cos, sin, sign, eps, D: tl.constexpr, NORM: tl.constexpr):
        """Heads ``x`` [R, C] in the halves layout (``p``: each column's rotation partner;
        ``w``/``wp``: the norm weight at both): RMSNorm when ``NORM`` (statistics in float32,
        the normalised values rounded to the input's dtype before the weight, as torch), then
        the rotary embedding (rotate-half); float32 [R, C]."""
        if NORM:
            xf = x.to(tl.float32)
            r = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
            x = (w.to(tl.float32)[None, :] * (xf * r).to(x.dtype).to(tl.float32)).to(x.dtype)
            p = (wp.to(tl.float32)[None, :] * (p.to(tl.float32) * r).to(p.dtype).to(tl.float32)).to(p.dtype)
        return x.to(tl.float32) * cos[None, :] + sign[None, :] * p.to(tl.float32) * sin[None, :]

    @triton.jit
    def _decode_kernel(Q, QW, KW, POS, INV, SLOTS, K, V, BT, LENS, OUT, ML, PART, CNT, scale, eps,
                       s_qb, s_qh, s_kn, s_kt, s_kh, s_btb, s_ob, s_oh,
                       H: tl.constexpr, KVH: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
                       D: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr, PAGE: tl.constexpr,
                       TILE: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
                       ROPE: tl.constexpr, NORM: tl.constexpr):
        # Every load that does not need another's result is issued first, together: at small
        # batches a program's time is a few dependent memory round trips, not bandwidth.
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)  # split ``split`` of SPLITS takes consecutive tiles of the context
        g = tl.arange(0, GROUP_P)
        gmask = g < GROUP
        heads = kvh * GROUP + g
        d = tl.arange(0, D_P)
        dmask = d < D
        HALF: tl.constexpr = D // 2
        j = tl.arange(0, 2 * HALF_P)  # query/key columns in the halves layout (see _dims)
        dim, cmask = _dims(j, HALF, HALF_P)
        qmask = gmask[:, None] & cmask[None, :]
        row = Q + seq * s_qb
        length = tl.load(LENS + seq)
        if ROPE:  # Q is the packed q/k/v row: q heads, then k heads, then v heads (s_qh = D)
            partner, _ = _dims((j + HALF_P) % (2 * HALF_P), HALF, HALF_P)
            qx = tl.load(row + heads[:, None] * s_qh + dim[None, :], mask=qmask, other=0.0)
            qp = tl.load(row + heads[:, None] * s_qh + partner[None, :], mask=qmask, other=0.0)
            krow = row + (H + kvh) * D
            kx = tl.load(krow + dim[None, :], mask=cmask[None, :], other=0.0)
            kp = tl.load(krow + partner[None, :], mask=cmask[None, :], other=0.0)
            vn = tl.load(row + (H + KVH + kvh) * D + d, mask=dmask, other=0.0).to(V.dtype.element_ty)
            qw = tl.load(QW + dim, mask=cmask, other=0.0) if NORM else qx
            qwp = tl.load(QW + partner, mask=cmask, other=0.0) if NORM else qx
            kw = tl.load(KW + dim, mask=cmask, other=0.0) if NORM else qx
            kwp = tl.load(KW + partner, mask=cmask, other=0.0) if NORM else qx
            inv = tl.load(INV + (j % HALF_P), mask=cmask, other=0.0)
            pos = tl.load(POS + seq)
            slot = tl.load(SLOTS + seq).to(tl.int64)
            angle = pos.to(tl.float32) * inv
            cos = tl.cos(angle)
            sin = tl.sin(angle)
            sign = tl.where(j < HALF_P, -1.0, 1.0)
            q = _normed_rotated(qx, qp, qw, qwp, cos, sin, sign, eps, D, NORM).to(Q.dtype.element_ty)
            kn = _normed_rotated(kx, kp, kw, kwp, cos, sin, sign, eps, D, NORM).to(K.dtype.element_ty)
        else:
            q = tl.load(row + heads[:, None] * s_qh + dim[None, :], mask=qmask, other=0.0)
        per = tl.cdiv(tl.cdiv(length, TILE), SPLITS) * TILE
        lo = split * per
        hi = tl.minimum(lo + per, length)
        if ROPE:
            # the new token (position length - 1) comes from the projections, not the cache: the
            # split that holds it writes it to its slot and starts its softmax with it
            owner = (lo < length) & (length <= hi)
            cached = tl.minimum(hi, length - 1)
            if owner:
                tl.store(K + slot * s_kt + kvh * s_kh + dim[None, :], kn, mask=cmask[None, :])
                tl.store(V + slot * s_kt + kvh * s_kh + d, vn, mask=dmask)
            s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32), axis=1) * scale
            m_i = tl.where(owner, s_new, float("-inf"))
            l_i = tl.where(owner, 1.0, 0.0) + tl.zeros([GROUP_P], tl.float32)
            acc = tl.where(owner, vn.to(tl.float32)[None, :] + tl.zeros([GROUP_P, D_P], tl.float32), 0.0)
        else:
            cached = hi
            m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
            l_i = tl.zeros([GROUP_P], tl.float32)
            acc = tl.zeros([GROUP_P, D_P], tl.float32)
        t = tl.arange(0, TILE)
        for start in range(lo, cached, TILE):
            pos_t = start + t
            valid = pos_t < cached
            block = tl.load(BT + seq * s_btb + pos_t // PAGE, mask=valid, other=0).to(tl.int64)
            off = block * s_kn + (pos_t % PAGE) * s_kt + kvh * s_kh
            k = tl.load(K + off[:, None] + dim[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
            v = tl.load(V + off[:, None] + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        omask = gmask[:, None] & dmask[None, :]
        if SPLITS == 1:
            tl.store(OUT + seq * s_ob + heads[:, None] * s_oh + d[None, :], (acc / l_i[:, None]).to(
                OUT.dtype.element_ty), mask=omask)
        else:  # this split's softmax max, sum and normalised output; the pair's last split combines
            rows = (seq * H + heads) * SPLITS + split
            tl.store(ML + rows * 2, m_i, mask=gmask)
            tl.store(ML + rows * 2 + 1, l_i, mask=gmask)
            part = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
            tl.store(PART + rows[:, None] * D + d[None, :], part, mask=omask)
            tl.debug_barrier()  # every thread's stores before the release below
            if tl.atomic_add(CNT + seq * KVH + kvh, 1, sem="acq_rel") == SPLITS - 1:
                sp = tl.arange(0, SPLITS_P)
                smask = sp < SPLITS
                for i in tl.static_range(GROUP):  # each head: its splits' partials, loaded at once
                    hrow = (seq * H + kvh * GROUP + i) * SPLITS + sp
                    m = tl.load(ML + hrow * 2, mask=smask, other=float("-inf"), cache_modifier=".cg")
                    ls = tl.load(ML + hrow * 2 + 1, mask=smask, other=0.0, cache_modifier=".cg")
                    parts = tl.load(PART + hrow[:, None] * D + d[None, :], mask=smask[:, None] & dmask[None, :],
                                    other=0.0, cache_modifier=".cg")
                    w = tl.where(ls > 0, tl.exp(m - tl.max(m, axis=0)) * ls, 0.0)  # an empty split weighs 0
                    out = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
                    tl.store(OUT + seq * s_ob + (kvh * GROUP + i) * s_oh + d, out.to(OUT.dtype.element_ty),
                             mask=dmask)


def decode_splits(rows: int, kv_heads: int, device: torch.device) -> int:
    """The context splits of a decode batch of ``rows`` sequences: ``DECODE_SPLITS`` when its
    (sequence, KV head) programs, counted at the next power of two of ``rows``, are at most a
    quarter of the SMs, else 1. A function of the power of two so that a CUDA graph's padded
    batch (the graph buckets hold every power of two) splits as the same rows' eager batch
    does; batches of other sizes may split otherwise, and round differently."""
    return DECODE_SPLITS if triton.next_power_of_2(rows) * kv_heads * 4 <= multiprocessors(device) else 1


def split_counters(b: int, kv_heads: int, device: torch.device, layers: int = 1) -> torch.Tensor | None:
    """The zeroed per-(sequence, KV head) counters the splits of ``layers`` decode attentions
    of a batch of ``b`` need ([layers, b * kv_heads] int32: one allocation and fill a step, one
    row per layer), or None when such a batch does not split."""
    if decode_splits(b, kv_heads, device) == 1:
        return None
    return torch.zeros((layers, b * kv_heads), dtype=torch.int32, device=device)


def _launch(q_or_qkv, heads: int, k_cache, v_cache, block_tables, context_lens, scale: float, splits: int | None,
            counters: torch.Tensor | None, rope: tuple | None, launch: tuple[int, int, int] | None = None):
    b = q_or_qkv.shape[0]
    tile, warps, stages = launch or (64, 4, 3)  # context positions a loop step, warps, pipeline stages
    _, page, kvh, d = k_cache.shape
    if heads % kvh:
        raise ValueError(f"{heads} query heads are not a multiple of {kvh} KV heads")
    if d % 2:
        raise ValueError(f"decode attention needs an even head dim, not {d}")
    if k_cache.stride(-1) != 1 or q_or_qkv.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "paged_decode_attention: q and the caches must be contiguous in the head dimension, k and v alike"
        )
    out = torch.empty((b, heads, d), dtype=q_or_qkv.dtype, device=q_or_qkv.device)
    splits = decode_splits(b, kvh, out.device) if splits is None else splits
    ml = part = cnt = out
    if splits > 1:
        ml = torch.empty((b, heads, splits, 2), dtype=torch.float32, device=out.device)
        part = torch.empty((b, heads, splits, d), dtype=torch.float32, device=out.device)
        cnt = counters if counters is not None else torch.zeros(b * kvh, dtype=torch.int32, device=out.device)
        assert cnt.dtype == torch.int32 and cnt.numel() >= b * kvh and cnt.is_contiguous()
    if rope is None:
        q_norm = k_norm = positions = inv_freq = slots = q_or_qkv
        eps, s_qh, norm = 0.0, q_or_qkv.stride(1), False
    else:
        q_norm, k_norm, positions, inv_freq, slots, eps = rope
        s_qh, norm = d, q_norm is not None
        q_norm, k_norm = (q_norm, k_norm) if norm else (q_or_qkv, q_or_qkv)
    _decode_kernel[(b, kvh, splits)](
        q_or_qkv, q_norm, k_norm, positions, inv_freq, slots, k_cache, v_cache, block_tables, context_lens, out,
        ml, part, cnt, scale, eps, q_or_qkv.stride(0), s_qh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        H=heads, KVH=kvh, GROUP=heads // kvh, GROUP_P=max(16, triton.next_power_of_2(heads // kvh)), D=d,
        HALF_P=max(8, triton.next_power_of_2(d // 2)), D_P=max(16, triton.next_power_of_2(d)), PAGE=page, TILE=tile,
        IEEE=q_or_qkv.dtype == torch.float32, SPLITS=splits, SPLITS_P=triton.next_power_of_2(splits),
        ROPE=rope is not None, NORM=norm, num_warps=warps, num_stages=stages,
    )
    return out


def _triton_decode(q, k_cache, v_cache, block_tables, context_lens, scale: float, splits: int | None = None,
                   counters: torch.Tensor | None = None, launch: tuple[int, int, int] | None = None):
    """The kernel on ready queries ``q`` [B, H, D] (the module docstring's contract); ``splits``
    overrides :func:`decode_splits`; ``counters``: zeroed int32 [>= B * KVH] for a split batch
    (else one is allocated); ``launch``: (tile, warps, stages) instead of (64, 4, 3), for sweeps."""
    return _launch(q, q.shape[1], k_cache, v_cache, block_tables, context_lens, scale, splits, counters, None,
                   launch)


def rope_decode_attention(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                          positions: torch.Tensor, inv_freq: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, heads: int,
                          scale: float, eps: float, counters: torch.Tensor | None = None,
                          splits: int | None = None) -> torch.Tensor:
    """A decode step's attention from its packed projections ``qkv`` [B, (H + 2 KVH) D] (q
    heads, k heads, v heads): queries RMS-normalised with ``q_norm`` (unless None) and rotated
    at ``positions`` [B] (``inv_freq`` [D/2], rotate-half); each token's key (``k_norm``,
    rotated) and value written to cache slot ``slots[b]`` of ``k_cache`` / ``v_cache`` [N, P,
    KVH, D] (contiguous) and attended to with the cached context (``context_lens`` counts the
    new token). Returns [B, H, D]; as ``norm_rope`` + the cache writes + ``paged_decode_attention``."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    assert qkv.shape[1] == (heads + 2 * kvh) * d, (qkv.shape, heads, k_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert (q_norm is None) == (k_norm is None)
    return _launch(qkv, heads, k_cache, v_cache, block_tables, context_lens, scale, splits, counters,
                   (q_norm, k_norm, positions, inv_freq, slots, eps))
