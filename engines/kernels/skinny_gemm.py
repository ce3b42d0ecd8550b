"""Projections of a few rows (a decode step of one sequence) as one bandwidth-bound Triton
kernel each, with the step's elementwise work before them folded in.

At batch 1 a decode step's projections are matrix-vector products: every weight byte is read
once for one multiply-add, so the time is the weight read, and cuBLAS's kernels for these
shapes read at a fraction of the bandwidth (330-2,100 GB/s on an H200; docs/PERFORMANCE.md). Here one program
computes ``BLOCK_N`` outputs of every row from whole weight rows (loads issued together, many
programs per SM), and the input may first go through

- ``norm_weight`` (+ ``residual``): the RMSNorm of the decode layer (``rms_norm`` in
  engines/kernels/paged_attention.py, same roundings), the sum ``x + residual`` written once for the next
  layer: what was a kernel of its own before the q/k/v and gate/up projections;
- ``silu_input``: ``silu(gate) * up`` of a packed gate/up row (``silu_mul``'s roundings),
  before the down projection.

Accumulation is float32 in a fixed order per row, so a row's output does not depend on the
other rows of the batch (graph replays at a padded size equal eager steps).

On Hopper and later the kernel launches as a programmatic dependent
(``paged_attention.pdl_enabled``): it may start while the kernel before it in the stream
finishes, loads its first weight tile, then waits for that kernel (``gdc_wait``) before it
reads its input or writes anything, and lets the next kernel start as soon as it has passed
that wait. Hence the contract: the kernel just before it in the stream must not write the
weight (in a decode step: the embedding, attention or another projection).
"""

from __future__ import annotations

import torch

from engines.kernels.paged_attention import multiprocessors, pdl_launch, triton, triton_usable

