"""Evaluation of the policy on the held-out prompts (``--eval-prompt-data``), between steps."""

from __future__ import annotations

import asyncio

from .rollout import group_seed, sampling_options
from .sample import chunks, flatten, is_correct


async def evaluate(loop, step: int) -> dict:
    """Pass rate and pass@k of ``loop``'s policy (a :class:`~launcher.rl.loop.GRPOLoop`;
    engines awake) on its eval prompts, as an ``eval`` metrics record. The configured reward
    scores them (Defer-swap: in a judge window, after which the rollout gets its weights
    back). They are sampled at ``--eval-temperature`` (default: the rollout's, as the
    original; ``eval/temperature``); ``eval/distinct_answers`` is the mean number of
    different answers per prompt (1 when greedy). ``eval/exact_accuracy`` is a rule-based
    check that needs no judge: the response's final answer (text after the last "Answer:",
    else the whole reply) equals the label exactly, after stripping whitespace."""
    from reward.dapo_genrm import final_answer

    cfg = loop.cfg
    k = cfg.n_samples_per_eval_prompt
    started = loop.timer.clock()
    sampling = sampling_options(cfg, evaluation=True)
    groups = await asyncio.gather(*(
        loop._group(row, k, sampling, group_seed(cfg.sampling_seed, -1, row.index), i,
                    score=not loop.defer, dataset="eval")
        for i, row in enumerate(loop.eval_rows)))
    samples = flatten(groups)
    if loop.defer:

        async def score() -> None:
            with loop.timer.phase("reward"):
                await loop.scorer.score_batch(samples, k)

        await loop._judge_window(score, resume_rollout=True)
    correct = [is_correct(s) for s in samples]
    exact = [final_answer(s.response).strip() == s.label.strip() for s in samples]
    return {"kind": "eval", "step": step, "eval/accuracy": sum(correct) / len(correct),
            "eval/pass@k": sum(any(g) for g in chunks(correct, k)) / len(groups), "eval/k": k,
            "eval/temperature": sampling["temperature"],
            "eval/distinct_answers": sum(len({s.response for s in g}) for g in groups) / len(groups),
            "eval/exact_accuracy": sum(exact) / len(exact), "eval/samples": len(samples),
            "time/eval": loop.timer.clock() - started}
