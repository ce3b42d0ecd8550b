"""Micro-batches of the trainer, and what expert parallelism asks of them.

With expert parallel size > 1, Megatron's allgather token dispatcher gathers the tokens of
every rank of the (TP x EP) group at every MoE layer, forward and backward: those ranks must
run the same number of micro-batches with the same ``[rows, width]`` shapes, although each
data-parallel rank has its own shard of the batch. :func:`aligned_micro_batches` agrees on
a common schedule over the EP group: each rank's micro-batches, padded to the longest list
with empty ones, each padded to the group's most rows (``None``: a dummy row, no response
tokens, weight 0) and widest sequence. Padding tokens are kept out of the routing statistics
of the load-balancing loss (Megatron's ``padding_mask``).
"""

from __future__ import annotations

import numpy as np
import torch

#: the stand-in sequence of a dummy row (two pad tokens; never a response token)
DUMMY = [0, 0]


def micro_batches(seqs: list, budget: int, packed: bool = False) -> list[list[int]]:
    """Index groups. ``packed``: the sequences concatenated (:func:`packed_inputs`), a group cut
    before its tokens would pass ``budget`` (in order of length, longest first, so the groups
    come out even). Otherwise each group is padded to its longest sequence. Sequences go in order of length
    (shortest first, ties in order), so a group pads little; a group is cut before its
    padded size (count x longest) would pass ``budget`` tokens, or before a longer sequence
    would add more padding to it than ``budget // 8`` tokens (about what one more
    forward/backward costs): a few long rows do not pad a batch of short ones. A sequence
    longer than the budget is a group of its own. Callers weight each group's loss by its
    share of the batch, so the grouping does not change the summed gradient."""
    out, cur, width = [], [], 0
    if packed:
        for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
            if cur and width + len(seqs[i]) > budget:
                out.append(cur)
                cur, width = [], 0
            cur.append(i)
            width += len(seqs[i])
        return out + [cur] if cur else out
    for i in sorted(range(len(seqs)), key=lambda i: len(seqs[i])):
        n = len(seqs[i])
        if cur and (n * (len(cur) + 1) > budget or (n - width) * len(cur) > budget // 8):
            out.append(cur)
            cur = []
        cur.append(i)
        width = n
    if cur:
        out.append(cur)
    return out


def aligned_micro_batches(seqs: list, budget: int, ep_group=None,
                          packed: bool = False) -> list[tuple[list, int | None]]:
    """``(indices, width)`` per micro-batch. Without an EP group of more than one rank: the
    plain :func:`micro_batches`, width None (the longest sequence). Otherwise the schedule
    every rank of ``ep_group`` shares (module docstring): indices may hold ``None`` (dummy
    rows) and width is the group's longest sequence in that micro-batch (a collective)."""
    groups = micro_batches(seqs, budget, packed) if seqs else []
    if ep_group is None or packed:  # packing is refused under EP > 1 (TrainerActor.setup)
        return [(g, None) for g in groups]
    import torch.distributed as dist

    if dist.get_world_size(ep_group) == 1:
        return [(g, None) for g in groups]
    shapes = [(len(g), max(len(seqs[i]) for i in g)) for g in groups]
    every: list = [None] * dist.get_world_size(ep_group)
    dist.all_gather_object(every, shapes, group=ep_group)
    out = []
    for k in range(max(len(s) for s in every)):
        rows = max(s[k][0] for s in every if k < len(s))
        width = max(s[k][1] for s in every if k < len(s))
        idx = list(groups[k]) if k < len(groups) else []
        out.append((idx + [None] * (rows - len(idx)), width))
    return out


def model_inputs(seqs: list, width: int | None, device) -> tuple:
    """(input ids, positions, targets) of right-padded rows ``[rows, width - 1]``: inputs are
    tokens 0..n-2, targets 1..n-1. No attention mask: the trainer's attention is causal
    (engines/trainer/attention.py), which right padding needs nothing beyond."""
    width = width or max(len(s) for s in seqs)
    ids = padded(seqs, width).to(device)
    pos = torch.arange(width - 1, device=device)[None].expand(len(seqs), -1)
    return ids[:, :-1], pos, ids[:, 1:]


def packed_inputs(seqs: list, device) -> tuple:
    """One packed row of ``seqs`` (no padding): (input ids ``[1, T]``, positions restarting
    at 0 per sequence, targets, Megatron's ``PackedSeqParams`` (``thd``, the sequences'
    bounds), (row, column) of each packed token in the padded layout)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    inputs = np.concatenate([np.asarray(s[:-1], dtype=np.int64) for s in seqs])
    targets = np.concatenate([np.asarray(s[1:], dtype=np.int64) for s in seqs])
    lengths = [len(s) - 1 for s in seqs]
    positions = np.concatenate([np.arange(n) for n in lengths])
    rows_of = np.repeat(np.arange(len(seqs)), lengths)
    bounds = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    where = (torch.from_numpy(rows_of).to(device), torch.from_numpy(positions).to(device))
    return (torch.from_numpy(inputs).to(device)[None], torch.from_numpy(positions).to(device)[None],
            torch.from_numpy(targets).to(device)[None], params, where)


def unpack(values: torch.Tensor, where: tuple, rows: int, width: int) -> torch.Tensor:
    """A packed row's per-token values ``[1, T]`` in the padded layout ``[rows, width - 1]``
    (zeros after each row's end); differentiable."""
    out = values.new_zeros(rows, width - 1)
    return out.index_put(where, values[0])


def logprobs(model, cfg, seqs: list, device, temperature: float, width: int | None, entropy: str | None,
             pack: bool):
    """A micro-batch's log-probs (and entropies with ``entropy``) in the padded layout
    ``[rows, width - 1]``, from padded rows or one packed row (``pack``)."""
    from engines.trainer.megatron_model import token_logprobs

    width = width or max(len(s) for s in seqs)
    if pack:
        ids, pos, tgt, params, where = packed_inputs(seqs, device)
        out = token_logprobs(model, ids, pos, None, tgt, temperature, entropy=entropy, packed_seq_params=params)
        parts = out if entropy is not None else (out,)
        parts = tuple(unpack(x, where, len(seqs), width) for x in parts)
        return parts if entropy is not None else parts[0]
    ids, pos, tgt = model_inputs(seqs, width, device)
    pad = padding_mask(seqs, width, device) if cfg.num_experts else None
    return token_logprobs(model, ids, pos, None, tgt, temperature, padding_mask=pad, entropy=entropy)


def rows(seqs: list, idx: list) -> list:
    """The sequences of a micro-batch (a dummy row's stand-in where ``idx`` holds None)."""
    return [DUMMY if i is None else seqs[i] for i in idx]


def pick(values: list | None, idx: list, dummy):
    """``values[i]`` for each index (``dummy`` for a dummy row); None when ``values`` is."""
    if values is None:
        return None
    return [dummy if i is None else values[i] for i in idx]


def padded(rows: list, width: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[len(rows), width]`` on the CPU: each row's values first, zeros after (built in
    numpy, one copy per row; torch's per-row ``tensor`` + slice copy cost ~50 us a row). A
    row longer than ``width`` raises."""
    out = np.zeros((len(rows), width), dtype=np.int64 if dtype == torch.int64 else np.float64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out).to(dtype)


def aligned(base: torch.Tensor, rows: list) -> torch.Tensor:
    """``base`` with each row's leading entries replaced by the given values (rounded to
    ``base``'s dtype as ``torch.tensor(row, dtype=...)`` rounds them)."""
    width = base.shape[1]
    values = padded(rows, width, torch.float64).to(base.device, base.dtype)
    lengths = torch.tensor([len(r) for r in rows], device=base.device)
    return torch.where(torch.arange(width, device=base.device)[None] < lengths[:, None], values, base)


def step_logprobs(logp: torch.Tensor, idx: list, old_logprobs: list | None, rollout_logprobs: list | None,
                  ref_logprobs: list | None) -> tuple:
    """Micro-batch ``idx``'s old, rollout and reference log-probs as tensors shaped like its
    ``logp``: old are the given ones, else ``logp`` detached (the rollout's first optimizer
    step); rollout / reference None when not given."""
    given = pick(old_logprobs, idx, [])
    old = aligned(logp.detach(), given) if given is not None else logp.detach()
    rest = [pick(values, idx, []) for values in (rollout_logprobs, ref_logprobs)]
    return (old, *(aligned(old, rows) if rows is not None else None for rows in rest))


def padding_mask(seqs: list, width: int, device) -> torch.Tensor:
    """Megatron's MoE padding mask over the inputs (tokens 0..width-2): True where padding
    (a dummy row is all padding)."""
    lengths = torch.tensor([0 if s is DUMMY else len(s) - 1 for s in seqs], device=device)
    return ~(torch.arange(width - 1, device=device)[None] < lengths[:, None])


def set_aux_loss_scale(cfg, model_config, idx: list, weight: float) -> None:
    """MoE models, before a micro-batch's forward: the load-balancing loss's gradient scale,
    the micro-batch's share of the batch (as its policy loss is weighted), so the aux loss is
    averaged over micro-batches like the loss (Megatron's ``MoEAuxLossAutoScaler`` adds its
    gradient in backward). A micro-batch of dummy rows only (EP alignment: no real token)
    runs without the aux loss (its coefficient is 0 for that forward). Nothing for a dense model."""
    if not cfg.num_experts:
        return
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    if not hasattr(model_config, "relay_aux_loss_coeff"):
        model_config.relay_aux_loss_coeff = model_config.moe_aux_loss_coeff
    dummy = all(i is None for i in idx)
    model_config.moe_aux_loss_coeff = 0.0 if dummy else model_config.relay_aux_loss_coeff
    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    if scale is None:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(weight)))
    else:
        scale.fill_(float(weight))


def aux_loss_stats(cfg, plan: list) -> dict:
    """MoE models: ``{"moe_load_balancing_loss": x}``, the load-balancing loss (before its
    coefficient, as Megatron logs it) of this rank's step: the mean over its micro-batches
    with real rows and over MoE layers, from
    Megatron's tracker, which is cleared. Empty for a dense model or with the aux loss off."""
    if not cfg.num_experts:
        return {}
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    micro = sum(any(i is not None for i in idx) for idx, _ in plan)
    out = {}
    if entry is not None and micro and layers:
        out["moe_load_balancing_loss"] = float(entry["values"].sum()) / layers / micro
    clear_aux_losses_tracker()
    return out
