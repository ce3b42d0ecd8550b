"""SGLang's logit penalties and min_p on a batch of logits (docs/engines.md, sampling).

Per request (only one that asks for a penalty) the engine keeps, on the logits' device, the
count of each vocabulary token in its output and a mask of the tokens of its prompt
(:class:`PenaltyState`, on the :class:`.sequence.Sequence`: it survives preemption). Each
step stacks the penalized rows' counts, adds the tokens appended since the last step in one
scatter (writing them back in one multi-tensor copy), then changes the penalized rows of the
batch at once, out of place:

- ``frequency_penalty``: ``logit -= penalty * count`` (output tokens);
- ``presence_penalty``: ``logit -= penalty`` for every output token seen at least once;
- ``repetition_penalty``: for every token of the prompt or the output, a positive logit is
  divided by it and a negative one multiplied (after the two above, SGLang's order);
- ``min_new_tokens``: while fewer tokens were generated, every token that would end the
  request (eos unless ``ignore_eos``, ``stop_token_ids``) gets ``-inf``.

The logits are the decode step's output whether it ran eagerly or replayed a CUDA graph
(graphs capture the model's forward only; sampling runs after it), so penalties hold either
way. Nothing here is device specific; a batch without penalties is returned untouched.
"""

from __future__ import annotations

import torch

from engines.builtin.sequence import Sequence
from engines.builtin.transfer import to_device


class PenaltyState:
    """One request's token statistics, on the logits' device."""

    def __init__(self, prompt: list, vocab: int, device: torch.device):
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # output tokens
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = torch.tensor([t for t in prompt if 0 <= t < vocab], dtype=torch.int64, device=device)
        self.in_prompt[ids] = True
        self.counted = 0  # output tokens already in ``counts``


def _counts(seqs: list[Sequence], vocab: int, device: torch.device) -> torch.Tensor:
    """The rows' output-token counts [b, V], caught up with the tokens appended since the
    last step (one scatter for the batch) and written back to each request's state (one
    multi-tensor copy)."""
    for s in seqs:
        if s.penalty is None:
            s.penalty = PenaltyState(s.prompt, vocab, device)
    counts = torch.stack([s.penalty.counts for s in seqs])
    rows, toks = [], []
    for j, s in enumerate(seqs):
        new = [t for t in s.output[s.penalty.counted :] if 0 <= t < vocab]  # one, normally
        rows += [j] * len(new)
        toks += new
        s.penalty.counted = len(s.output)
    if toks:
        ones = torch.ones(len(toks), dtype=counts.dtype, device=device)
        counts.index_put_((torch.tensor(rows, device=device), torch.tensor(toks, device=device)), ones, accumulate=True)
        torch._foreach_copy_([s.penalty.counts for s in seqs], list(counts.unbind(0)))
    return counts


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos: set) -> torch.Tensor:
    """The batch's logits with each row's penalties applied (the same tensor when no row
    has any)."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.penalized]
    if not rows:
        return logits
    vocab, dev = logits.shape[-1], logits.device
    out = logits.clone()  # never write into the model's (or a CUDA graph's) output buffer
    additive = [
        i
        for i in rows
        if seqs[i].sampling.repetition_penalty != 1.0
        or seqs[i].sampling.frequency_penalty != 0.0
        or seqs[i].sampling.presence_penalty != 0.0
    ]
    if additive:
        idx = torch.tensor(additive, device=dev)
        counts = _counts([seqs[i] for i in additive], vocab, dev).to(logits.dtype)  # [b, V]
        seen_out = counts > 0

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(seqs[i].sampling, name) for i in additive], device=dev, dtype=logits.dtype)[
                :, None
            ]

        x = out[idx]
        x = x - column("frequency_penalty") * counts - column("presence_penalty") * seen_out.to(logits.dtype)
        rep = column("repetition_penalty")
        seen = seen_out | torch.stack([seqs[i].penalty.in_prompt for i in additive])
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        out[idx] = x
    r, c = [], []  # min_new_tokens: (row, token) pairs to forbid
    for i in rows:
        s = seqs[i]
        if len(s.output) < s.sampling.min_new_tokens:
            enders = set(s.sampling.stop_token_ids) | (set() if s.sampling.ignore_eos else eos)
            for t in enders:
                if 0 <= t < vocab:
                    r.append(i)
                    c.append(t)
    if r:
        out[torch.tensor(r, device=dev), torch.tensor(c, device=dev)] = float("-inf")
    return out


def min_p_mask(logp: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor | None:
    """Where each row's token is below ``min_p`` times its most likely token's probability
    (``logp``: the rows' log-softmax at their temperature), or None when no row sets min_p."""
    if not any(s.sampling.min_p > 0 for s in seqs):
        return None
    mins = to_device([s.sampling.min_p for s in seqs], logp.device, logp.dtype)
    return logp < logp.max(dim=-1, keepdim=True).values + torch.log(mins)[:, None]
