"""Evaluation of the policy on the held-out prompts (``--eval-prompt-data``, one set or the
original's several named ones), between steps."""

from __future__ import annotations

import asyncio

from .rollout import group_seed, sampling_options
from .sample import chunks, flatten, is_correct


async def evaluate(cfg, eval_sets: list, step: int, *, timer, layout, group, scorer, judge_window) -> dict:
    """Pass rate and pass@k of the policy (engines awake) on every eval set (``eval_sets``:
    (name, rows)), sampled by ``group(row, k, sampling, seed, index, score=, dataset=)`` (the
    loop's) and scored by ``scorer``, as one ``eval``
    metrics record: ``eval/<name>/<figure>`` per named set, and the first set's figures
    unprefixed (``eval/accuracy``...). The configured reward scores them (when the judge takes
    turns, ``layout.judge_takes_turns``: in one ``judge_window``, after which the rollout gets
    its weights back). They are sampled at
    ``--eval-temperature`` (default: the rollout's, as the original; ``eval/temperature``).
    Figures: ``accuracy`` (the reward's), ``pass@k``, ``exact_accuracy`` (a rule-based check
    that needs no judge: the response's final answer, the text after the last "Answer:" else
    the whole reply, equals the label exactly after stripping whitespace),
    ``distinct_answers`` (the mean number of different answers per prompt: 1 when greedy) and
    ``samples``."""
    k = cfg.n_samples_per_eval_prompt
    started = timer.clock()
    sampling = sampling_options(cfg, evaluation=True)

    async def one_set(rows) -> list:
        return await asyncio.gather(*(
            group(row, k, sampling, group_seed(cfg.sampling_seed, -1, row.index), i,
                  score=not layout.judge_takes_turns, dataset="eval")
            for i, row in enumerate(rows)))

    per_set = await asyncio.gather(*(one_set(rows) for _, rows in eval_sets))
    if layout.judge_takes_turns:

        async def score() -> None:
            with timer.phase("reward"):
                for groups in per_set:
                    await scorer.score_batch(flatten(groups), k)

        await judge_window(score, resume_rollout=True)
    record: dict = {"kind": "eval", "step": step, "eval/k": k, "eval/temperature": sampling["temperature"]}
    for n, ((name, _), groups) in enumerate(zip(eval_sets, per_set)):
        figures = set_figures(groups, k)
        if n == 0:
            record.update({f"eval/{key}": value for key, value in figures.items()})
        if name != "eval":  # the default name: its figures are the unprefixed ones
            record.update({f"eval/{name}/{key}": value for key, value in figures.items()})
    record["time/eval"] = timer.clock() - started
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
