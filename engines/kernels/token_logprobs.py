"""Per-token log-probabilities and entropies of an LM head, fused: ``hidden @ weight.T`` is
never held in float32, and never for more than one chunk of rows.

``lm_head_logprobs(hidden, weight, targets, temperature, entropy)`` returns each row's
``log softmax(logits / T)[target]`` (and, with ``entropy``, the entropy of
``softmax(logits / T)``), differentiable in ``hidden`` and ``weight``. The forward projects
``ROWS`` rows at a time and reduces each row's logits in one pass (online max, sum of
``exp``, sum of ``exp * x``), keeping only the log-normalizer and the entropy of each row;
the backward projects each chunk again and turns its logits into their gradient in place
(``dL/dx_j = a (1[j = target] - p_j) - b p_j (log p_j + H)``, ``a``/``b`` the incoming
gradients of the log-prob and the entropy), then two matmuls. Where the vocabulary is
split over tensor-parallel ranks (``tp_group``), each rank's partial sums are combined
by an all-reduce of three numbers a row, and ``vocab_start`` says where its slice begins.

On CUDA the reductions are Triton kernels (bf16 or fp32 logits read once, float32 math);
elsewhere torch code with the same contract runs (the reference the kernels are tested
against under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch

from engines.kernels.paged_attention import launch_or_fall_back, triton, triton_usable

#: rows projected at once (a chunk of logits in the weights' dtype: ROWS x vocab)
ROWS = 4096


# ----------------------------------------------------------------------------- torch reference

def row_stats_ref(logits: torch.Tensor, targets: torch.Tensor, inv_t: float) -> torch.Tensor:
    """``[4, n]`` float32 per row of ``logits`` ``[n, V]`` scaled by ``inv_t``: the max ``m``,
    ``sum exp(x - m)``, ``sum exp(x - m) * x`` and the target's ``x`` (0 where the target is
    outside ``[0, V)``: another rank's slice)."""
    x = logits.float() * inv_t
    m = x.max(dim=-1).values
    e = (x - m[:, None]).exp()
    inside = (targets >= 0) & (targets < x.shape[1])
    tx = x.gather(1, targets.clamp(0, x.shape[1] - 1)[:, None])[:, 0]
    return torch.stack([m, e.sum(-1), (e * x).sum(-1), torch.where(inside, tx, torch.zeros_like(tx))])


def logit_grads_ref(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                    g_logp: torch.Tensor, g_ent: torch.Tensor, inv_t: float) -> torch.Tensor:
    """The gradient with respect to ``logits`` (in their dtype) of ``sum(g_logp * logp + g_ent
    * entropy)``, given each row's log-normalizer ``lse`` and entropy ``ent`` (of ``logits *
    inv_t`` over the whole vocabulary)."""
    x = logits.float() * inv_t
    logp = x - lse[:, None]
    p = logp.exp()
    g = -g_logp[:, None] * p - g_ent[:, None] * p * (logp + ent[:, None])
    inside = (targets >= 0) & (targets < x.shape[1])
    rows = torch.arange(x.shape[0], device=x.device)[inside]
    g[rows, targets[inside]] += g_logp[inside]
    return (g * inv_t).to(logits.dtype)


