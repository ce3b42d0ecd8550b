"""Rewards for samples, the checks on them, advantages and the reward metrics.

A reward that raises stops the step with an error naming the reward (``--custom-rm-path``
or ``--rm-type``) and the sample; a batch whose every reward is a judge failure is not
trained on; with ``--use-fault-tolerance`` no sample whose judge call failed is trained on:
it is scored again until the judge answers (its engines are being rebuilt). Advantages are
GRPO's group-normalized rewards unless the post-process hook gave them: the hook runs on
every training batch when configured (as the original's ``post_process_rewards``), after
the batch was scored, or in Defer-swap instead of scoring it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable

from engines.trainer.train_batch import TrainBatch

from . import timeouts
from .sample import Sample, describe, is_correct
from .timing import PhaseTimer

JUDGE_AGAIN_AFTER = 1.0  # seconds before the first new try of samples the judge failed (then doubling)


class Scorer:
    """Scores samples with the configured reward function (each call a ``reward`` span of
    ``timer``), and runs the post-process hook on a batch when one is configured."""

    def __init__(self, cfg, reward_fn: Callable, post_process: Callable | None, timer: PhaseTimer):
        self.cfg = cfg
        self.reward_fn = reward_fn
        self.post_process = post_process
        self.timer = timer

    def reward_name(self) -> str:
        if self.cfg.custom_rm_path:
            return f"--custom-rm-path {self.cfg.custom_rm_path}"
        return f"--rm-type {self.cfg.rm_type}"

    async def score(self, sample: Sample) -> None:
        """Sets ``reward_info`` (what the reward returned) and ``reward`` (its
        ``--reward-key`` value; ``--eval-reward-key``'s for an eval sample when given); an
        error names the reward function and the sample."""
        from reward.rewards import reward_value

        with self.timer.span("reward"):
            try:
                result = await self.reward_fn(sample)
                sample.reward_info = result
                key = self.cfg.eval_reward_key if sample.dataset == "eval" and self.cfg.eval_reward_key else \
                    self.cfg.reward_key
                sample.reward = reward_value(result, key)
            except Exception as e:
                raise RuntimeError(f"the reward ({self.reward_name()}) failed on {describe(sample)}: "
                                   f"{type(e).__name__}: {e}") from e
        check_finite(sample.reward, f"the reward ({self.reward_name()})", sample)

    async def score_all(self, samples: list[Sample]) -> None:
        await asyncio.gather(*(self.score(s) for s in samples))
        if self.cfg.fault_tolerant:
            await self._judge_again(samples)

    async def _judge_again(self, samples: list[Sample]) -> None:
        """Score again, 1 s then up to 15 s apart, the samples whose judge call failed
        (``format_error == "judge_error"``) until none is left; after
        ``timeouts.ENGINE_REBUILD`` seconds the step fails instead."""
        deadline = time.monotonic() + timeouts.ENGINE_REBUILD
        delay = JUDGE_AGAIN_AFTER
        while failed := [s for s in samples if judge_failed(s)]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the judge failed {len(failed)} samples for {timeouts.ENGINE_REBUILD} s "
                                   f"(first: {describe(failed[0])}); not training on a batch that is not fully judged")
            await asyncio.sleep(delay)
            delay = min(2 * delay, 15.0)
            await asyncio.gather(*(self.score(s) for s in failed))

    async def score_batch(self, samples: list[Sample], group_size: int) -> None:
        """The whole batch at once (Defer-swap): the post-process hook when configured,
        which scores the batch and gives ``reward`` and ``advantage``, else
        :meth:`score_all`."""
        if self.post_process is None:
            await self.score_all(samples)
            return
        await self.post_process_batch(samples, group_size)

    async def post_process_batch(self, samples: list[Sample], group_size: int, skip: bool = False) -> list[Sample]:
        """The ``--custom-reward-post-process-path`` hook on a training batch, in every mode
        (as the original's ``post_process_rewards``): ``hook(args, samples) -> (raw,
        normalized)`` sets each sample's ``reward`` and ``advantage``. Outside Defer-swap the
        samples were scored first (``reward``/``reward_info`` set). The hook sees
        ``args.n_samples_per_prompt == group_size`` (the eval's k for an eval batch), so it
        groups the batch as it was generated. Nothing to do without a hook or with ``skip``
        (the batch is scored later, in Defer-swap). Returns ``samples``."""
        if self.post_process is None or skip:
            return samples
        args = self.cfg
        if group_size != self.cfg.n_samples_per_prompt:
            args = dataclasses.replace(self.cfg, n_samples_per_prompt=group_size)
        try:
            raw, normalized = await self.post_process(args, samples)
        except Exception as e:
            rows = sorted({s.index for s in samples})
            listed = f"{rows[:8]}{' ...' if len(rows) > 8 else ''}"
            raise RuntimeError(f"the post-process hook (--custom-reward-post-process-path "
                               f"{self.cfg.custom_reward_post_process_path}) failed on a batch of {len(samples)} "
                               f"samples (rows {listed}, first: {describe(samples[0])}): "
                               f"{type(e).__name__}: {e}") from e
        raw, normalized = list(raw), list(normalized)
        if len(raw) != len(samples) or len(normalized) != len(samples):
            raise ValueError(f"the post-process hook returned {len(raw)}/{len(normalized)} rewards for "
                             f"{len(samples)} samples")
        hook = f"the post-process hook (--custom-reward-post-process-path {self.cfg.custom_reward_post_process_path})"
        for sample, reward, advantage in zip(samples, raw, normalized):
            sample.reward, sample.advantage = float(reward), float(advantage)
            check_finite(sample.reward, hook, sample)
            check_finite(sample.advantage, hook, sample, "advantage")
        return samples


class NonFiniteReward(RuntimeError):
    """A reward or advantage that is NaN or infinite: the job stops before training on it."""


def check_finite(value: float, source: str, sample: Sample, what: str = "reward") -> None:
    """Raises :class:`NonFiniteReward` naming ``source``, the sample and the value unless
    ``value`` is a finite number: a NaN reward would turn every weight into NaN."""
    if not math.isfinite(value):
        raise NonFiniteReward(f"{source} gave {describe(sample)} the {what} {value}: rewards must be finite "
                              "numbers. Stopping before this batch trains (the weights, and the engines', are "
                              "unchanged); fix the reward function")


def judge_failed(sample: Sample) -> bool:
    """The sample's reward is the built-in judge reward's failure value (reward/dapo_genrm.py)."""
    return isinstance(sample.reward_info, dict) and sample.reward_info.get("format_error") == "judge_error"


def check_judged(samples: list[Sample], what: str) -> None:
    """A batch whose every reward is a judge failure is not trained on: stop with why."""
    if samples and all(judge_failed(s) for s in samples):
        raise RuntimeError(f"{what}: the judge failed on all {len(samples)} samples (after retries); not training on "
                           "this batch. Check the judge engines' health (GET /genrm/health) and the job log")


def advantages(samples: list[Sample], group_size: int, normalize: bool = True, normalize_std: bool = True
               ) -> list[float]:
    """The post-process hook's advantages when it gave every sample one; else GRPO's, as the
    original: each reward minus its group's mean, divided by the group's unbiased std + 1e-6
    (a group of equal rewards, or of one sample, gets 0); without ``normalize_std`` only the
    mean is taken off (``--disable-grpo-std-normalization``), without ``normalize`` the rewards
    are the advantages (``--disable-rewards-normalization``). Samples are in group order;
    groups must be complete."""
    import torch

    from engines.trainer.loss import group_advantages

    if all(s.advantage is not None for s in samples):
        return [s.advantage for s in samples]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return group_advantages(rewards, group_size, normalize_std=normalize_std, normalize=normalize).tolist()


def training_batch(samples: list[Sample], cfg, group_size: int) -> TrainBatch:
    """The trainer's input for a scored batch: token ids, response masks and rollout log-probs
    aligned on tokens 1..n, the advantages (:func:`advantages`), the rollout temperature (every
    trainer log-prob is taken at it) and the loss aggregation (``--calculate-per-token-loss``:
    ``token``; else the original's per-sample mean)."""
    adv = advantages(samples, group_size, normalize=not cfg.disable_rewards_normalization,
                     normalize_std=not cfg.disable_grpo_std_normalization)
    for sample, a in zip(samples, adv):
        check_finite(a, "the advantage computation", sample, "advantage")
    missing = [s for s in samples if s.rollout_logprobs is None]  # a custom rollout may give none
    if missing and cfg.use_tis:
        raise ValueError(f"--use-tis needs the rollout's log-probs, and {describe(missing[0])} has none: set "
                         "sample.rollout_log_probs in the --custom-generate-function-path function (from "
                         "meta_info.output_token_logprobs of a request with \"return_logprob\": true), "
                         "or drop --use-tis")
    return TrainBatch(tokens=[s.prompt_ids + s.response_ids for s in samples],
                      response_masks=[[0] * (len(s.prompt_ids) - 1) + (s.loss_mask or [1] * len(s.response_ids))
                                      for s in samples],
                      advantages=adv,
                      rollout_logprobs=None if missing else [[0.0] * (len(s.prompt_ids) - 1) + s.rollout_logprobs
                                                             for s in samples],
                      temperature=cfg.rollout_temperature,
                      aggregation="token" if cfg.calculate_per_token_loss else "sample")


def reward_metrics(samples: list[Sample], prefix: str = "reward") -> dict:
    """``<prefix>/mean|std|accuracy|format_errors|judged`` (judged: samples whose reward is
    a judge's verdict)."""
    rewards = [s.reward for s in samples]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    correct = [is_correct(s) for s in samples]
    infos = [s.reward_info for s in samples if isinstance(s.reward_info, dict)]
    return {f"{prefix}/mean": mean, f"{prefix}/std": std, f"{prefix}/accuracy": sum(correct) / len(correct),
            f"{prefix}/format_errors": sum(1 for i in infos if i.get("format_error")),
            f"{prefix}/judged": sum(1 for i in infos if i.get("judge_response"))}
