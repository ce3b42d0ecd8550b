"""Sampling on the device in Triton: the seeded Gumbel-max draw, and one fused pass that
picks every row's token and its log-probability (greedy or drawn at the row's temperature).

Gumbel-max with counter-based noise: the token of a sampled row is
    argmax_t  logits[t] / T - log(-log(u(seed, position, t)))
with u from splitmix64's finalizer over (seed, position, token) — the same bits as
``seeded_uniform`` (the torch version, used off CUDA). A seeded request's seed and position
make its tokens independent of the batch; an unseeded row draws float32 Philox noise
(``tl.rand``) from a fresh seed of torch's generator each step (``torch.manual_seed`` still
makes runs repeat). The kernels hash, add and reduce in one pass over the vocabulary
instead of materialising [rows, vocab] tensors.
"""

from __future__ import annotations

import torch

from engines.kernels.paged_attention import triton

_K_SEED, _K_POS, _K_TOK = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03, 0xABC98388FB8FAC03
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_S_SEED, _S_POS, _S_TOK, _S_MIX1, _S_MIX2 = (
    _signed(c) for c in (_K_SEED, _K_POS, _K_TOK, _MIX1, _MIX2)
)  # as torch int64


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def seeded_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise ``[rows, vocab]`` (float64) that depends only on each row's
    (seed, position) and the token index: a counter-based hash (splitmix64's finalizer).
    Seeded sampling therefore gives the same tokens whatever else is in the batch."""
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    z = seeds[:, None] * _S_SEED + positions[:, None] * _S_POS + tokens[None, :] * _S_TOK
    z = (z ^ _lsr(z, 30)) * _S_MIX1
    z = (z ^ _lsr(z, 27)) * _S_MIX2
    z = z ^ _lsr(z, 31)
    return (_lsr(z, 11).double() + 0.5) / float(1 << 53)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _gumbel(seed, pos, tok, K_SEED: tl.constexpr, K_POS: tl.constexpr, K_TOK: tl.constexpr,
                MIX1: tl.constexpr, MIX2: tl.constexpr):
        """-log(-log(u)) (float64) for the uniform of (seed, pos, token): ``seeded_uniform``'s bits."""
        z = seed.to(tl.uint64) * K_SEED + pos.to(tl.uint64) * K_POS + tok.to(tl.uint64) * K_TOK
        z = (z ^ (z >> 30)) * MIX1
        z = (z ^ (z >> 27)) * MIX2
        z = z ^ (z >> 31)
        u = ((z >> 11).to(tl.float64) + 0.5) / 9007199254740992.0  # 2**53
        return -tl.log(-tl.log(u))

    @triton.jit
    def _seeded_gumbel_kernel(LOGITS, s_l, TEMP, SEED, POS, OUT, vocab, K_SEED: tl.constexpr, K_POS: tl.constexpr,
                              K_TOK: tl.constexpr, MIX1: tl.constexpr, MIX2: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        seed = tl.load(SEED + row)
        pos = tl.load(POS + row)
        temp = tl.load(TEMP + row)
        best = tl.full([1], float("-inf"), tl.float64)
        best_idx = tl.zeros([1], tl.int64)
        for start in range(0, vocab, BLOCK):
            tok = start + tl.arange(0, BLOCK)
            mask = tok < vocab
            x = tl.load(LOGITS + row * s_l + tok, mask=mask, other=0.0)
            score = (x / temp).to(tl.float64) + _gumbel(seed, pos, tok, K_SEED, K_POS, K_TOK, MIX1, MIX2)
            score = tl.where(mask, score, float("-inf"))
            m = tl.max(score, axis=0)
            i = tl.argmax(score, axis=0).to(tl.int64) + start
            better = m > best
            best_idx = tl.where(better, i, best_idx)
            best = tl.where(better, m, best)
        tl.store(OUT + row + tl.arange(0, 1), best_idx)

    @triton.jit
    def _gumbel32(seed, pos, tok, K_SEED: tl.constexpr, K_POS: tl.constexpr, K_TOK: tl.constexpr,
                  MIX1: tl.constexpr, MIX2: tl.constexpr):
        """:func:`_gumbel`'s value in float32 (the same hash; no float64), within ~2e-5 of it.
        With k the hash's 53 bits, u = (2k + 1) / 2^54 and w = 1 - u = (2^54 - 2k - 1) / 2^54 are
        exact integers over 2^54; the smaller one, converted once, gives -log(u) as -log(u) where
        u < 1/2, else -log(1 - w), or the series w + w^2/2 + ... where w < 1/64 (where a float32
        log of 1 - w would lose it)."""
        z = seed.to(tl.uint64) * K_SEED + pos.to(tl.uint64) * K_POS + tok.to(tl.uint64) * K_TOK
        z = (z ^ (z >> 30)) * MIX1
        z = (z ^ (z >> 27)) * MIX2
        z = z ^ (z >> 31)
        odd = (z >> 11).to(tl.int64) * 2 + 1  # 2k + 1 (< 2^54)
        low = odd < 9007199254740992  # u < 1/2
        v = tl.where(low, odd, 18014398509481984 - odd).to(tl.float32) * 5.551115123125783e-17  # u or w; 2**-54
        series = v * (1.0 + v * (0.5 + v * (0.33333334 + v * (0.25 + v * 0.2))))
        a = tl.where(low | (v >= 0.015625), -tl.log(tl.where(low, v, 1.0 - v)), series)
        return -tl.log(a)

    @triton.jit
    def _pick_chunk_kernel(LOGITS, s_l, TEMP, SEED, POS, PM, PS, PK, PT, PZ, vocab, chunks,
                           K_SEED: tl.constexpr, K_POS: tl.constexpr, K_TOK: tl.constexpr, MIX1: tl.constexpr,
                           MIX2: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr):
        """One (row, vocabulary chunk of CHUNK tokens, read BLOCK at a time): the chunk's max and
        sum of exp of z = logits / T (T = 1 for a greedy row, T = 0 in TEMP), and its best key (z,
        plus Gumbel noise for a sampled row) as float64, with that token and its z.

        Each lane keeps its running max, sum, best key (float32) and the token of it, reduced
        once at the end. A seeded row's float64 key (the hash's noise, as ``seeded_gumbel_argmax``)
        is computed for the chunk's winner only: its float32 key is within 1.5e-4 + 1e-6 |key|
        of the float64 one (:func:`_gumbel32`), so when no other token's float32 key is within
        twice that of the best, the float64 argmax is the same token; otherwise (rare: a near
        tie) the chunk is read again with float64 keys."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        lane = tl.arange(0, BLOCK)
        if not GREEDY:
            temp = tl.load(TEMP + row)
            sampled = temp > 0
            temp = tl.where(sampled, temp, 1.0)
            seed = tl.load(SEED + row)
            pos = tl.load(POS + row)
            seeded = sampled & (pos >= 0)
        # the lane's running max of z (finite: -inf would make -inf - -inf), sum of exp(z - max),
        # best key and its token and z, and (a seeded row's near ties) its second best key
        m_acc = tl.full([BLOCK], -3.0e38, tl.float32)
        s_acc = tl.zeros([BLOCK], tl.float32)
        t_acc = c * CHUNK + lane  # (a chunk all -inf: its first token, as torch.argmax)
        k_acc = tl.full([BLOCK], float("-inf"), tl.float32)  # (greedy: the max, m_acc)
        k2_acc = tl.full([BLOCK], float("-inf"), tl.float32)
        zb_acc = tl.zeros([BLOCK], tl.float32)
        for off in range(0, CHUNK, BLOCK):
            tok = c * CHUNK + off + lane
            mask = tok < vocab
            x = tl.load(LOGITS + row * s_l + tok, mask=mask, other=float("-inf")).to(tl.float32)
            z = x if GREEDY else x / temp
            # one exp a token: exp(-|z - max|) is either the new term or the old sum's rescaling
            diff = z - m_acc
            up = diff > 0  # strict: a lane keeps the first of its equal values
            e = tl.exp(-tl.abs(diff))
            s_acc = tl.where(up, s_acc * e + 1.0, s_acc + e)
            m_acc = tl.where(up, z, m_acc)
            if GREEDY:  # the key is z: the best is the max
                t_acc = tl.where(up, tok, t_acc)
            else:
                if seeded:
                    key = z + _gumbel32(seed, pos, tok, K_SEED, K_POS, K_TOK, MIX1, MIX2)
                elif sampled:  # an unseeded row: Philox float32 noise from this step's seed
                    key = z - tl.log(-tl.log(tl.maximum(tl.rand(seed, tok), 1e-30)))
                else:
                    key = z
                key = tl.where(mask, key, float("-inf"))
                better = key > k_acc  # strict, as above
                k2_acc = tl.where(better, k_acc, tl.maximum(k2_acc, key))
                k_acc = tl.where(better, key, k_acc)
                t_acc = tl.where(better, tok, t_acc)
                zb_acc = tl.where(better, z, zb_acc)
        if GREEDY:
            k_acc = m_acc
            zb_acc = m_acc
        m = tl.max(m_acc, axis=0)
        total = tl.sum(s_acc * tl.exp(m_acc - m), axis=0)  # (a chunk all -inf: 0, and m -3e38)
        best = tl.max(k_acc, axis=0)
        top = k_acc == best
        tok = tl.min(tl.where(top, t_acc, 2147483647), axis=0)  # the first of equal keys, as torch.argmax
        zb = tl.sum(tl.where(top & (t_acc == tok), zb_acc, 0.0), axis=0)
        key64 = best.to(tl.float64)
        if not GREEDY:  # (static: a greedy kernel has no seeded rows)
            if seeded:
                tol = 3e-4 + 2e-6 * tl.abs(best)
                near = tl.sum((k_acc >= best - tol).to(tl.int32), axis=0)
                near += tl.sum((k2_acc >= best - tol).to(tl.int32), axis=0)
                if (near > 1) & (best > float("-inf")):  # a near tie: the float64 keys of the whole chunk decide
                    key64 = best.to(tl.float64) - float("inf")
                    for off in range(0, CHUNK, BLOCK):
                        t = c * CHUNK + off + lane
                        mask = t < vocab
                        z = tl.load(LOGITS + row * s_l + t, mask=mask, other=float("-inf")).to(tl.float32) / temp
                        k = tl.where(mask, z.to(tl.float64) + _gumbel(seed, pos, t, K_SEED, K_POS, K_TOK, MIX1, MIX2),
                                     float("-inf"))
                        kb = tl.max(k, axis=0)
                        if kb > key64:  # strict: the first chunk part of equal keys
                            at = tl.argmax(k, axis=0)
                            key64 = kb
                            tok = at + c * CHUNK + off
                            zb = tl.sum(tl.where(lane == at, z, 0.0), axis=0)
                else:
                    key64 = zb.to(tl.float64) + _gumbel(seed, pos, tok, K_SEED, K_POS, K_TOK, MIX1, MIX2)
        at = row * chunks + c
        tl.store(PM + at, m)
        tl.store(PS + at, total)
        tl.store(PK + at, key64)
        tl.store(PT + at, tok.to(tl.int64))
        tl.store(PZ + at, zb)

    @triton.jit
    def _pick_rows_kernel(PM, PS, PK, PT, PZ, OUT, chunks, CHUNKS_P: tl.constexpr):
        """One row: its chunks combined into (token, log-probability) float64."""
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS_P)
        mask = c < chunks
        at = row * chunks + c
        m = tl.load(PM + at, mask=mask, other=float("-inf"))
        top = tl.max(m, axis=0)
        total = tl.sum(tl.where(mask, tl.load(PS + at, mask=mask, other=0.0) * tl.exp(m - top), 0.0), axis=0)
        best = tl.argmax(tl.load(PK + at, mask=mask, other=float("-inf")), axis=0)  # the first chunk of equal keys
        pick = c == best
        tok = tl.sum(tl.where(pick, tl.load(PT + at, mask=mask, other=0), 0), axis=0)
        z = tl.sum(tl.where(pick, tl.load(PZ + at, mask=mask, other=0.0), 0.0), axis=0)
        lp = z - (top + tl.log(total))
        tl.store(OUT + row * 2, tok.to(tl.float64))
        tl.store(OUT + row * 2 + 1, lp.to(tl.float64))


def seeded_gumbel_argmax(
    logits: torch.Tensor, temps: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Token ids [R] (int64) sampled from softmax(logits / temps) with the noise of each
    row's (seed, position): float32 ``logits`` [R, V], ``temps`` [R], int64 ``seeds`` and
    ``positions`` [R]."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _seeded_gumbel_kernel[(rows,)](logits, logits.stride(0), temps, seeds, positions, out, vocab, K_SEED=_K_SEED,
                                   K_POS=_K_POS, K_TOK=_K_TOK, MIX1=_MIX1, MIX2=_MIX2, BLOCK=1024, num_warps=4)
    return out


#: vocabulary positions per program of :func:`sample_pairs` (fixed: a row's result must not
#: depend on how many rows its batch has), and per read of it
PICK_CHUNK = 8192
PICK_BLOCK = 1024
PICK_WARPS = 4


def sample_pairs(logits: torch.Tensor, temps: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's token and its log-probability, [R, 2] float64, from ``logits`` [R, V]
    (float32, or bfloat16/float16 read as float32: the same results as from their float32
    copy; last dim contiguous) in two kernels (one pass over the logits): with ``temps`` None
    every row is greedy (its argmax, the first of equal ones, and its log-softmax); otherwise
    a row with ``temps`` 0 is greedy and one with T > 0 takes the Gumbel-max draw at temperature
    T with its log-probability at T: with ``positions`` >= 0 the (``seeds``, ``positions``) hash
    noise (the token ``seeded_gumbel_argmax`` gives), with ``positions`` -1 Philox noise of
    ``seeds`` (unseeded rows: a fresh seed each step)."""
    rows, vocab = logits.shape
    assert logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.stride(1) == 1, (
        logits.dtype, logits.stride())
    dev = logits.device
    chunk = min(PICK_CHUNK, max(16, triton.next_power_of_2(vocab)))
    block = min(PICK_BLOCK, chunk)
    chunks = triton.cdiv(vocab, chunk)
    pm, ps, pz = (torch.empty((rows, chunks), dtype=torch.float32, device=dev) for _ in range(3))
    pk = torch.empty((rows, chunks), dtype=torch.float64, device=dev)
    pt = torch.empty((rows, chunks), dtype=torch.int64, device=dev)
    greedy = temps is None
    if not greedy:
        assert temps.dtype == torch.float32 and seeds.dtype == positions.dtype == torch.int64
    _pick_chunk_kernel[(rows, chunks)](
        logits, logits.stride(0), logits if greedy else temps, pt if greedy else seeds, pt if greedy else positions,
        pm, ps, pk, pt, pz, vocab, chunks, K_SEED=_K_SEED, K_POS=_K_POS, K_TOK=_K_TOK, MIX1=_MIX1, MIX2=_MIX2,
        CHUNK=chunk, BLOCK=block, GREEDY=greedy, num_warps=PICK_WARPS,
    )
    out = torch.empty((rows, 2), dtype=torch.float64, device=dev)
    _pick_rows_kernel[(rows,)](pm, ps, pk, pt, pz, out, chunks, CHUNKS_P=max(2, triton.next_power_of_2(chunks)),
                               num_warps=1)
    return out