# ----------------------------------------------------------------------------- Triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _stats_kernel(logits, stride, targets, out, n, V, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits + row.to(tl.int64) * stride
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        t = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, x)
            alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            e = tl.where(cols < V, tl.exp(x - m_new), 0.0)
            s = s * alpha + e
            t = t * alpha + e * tl.where(cols < V, x, 0.0)
            m = m_new
        top = tl.max(m, axis=0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        tgt = tl.load(targets + row)
        inside = (tgt >= 0) & (tgt < V)
        tx = tl.load(base + tl.where(inside, tgt, 0)).to(tl.float32) * inv_t
        tl.store(out + row, top)
        tl.store(out + n + row, tl.sum(s * scale, axis=0))
        tl.store(out + 2 * n + row, tl.sum(t * scale, axis=0))
        tl.store(out + 3 * n + row, tl.where(inside, tx, 0.0))

    @triton.jit
    def _grads_kernel(logits, stride, targets, lse, ent, g_logp, g_ent, V, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits + row.to(tl.int64) * stride
        z = tl.load(lse + row)
        h = tl.load(ent + row)
        a = tl.load(g_logp + row)
        b = tl.load(g_ent + row)
        tgt = tl.load(targets + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32) * inv_t
            logp = x - z
            p = tl.exp(logp)
            g = -a * p - b * p * (logp + h) + tl.where(cols == tgt, a, 0.0)
            tl.store(base + cols, (g * inv_t).to(logits.dtype.element_ty), mask=cols < V)


def _block(vocab: int) -> int:
    return min(4096, triton.next_power_of_2(vocab))


#: whether the kernels may run: a launch that fails (a Triton that cannot compile them here)
#: says so once on stderr and leaves the torch reference to every later call of the process
_KERNELS_OK = [True]


def _kernels(device: torch.device, use_triton: bool | None) -> bool:
    return (triton_usable(device) and _KERNELS_OK[0]) if use_triton is None else use_triton


def _launch(kernel, grid, *args, **meta) -> bool:
    """Run ``kernel``; False (after the one warning) where it cannot run here."""
    return launch_or_fall_back(_KERNELS_OK, "log-prob", kernel, grid, *args, **meta)


def row_stats(logits: torch.Tensor, targets: torch.Tensor, inv_t: float, use_triton: bool | None = None):
    """:func:`row_stats_ref`'s contract; by the Triton kernel where usable."""
    if not _kernels(logits.device, use_triton):
        return row_stats_ref(logits, targets, inv_t)
    n, vocab = logits.shape
    out = torch.empty(4, n, dtype=torch.float32, device=logits.device)
    if n and not _launch(_stats_kernel, (n,), logits, logits.stride(0), targets, out, n, vocab, float(inv_t),
                         BLOCK=_block(vocab)):
        return row_stats_ref(logits, targets, inv_t)
    return out


def logit_grads_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                 g_logp: torch.Tensor, g_ent: torch.Tensor, inv_t: float, use_triton: bool | None = None):
    """:func:`logit_grads_ref`'s contract, written over ``logits`` (returned); by the Triton
    kernel where usable."""
    n, vocab = logits.shape
    if not n or (_kernels(logits.device, use_triton) and _launch(
            _grads_kernel, (n,), logits, logits.stride(0), targets, lse.contiguous(), ent.contiguous(),
            g_logp.float().contiguous(), g_ent.float().contiguous(), vocab, float(inv_t), BLOCK=_block(vocab))):
        return logits
    logits.copy_(logit_grads_ref(logits, targets, lse, ent, g_logp, g_ent, inv_t))
    return logits


# ----------------------------------------------------------------------------- the LM head

def _combine(stats: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target x, log-normalizer, entropy) per row from each rank's partial ``row_stats``."""
    m, s, t, tx = stats
    if tp_group is not None:
        import torch.distributed as dist

        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
        scale = torch.where(m == float("-inf"), torch.zeros_like(m), (m - top).exp())
        sums = torch.stack([s * scale, t * scale, tx])
        dist.all_reduce(sums, group=tp_group)
        s, t, tx = sums
        m = top
    lse = m + s.log()
    return tx, lse, lse - t / s


class _LMHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, vocab_start, tp_group, rows):
        local = targets - vocab_start
        logp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse, ent = torch.empty_like(logp), torch.empty_like(logp)
        for a in range(0, hidden.shape[0], rows):
            logits = hidden[a : a + rows] @ weight.t()
            tx, lse[a : a + rows], ent[a : a + rows] = _combine(row_stats(logits, local[a : a + rows], inv_t),
                                                                tp_group)
            logp[a : a + rows] = tx - lse[a : a + rows]
            del logits
        ctx.save_for_backward(hidden, weight, local, lse, ent)
        ctx.inv_t, ctx.rows = inv_t, rows
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, local, lse, ent = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        if g_ent is None:
            g_ent = torch.zeros_like(lse)
        g_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_weight = None
        rows = ctx.rows
        for a in range(0, hidden.shape[0], rows):
            h = hidden[a : a + rows]
            g = logit_grads_(h @ weight.t(), local[a : a + rows], lse[a : a + rows], ent[a : a + rows],
                             g_logp[a : a + rows], g_ent[a : a + rows], ctx.inv_t)
            if g_hidden is not None:
                g_hidden[a : a + rows] = g @ weight
            if ctx.needs_input_grad[1]:
                part = g.t() @ h
                if g_weight is None:
                    g_weight = part if hidden.shape[0] <= rows else part.float()
                else:
                    g_weight += part
            del g
        if g_weight is not None:
            g_weight = g_weight.to(weight.dtype)
        return g_hidden, g_weight, None, None, None, None, None


def lm_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                     vocab_start: int = 0, tp_group=None, rows: int | None = None):
    """``(logp, entropy)``, float32 ``[n]``: each row of ``hidden`` ``[n, h]`` projected by
    ``weight`` ``[V, h]`` (this rank's vocabulary slice, starting at ``vocab_start``; the
    slices of ``tp_group``'s ranks make the whole vocabulary), divided by ``temperature``:
    the log-probability of ``targets`` ``[n]`` (whole-vocabulary ids) and the entropy.
    Differentiable in ``hidden`` and ``weight`` (the gradient of ``hidden`` is this rank's
    part: summing over the TP group is the caller's, as for a column-parallel linear)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, not {temperature!r}")
    return _LMHeadLogprobs.apply(hidden, weight, targets, 1.0 / temperature, vocab_start, tp_group, rows or ROWS)
