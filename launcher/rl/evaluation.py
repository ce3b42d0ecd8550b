"""Evaluation of the policy on the held-out prompts (``--eval-prompt-data``, one set or the
original's several named ones), between steps."""

from __future__ import annotations

import asyncio

from .rollout import group_seed, sampling_options
from .sample import chunks, flatten, is_correct


async def evaluate(loop, step: int) -> dict:
    """Pass rate and pass@k of ``loop``'s policy (a :class:`~launcher.rl.loop.GRPOLoop`;
    engines awake) on every eval set (``loop.eval_sets``: (name, rows)), as one ``eval``
    metrics record: ``eval/<name>/<figure>`` per named set, and the first set's figures
    unprefixed (``eval/accuracy``...). The configured reward scores them (Defer-swap: in one
    judge window, after which the rollout gets its weights back). They are sampled at
    ``--eval-temperature`` (default: the rollout's, as the original; ``eval/temperature``).
    Figures: ``accuracy`` (the reward's), ``pass@k``, ``exact_accuracy`` (a rule-based check
    that needs no judge: the response's final answer, the text after the last "Answer:" else
    the whole reply, equals the label exactly after stripping whitespace),
    ``distinct_answers`` (the mean number of different answers per prompt: 1 when greedy) and
    ``samples``."""
    cfg = loop.cfg
    k = cfg.n_samples_per_eval_prompt
    started = loop.timer.clock()
    sampling = sampling_options(cfg, evaluation=True)

    async def one_set(rows) -> list:
        return await asyncio.gather(*(
            loop._group(row, k, sampling, group_seed(cfg.sampling_seed, -1, row.index), i, score=not loop.defer,
                        dataset="eval")
            for i, row in enumerate(rows)))

    per_set = await asyncio.gather(*(one_set(rows) for _, rows in loop.eval_sets))
    if loop.defer:

        async def score() -> None:
            with loop.timer.phase("reward"):
                for groups in per_set:
                    await loop.scorer.score_batch(flatten(groups), k)

        await loop._judge_window(score, resume_rollout=True)
    record: dict = {"kind": "eval", "step": step, "eval/k": k, "eval/temperature": sampling["temperature"]}
    for n, ((name, _), groups) in enumerate(zip(loop.eval_sets, per_set)):
        figures = set_figures(groups, k)
        if n == 0:
            record.update({f"eval/{key}": value for key, value in figures.items()})
        if name != "eval":  # the default name: its figures are the unprefixed ones
            record.update({f"eval/{name}/{key}": value for key, value in figures.items()})
    record["time/eval"] = loop.timer.clock() - started
    return record


def set_figures(groups: list, k: int) -> dict:
    """One eval set's figures (see :func:`evaluate`) from its groups of ``k`` samples."""
    from reward.dapo_genrm import final_answer

    samples = flatten(groups)
    correct = [is_correct(s) for s in samples]
    exact = [final_answer(s.response).strip() == s.label.strip() for s in samples]
    return {"accuracy": sum(correct) / len(correct), "pass@k": sum(any(g) for g in chunks(correct, k)) / len(groups),
            "exact_accuracy": sum(exact) / len(exact),
            "distinct_answers": sum(len({s.response for s in g}) for g in groups) / len(groups),
            "samples": len(samples)}


def eval_lines(record: dict, names: list[str], when: str) -> list[str]:
    """The console lines of an eval record, one per set: ``<name> <when>: accuracy ...``."""
    lines = []
    for n, name in enumerate(names):
        p = "eval/" if n == 0 else f"eval/{name}/"
        line = f"{name} {when}: accuracy {record[p + 'accuracy']:.3f} (exact {record[p + 'exact_accuracy']:.3f}"
        if when != "before training":
            line += f", pass@{record['eval/k']} {record[p + 'pass@k']:.3f}"
        lines.append(line + ")")
    return lines