#: the most rows the kernel serves
KERNEL_ROWS = 8
#: the decode batches that use it (engines/models/fused_decode.py): on an H200 it beat cuBLAS at 1 row
#: on every projection of a 0.6B model and lost at 4 and 8 (benchmarks/skinny_gemm_sweep.py)
MAX_ROWS = 1
#: weight elements one program holds at once
_TILE = 8192
#: the same under the interpreter (CPU), where fewer, larger programs are cheaper
_INTERPRETED_TILE = 65536

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _row_in(X, R, NW, ROUT, b, k, km, inv_b, s_x, s_r, s_ro, write_sum, K: tl.constexpr, PRE: tl.constexpr,
                HAS_R: tl.constexpr):
        """Row ``b``'s input at columns ``k``, in the weight's dtype (see the module docstring)."""
        if PRE == 2:
            g = tl.load(X + b * s_x + k, mask=km, other=0.0)
            u = tl.load(X + b * s_x + K + k, mask=km, other=0.0)
            gf = g.to(tl.float32)
            silu = (gf / (1.0 + tl.exp(-gf))).to(u.dtype)
            return (silu.to(tl.float32) * u.to(tl.float32)).to(u.dtype)
        x = tl.load(X + b * s_x + k, mask=km, other=0.0)
        if PRE == 1:
            if HAS_R:
                x = (x.to(tl.float32) + tl.load(R + b * s_r + k, mask=km, other=0.0).to(tl.float32)).to(x.dtype)
                if write_sum:
                    tl.store(ROUT + b * s_ro + k, x, mask=km)
            normed = (x.to(tl.float32) * inv_b).to(x.dtype)
            w = tl.load(NW + k, mask=km, other=0.0)
            x = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _skinny_kernel(X, R, NW, W, BIAS, Y, ROUT, s_x, s_r, s_y, s_ro, N, eps,
                       K: tl.constexpr, ROWS: tl.constexpr, ROWS_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRE: tl.constexpr, HAS_R: tl.constexpr, HAS_BIAS: tl.constexpr,
                       PDL: tl.constexpr):
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        kr = tl.arange(0, BLOCK_K)
        rows = tl.arange(0, ROWS_P)
        iters: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
        # the first weight tile before anything the previous kernel writes (see the module docstring)
        w_first = tl.load(W + n[:, None] * K + kr[None, :], mask=nm[:, None] & (kr < K)[None, :], other=0.0)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        inv = tl.zeros([ROWS_P], tl.float32)
        if PRE == 1:  # each row's 1 / rms over all K columns (of x + residual)
            for b in tl.static_range(ROWS):
                ss = tl.zeros([BLOCK_K], tl.float32)
                for c in tl.static_range(iters):
                    k = c * BLOCK_K + kr
                    km = k < K
                    x = tl.load(X + b * s_x + k, mask=km, other=0.0)
                    if HAS_R:
                        x = (x.to(tl.float32) + tl.load(R + b * s_r + k, mask=km, other=0.0).to(tl.float32)).to(
                            x.dtype)
                    xf = x.to(tl.float32)
                    ss += xf * xf
                inv = tl.where(rows == b, tl.rsqrt(tl.sum(ss, axis=0) / K + eps), inv)
        acc = tl.zeros([ROWS_P, BLOCK_N], tl.float32)
        for c in tl.static_range(iters):
            k = c * BLOCK_K + kr
            km = k < K
            if c == 0:
                w = w_first.to(tl.float32)
            else:
                w = tl.load(W + n[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            for b in tl.static_range(ROWS):
                inv_b = tl.sum(tl.where(rows == b, inv, 0.0), axis=0)
                xb = _row_in(X, R, NW, ROUT, b, k, km, inv_b, s_x, s_r, s_ro, pid == 0, K, PRE, HAS_R)
                part = tl.sum(w * xb.to(tl.float32)[None, :], axis=1)
                acc = tl.where(rows[:, None] == b, acc + part[None, :], acc)
        if HAS_BIAS:
            acc += tl.load(BIAS + n, mask=nm, other=0.0).to(tl.float32)[None, :]
        out = Y + rows[:, None] * s_y + n[None, :]
        tl.store(out, acc.to(Y.dtype.element_ty), mask=(rows[:, None] < ROWS) & nm[None, :])


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`skinny_linear` serves ``x`` [B, K] times ``weight`` [N, K]."""
    return (triton_usable(x.device) and x.dim() == 2 and 0 < x.shape[0] <= KERNEL_ROWS and weight.dim() == 2
            and weight.is_contiguous() and weight.dtype == x.dtype and x.stride(-1) == 1)


def config(n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) for an [n, k] weight on a device of ``sms`` multiprocessors:
    enough programs to keep every SM reading (about four each), tiles of at most ``_TILE``
    weight elements."""
    block_n = 16
    while block_n > 2 and -(-n // block_n) < 4 * sms:
        block_n //= 2
    block_k = max(16, min(triton.next_power_of_2(k), _TILE // block_n))
    return block_n, block_k, 8 if block_n * block_k >= 8192 else 4


def interpreter_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) under Triton's interpreter (CPU tests): it runs the programs one
    after another and each operation as one numpy call, so the cost is the number of programs,
    not their size: tiles of up to 64 Ki elements (one program for a tiny model's projection)."""
    block_k = max(16, min(triton.next_power_of_2(k), 1024))
    return max(2, min(triton.next_power_of_2(n), _INTERPRETED_TILE // block_k)), block_k, 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None, eps: float = 0.0,
                  silu_input: bool = False, block: tuple[int, int, int] | None = None):
    """``f(x) @ weight.T (+ bias)`` for ``x`` [B, K'] (B <= ``KERNEL_ROWS``), ``weight`` [N, K]
    contiguous, where f is: nothing; with ``norm_weight`` the RMSNorm of ``x`` (of ``x +
    residual`` with ``residual``: then returns ``(y, x + residual)``); with ``silu_input``
    ``silu(x[:, :K]) * x[:, K:]`` (K' = 2K). ``block``: (BLOCK_N, BLOCK_K, warps) instead of
    :func:`config`'s (for sweeps)."""
    rows, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    assert usable(x, weight), (x.shape, x.dtype, weight.shape, weight.dtype)
    assert x.shape[1] == (2 * k if silu_input else k), (x.shape, weight.shape)
    assert not (silu_input and norm_weight is not None) and (residual is None or norm_weight is not None)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    summed = torch.empty((rows, k), dtype=x.dtype, device=x.device) if residual is not None else None
    if block is None:
        block = config(n, k, multiprocessors(x.device)) if x.device.type == "cuda" else interpreter_config(n, k)
    block_n, block_k, warps = block
    r = residual if residual is not None else x
    out_sum = summed if summed is not None else y
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, r, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else weight, y, out_sum,
        x.stride(0), r.stride(0), y.stride(0), out_sum.stride(0), n, eps,
        K=k, ROWS=rows, ROWS_P=max(2, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        PRE=2 if silu_input else int(norm_weight is not None), HAS_R=residual is not None, HAS_BIAS=bias is not None,
        num_warps=warps, **pdl_launch(x.device),
    )
    return (y, summed) if residual is not None else y
