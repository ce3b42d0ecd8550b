"""Qwen3-MoE's sparse MLP in the built-in engine (``mlp`` of a layer where
``ModelConfig.is_moe_layer``): a router over ``num_experts`` SiLU-gated experts, each token
summing its top ``num_experts_per_tok`` experts' outputs weighted by their routing
probabilities, plus (Qwen2-MoE style) a sigmoid-gated shared expert when
``shared_expert_intermediate_size`` > 0.

Routing is HF's: the router's logits in the model dtype, softmax in float32, top-k, the
top-k weights renormalised to sum to 1 when ``norm_topk_prob``, then cast back to the model
dtype. Experts are stored stacked, as transformers 5 holds them in memory:
``experts.gate_up_proj`` [E, 2 * I, H] (each expert's gate rows, then its up rows) and
``experts.down_proj`` [E, H, I]; checkpoints name them per expert
(``mlp.experts.{e}.gate_proj.weight`` ...; what real Qwen3-MoE checkpoints and transformers'
``save_pretrained`` write) or fused (``mlp.experts.gate_up_proj``, Qwen3-VL-MoE checkpoints,
there [E, H, 2 * I]): engines/models/weight_names.py maps both onto these tensors.

Two paths compute the experts, same contract:

- ``moe_reference`` (CPU): tokens grouped by expert (a stable sort), one expert at a time:
  index_select its tokens, gate/up, SiLU, down, scale by the routing weight, index_add.
- ``fused_moe`` (CUDA, or Triton's interpreter): the (token, expert) assignments sorted by
  expert into blocks of ``BLOCK_M`` rows, each expert's rows padded to a whole number of
  blocks (``moe_align``: fixed-size outputs from an upper bound on the block count, no host
  synchronisation, so CUDA graphs capture it), then two grouped GEMMs written in Triton,
  one program per (block of rows, block of N): gate/up for every assignment, SiLU-and-
  multiply, down scaled by the routing weight; the top-k rows of a token summed last.

Tensor parallel: each expert's intermediate dimension (and the shared expert's) is split
across the ranks like the dense MLP's; the layer's output is a partial sum that the model
all-reduces. Expert parallel (``ep_size`` > 1, dividing the engine's ``tp_size``, as SGLang's
``--ep-size``): the ranks form ``ep_size`` groups of ``tp_size / ep_size``; group ``g`` holds
experts ``[g * E / ep, (g + 1) * E / ep)`` whole or split over its ranks; the router is whole
on every rank, each rank computes only the (token, expert) assignments of its own experts
(the others are a sentinel expert whose blocks are skipped) and the same all-reduce sums
the layer. The shared expert stays split over all ranks.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from engines.kernels.paged_attention import silu_mul, triton, triton_usable

if triton is not None:
    import triton.language as tl

#: per-expert checkpoint names and the fused (stacked) names of transformers 5 and Qwen3-VL-MoE
PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def expert_tp(cfg) -> tuple[int, int]:
    """(ranks each expert is split over, this rank's index among them): ``tp_size / ep_size``."""
    n = cfg.tp_size // cfg.ep_size
    return n, cfg.tp_rank % n


def local_experts(cfg) -> tuple[int, int]:
    """(first expert, number of experts) this rank holds."""
    per = cfg.num_experts // cfg.ep_size
    return cfg.ep_rank * per, per


def local_moe_intermediate(cfg) -> int:
    return cfg.moe_intermediate_size // expert_tp(cfg)[0]


def check_moe_shardable(cfg, tp_size: int, ep_size: int = 1) -> None:
    """Raise ValueError, naming what to change, when a MoE model cannot run over ``tp_size``
    ranks with ``ep_size`` expert-parallel groups."""
    if ep_size < 1 or tp_size % ep_size:
        raise ValueError(f"ep_size {ep_size} must divide the engine's {tp_size} GPUs (tensor-parallel ranks): "
                         "expert parallelism splits an engine's ranks into ep_size groups")
    if cfg.num_experts % ep_size:
        raise ValueError(f"{cfg.num_experts} experts do not divide over ep_size {ep_size}")
    for what, n, ranks in (("MoE intermediate size", cfg.moe_intermediate_size, tp_size // ep_size),
                           ("shared expert intermediate size", cfg.shared_expert_intermediate_size, tp_size)):
        if n % ranks:
            raise ValueError(f"{what} ({n}) does not divide over {ranks} tensor-parallel GPUs per "
                             f"{'expert' if ranks != tp_size else 'engine'}")


def shard_expert_tensor(cfg, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of an expert or shared-expert tensor ``name`` (engine names: one
    expert's projection, the stacked ``experts.gate_up_proj`` [E, 2I, H] and
    ``experts.down_proj`` [E, H, I], or a shared expert's projections); None for one expert
    that another expert-parallel group holds; any other tensor whole."""
    t, r = expert_tp(cfg)
    first, count = local_experts(cfg)
    per = PER_EXPERT.match(name)
    if per is not None:  # one expert's [I, H] gate or up, [H, I] down
        if not first <= int(per.group(2)) < first + count:
            return None
        n = cfg.moe_intermediate_size // t
        return tensor.narrow(1, r * n, n) if per.group(3) == "down_proj" else tensor.narrow(0, r * n, n)
    if name.endswith(".mlp.experts.gate_up_proj"):
        tensor = tensor[first:first + count]
        i = tensor.shape[1] // 2
        n = i // t
        return torch.cat([tensor[:, r * n:(r + 1) * n], tensor[:, i + r * n:i + (r + 1) * n]], 1)
    if name.endswith(".mlp.experts.down_proj"):
        tensor = tensor[first:first + count]
        n = tensor.shape[2] // t
        return tensor[:, :, r * n:(r + 1) * n]
    if ".mlp.shared_expert." in name:
        r, t = cfg.tp_rank, cfg.tp_size
        n = cfg.shared_expert_intermediate_size // t
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            return tensor.narrow(0, r * n, n)
        if name.endswith("down_proj.weight"):
            return tensor.narrow(1, r * n, n)
    return tensor


def expert_names(cfg, name: str) -> list[str] | None:
    """The per-expert checkpoint names a stacked expert parameter ``name`` stands for (None
    for any other name)."""
    m = FUSED.match(name)
    if m is None:
        return None
    leaves = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
    return [f"{m.group(1)}.{e}.{leaf}.weight" for e in range(cfg.num_experts) for leaf in leaves]


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` of intermediate size ``inter`` (the shared expert)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        e, i, h = local_experts(cfg)[1], local_moe_intermediate(cfg), cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))


class SparseMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg)
        self.shared = cfg.shared_expert_intermediate_size > 0
        if self.shared:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size // cfg.tp_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.first_expert, self.local_count = local_experts(cfg)
        self.expert_parallel = cfg.ep_size > 1

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights [T, k] (model dtype) and expert ids [T, k] of tokens ``x`` [T, H]."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids

    def forward(self, x: torch.Tensor, fused: bool | None = None) -> torch.Tensor:
        """This rank's partial output (summed over ranks by the model) for ``x`` [..., H]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        if self.expert_parallel:  # this rank's experts by their local index; the others: the sentinel
            ids = ids - self.first_expert
            ids = torch.where((ids >= 0) & (ids < self.local_count), ids, self.local_count)
        if fused if fused is not None else triton_usable(x.device):
            out = fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids,
                            sentinel=self.expert_parallel)
        else:
            out = moe_reference(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


def moe_reference(x, gate_up, down, weights, ids) -> torch.Tensor:
    """Sum over each token's experts of ``weight * down(silu(gate(x)) * up(x))``: ``x`` [T, H],
    ``gate_up`` [E, 2I, H], ``down`` [E, H, I], ``weights`` and ``ids`` [T, k]; an id of E (an
    expert another rank holds) contributes nothing."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    w = weights.reshape(-1)
    out = torch.zeros_like(x)
    start = 0
    for e, c in enumerate(counts[:gate_up.shape[0]]):
        if not c:
            continue
        sel = order[start:start + c]
        start += c
        tokens = sel // k
        gate, up = F.linear(x.index_select(0, tokens), gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * w.index_select(0, sel)[:, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int):
    """The assignments of ``ids`` [T, k] (flat index t * k + j) sorted by expert into blocks of
    ``block_m``, each expert's padded to whole blocks. Returns ``sorted_ids`` [blocks * block_m]
    int32 (padding: T * k) and ``block_expert`` [blocks] int32 (-1: an unused block). Sizes
    come from T, k and the expert count alone, and nothing waits on the device."""
    tk = ids.numel()
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(tk, device=ids.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    dest = (ends - padded)[sorted_experts] + rank
    blocks = -(-(tk + min(num_experts, tk) * (block_m - 1)) // block_m)  # at most min(E, T*k) experts pad
    sorted_ids = torch.full((blocks * block_m,), tk, dtype=torch.int32, device=ids.device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


if triton is not None:

    @triton.jit
    def _moe_gemm_kernel(
        A, W, C, IDS, BEXP, TW,
        n_out, n_in, tk,
        s_am, s_we, s_wn, s_wk, s_cm,
        ROW_DIV: tl.constexpr, SCALE: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    ):
        """C[a, n] = sum_k A[a // ROW_DIV, k] * W[e, n, k] (times the routing weight TW[a]
        with SCALE) for the assignments ``a`` of one block of rows, all of expert ``e``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(BEXP + pid_m).to(tl.int64)
        if e < 0:
            return
        ids = tl.load(IDS + pid_m * BM + tl.arange(0, BM))
        valid = ids < tk
        rows = (ids // ROW_DIV).to(tl.int64)
        n = pid_n * BN + tl.arange(0, BN)
        nmask = n < n_out
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, n_in, BK):
            k = k0 + tl.arange(0, BK)
            kmask = k < n_in
            a = tl.load(A + rows[:, None] * s_am + k[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            w = tl.load(W + e * s_we + n[None, :] * s_wn + k[:, None] * s_wk, mask=kmask[:, None] & nmask[None, :],
                        other=0.0)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        if SCALE:
            acc = acc * tl.load(TW + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
        out = C + ids.to(tl.int64)[:, None] * s_cm + n[None, :]
        tl.store(out, acc.to(C.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


def _grouped_gemm(a, w, out, sorted_ids, block_expert, weights, row_div: int, scale: bool, block_m: int):
    n_out, n_in = w.shape[1], w.shape[2]
    bn = 64 if n_out >= 64 else 32
    bk = 64 if n_in >= 64 else 32
    grid = (block_expert.shape[0], triton.cdiv(n_out, bn))
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, weights,
        n_out, n_in, out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        ROW_DIV=row_div, SCALE=scale, BM=block_m, BN=bn, BK=bk, IEEE=a.dtype == torch.float32, num_warps=4,
    )


def fused_moe(x, gate_up, down, weights, ids, block_m: int | None = None, sentinel: bool = False) -> torch.Tensor:
    """``moe_reference`` through the Triton grouped GEMMs (CUDA, or Triton's interpreter).
    ``sentinel``: ``ids`` may hold E (an expert of another rank): its blocks are skipped and
    its rows of the output stay zero."""
    t, k = ids.shape
    e, two_i, _ = gate_up.shape
    if block_m is None:
        block_m = 16 if t * k <= 16 * e else 64  # decode: few rows per expert
    sorted_ids, block_expert = moe_align(ids, e + sentinel, block_m)
    if sentinel:
        block_expert = torch.where(block_expert == e, -1, block_expert)
    x = x.contiguous()
    h1 = torch.empty((t * k, two_i), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, h1, sorted_ids, block_expert, weights, k, False, block_m)
    act = silu_mul(h1[:, : two_i // 2], h1[:, two_i // 2:])
    h2 = (torch.zeros if sentinel else torch.empty)((t * k, down.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, down, h2, sorted_ids, block_expert, weights.reshape(-1).contiguous(), 1, True, block_m)
    return h2.view(t, k, -1).sum(dim=1)
