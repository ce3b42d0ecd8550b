"""The trainer's boundary: what one optimizer step trains on (:class:`TrainBatch`) and what it
reports (:class:`StepStats`), both typed messages on relay's wire.

The loss is aggregated as the original (slime / Relax) aggregates it, over the whole
optimizer step whatever the data-parallel size, micro-batching or which rank got the long
answers: ``sample`` (the default) averages each sample's token-mean over the step's samples;
``token`` (``--calculate-per-token-loss``) is the mean over the step's response tokens. A
shard made by :meth:`TrainBatch.shard` carries the whole step's ``denominator``, so each rank
weights its tokens by their share of the step, and the DP ranks' gradients (and figures) add
up to the step's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import relay

AGGREGATIONS = ("sample", "token")


def check_response_masks(seqs: list, response_masks: list) -> None:
    """Raises ValueError unless there is one mask per sequence, each covering its tokens 1..n
    (``len(seq) - 1`` entries)."""
    if len(response_masks) != len(seqs):
        raise ValueError(f"{len(seqs)} sequences and {len(response_masks)} response masks: one per sequence")
    for i, (seq, mask) in enumerate(zip(seqs, response_masks)):
        if len(mask) != len(seq) - 1:
            raise ValueError(f"sequence {i}: its response mask covers {len(mask)} tokens, not tokens 1..n "
                             f"({len(seq) - 1})")


@relay.register(name="engines.TrainBatch")
@dataclass
class TrainBatch:
    """One optimizer step's samples, or one data-parallel rank's shard of them.

    ``tokens[i]``: sequence i's prompt + response token ids. ``response_masks[i][t]``: 1 where
    token t+1 of sequence i is a response token (the masks, and every log-prob list, cover
    tokens 1..n). ``advantages[i]``: sample i's advantage (every response token gets it).
    ``rollout_logprobs``: the engines' (TIS, ``mismatch_kl``); ``ref_logprobs``: the reference
    model's (KL); ``old_logprobs``: the policy's before this rollout's first optimizer step
    (None: this is that step, whose own forward gives them). ``temperature``: the rollout's;
    every log-prob the trainer computes (current, old, reference) divides the logits by it,
    as the engines' do. ``aggregation``: ``sample`` or ``token`` (module docstring).
    ``denominator``: the whole step's sample count (``sample``) or response-token count
    (``token``) over every DP rank's shard; None: this batch is the whole step."""

    tokens: list
    response_masks: list
    advantages: list
    rollout_logprobs: list | None = None
    ref_logprobs: list | None = None
    old_logprobs: list | None = None
    temperature: float = 1.0
    aggregation: str = "sample"
    denominator: float | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def validate(self) -> None:
        """Raises ValueError naming what is wrong: lengths that disagree, a mask or log-prob
        list not covering tokens 1..n, a non-finite advantage, a bad temperature or aggregation."""
        n = len(self.tokens)
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {self.aggregation!r}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a positive number (the rollout's), not {self.temperature!r}")
        if self.denominator is not None and not self.denominator > 0:
            raise ValueError(f"denominator must be positive, not {self.denominator!r}")
        if len(self.response_masks) != n or len(self.advantages) != n:
            raise ValueError(f"{n} sequences, {len(self.response_masks)} response masks and {len(self.advantages)} "
                             "advantages: one of each per sequence")
        for name in ("rollout_logprobs", "ref_logprobs", "old_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{name}: {len(values)} rows for {n} sequences")
        check_response_masks(self.tokens, self.response_masks)
        for i, seq in enumerate(self.tokens):
            for name in ("rollout_logprobs", "ref_logprobs", "old_logprobs"):
                values = getattr(self, name)
                if values is not None and len(values[i]) > len(seq) - 1:
                    raise ValueError(f"sequence {i}: {len(values[i])} {name} for {len(seq) - 1} tokens")
        bad = next((i for i, a in enumerate(self.advantages) if not math.isfinite(a)), None)
        if bad is not None:
            raise ValueError(f"sequence {bad}'s advantage is {self.advantages[bad]}: not training on it")

    def total(self) -> int:
        """This batch's own count in the loss's denominator: samples or response tokens."""
        if self.aggregation == "sample":
            return len(self.tokens)
        return sum(sum(m) for m in self.response_masks)

    def select(self, indices: list[int]) -> TrainBatch:
        """The samples at ``indices``, in that order (the denominator is kept)."""

        def pick(values):
            return None if values is None else [values[i] for i in indices]

        return replace(self, tokens=pick(self.tokens), response_masks=pick(self.response_masks),
                       advantages=pick(self.advantages), rollout_logprobs=pick(self.rollout_logprobs),
                       ref_logprobs=pick(self.ref_logprobs), old_logprobs=pick(self.old_logprobs))

    def optimizer_steps(self, global_batch_size: int) -> list[TrainBatch]:
        """Consecutive runs of ``global_batch_size`` samples: one per optimizer step, each its
        own whole step (denominator unset)."""
        return [replace(self.select(list(range(i, min(i + global_batch_size, len(self))))), denominator=None)
                for i in range(0, len(self), global_batch_size)]

    def shard(self, dp: int) -> list[TrainBatch]:
        """Round-robin shards of this step, one per DP rank, each carrying the step's
        denominator. With fewer samples than ranks every rank takes the whole batch (no rank
        may be left without data), and the denominator counts it ``dp`` times, so the ranks'
        shares still add up to the step."""
        if len(self) < dp:
            return [replace(self, denominator=self.total() * dp)] * dp
        return [replace(self.select(list(range(rank, len(self), dp))), denominator=self.total()) for rank in range(dp)]


@relay.register(name="engines.StepStats")
@dataclass
class StepStats:
    """One rank's figures of one optimizer step. ``shares``: the loss and the per-token figures
    (``pg_clipfrac``, ``ppo_kl``, ``entropy``, ``kl``, ``tis``, ``tis_clipfrac``,
    ``mismatch_kl``, ``rollout_logprob_abs_diff``), each this rank's share of the step's
    aggregate (the loss's weights), so the DP ranks' values add up to the step's.
    ``rank_means``: figures of this rank alone (``moe_load_balancing_loss``), averaged over
    ranks; ``maxima``: largest values (``rollout_logprob_abs_diff_max``: the largest |trainer -
    engine| log-prob gap of a response token), the largest over ranks. ``grad_norm`` (before
    clipping) and ``lr`` are the same on every rank. Read like a dict: ``stats["loss"]``."""

    grad_norm: float
    lr: float
    shares: dict = field(default_factory=dict)
    rank_means: dict = field(default_factory=dict)
    maxima: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {**self.shares, **self.rank_means, **self.maxima, "grad_norm": self.grad_norm, "lr": self.lr}

    def __getitem__(self, key: str):
        return self.as_dict()[key]

    def __iter__(self):
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())

    def __contains__(self, key: str) -> bool:
        return key in self.as_dict()

    def keys(self):
        return self.as_dict().keys()

    def get(self, key: str, default=None):
        return self.as_dict().get(key, default)

    @classmethod
    def combine(cls, ranks: list[StepStats]) -> StepStats:
        """The step's figures from every DP rank's (one per DP rank)."""
        shares = {k: sum(r.shares.get(k, 0.0) for r in ranks) for k in ranks[0].shares}
        means = {k: sum(r.rank_means[k] for r in ranks if k in r.rank_means) /
                 sum(k in r.rank_means for r in ranks) for k in ranks[0].rank_means}
        maxima = {k: max(r.maxima.get(k, float("-inf")) for r in ranks) for k in ranks[0].maxima}
        return cls(ranks[0].grad_norm, ranks[0].lr, shares, means, maxima)
