"""A generated sample, and the bookkeeping over lists of them: groups, DP shards, accuracy.

Reward code (``--custom-rm-path`` functions, the post-process hook, the built-in rewards)
receives :class:`Sample` objects with the original system's attributes (``prompt``,
``response``, ``label``, ``metadata`` with ``question`` and ``label``, ``reward``,
``status``, ``tokens``, ``response_length``, ``rollout_log_probs``, ``loss_mask``,
``Sample.Status``, ``get_reward_value(args)``); a ``--custom-generate-function-path``
function sets ``tokens``, ``response_length``, ``response``, ``loss_mask``,
``rollout_log_probs`` and ``status`` as slime's contract does (:meth:`Sample.settle` checks
them). They read as attributes (``sample.response``) and, as the samples of earlier versions
were plain dicts, also by key: ``sample["response"]``,
``sample.get("metadata") or {}``, ``"reward_info" in sample``, ``dict(sample)``, and
``sample["reward_info"] = ...`` from a post-process hook. A key that is not a field is
kept in :attr:`Sample.extra`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from ..data import Row, question_text

T = TypeVar("T")


class Status(Enum):
    """How the sample's generation ended."""

    COMPLETED = "completed"  # the engine stopped at an end token or a stop string
    TRUNCATED = "truncated"  # the response reached the length limit
    ABORTED = "aborted"  # generation was cut short (fully-async drain); still scored
    PENDING = "pending"  # the original's other states, for reward code that compares with them;
    FAILED = "failed"  # a sample handed to reward code here is never in either

    @classmethod
    def from_finish_reason(cls, finish_reason: str) -> Status:
        if finish_reason == "length":
            return cls.TRUNCATED
        if finish_reason == "abort":
            return cls.ABORTED
        return cls.COMPLETED


#: fields that are unset (None) until the sample is scored; an unset one is not a key
_SET_LATER = ("reward", "reward_info", "advantage")


@dataclass
class Sample:
    """One response to one prompt, from generation to training.

    Set at generation: where it comes from (``index``: the data row; ``dataset``: "train"
    or "eval"; ``group_index``: its prompt's group in data order), what the policy saw and
    wrote (``prompt``, ``prompt_ids``, ``response``, ``response_ids``, ``rollout_logprobs``
    one per response token), how generation ended (``finish_reason`` as the engine said it,
    ``status``) and the policy's ``weight_version``. Set by scoring: ``reward`` (the number
    the trainer uses), ``reward_info`` (what the reward function returned), and
    ``advantage`` when a post-process hook gives normalized rewards.

    A custom rollout (``--custom-generate-function-path``) may also set ``loss_mask`` (one 0/1
    per response token: 0 for what the policy did not write, such as a tool's output; None:
    all 1) and leave ``rollout_logprobs`` None (then no TIS, no ``mismatch_kl``)."""

    index: int
    dataset: str
    group_index: int
    prompt: str | list
    label: str
    metadata: dict
    prompt_ids: list[int]
    response_ids: list[int]
    response: str
    rollout_logprobs: list[float] | None
    finish_reason: str
    weight_version: int
    status: Status = Status.COMPLETED
    reward: float | None = None
    reward_info: Any = None
    advantage: float | None = None
    extra: dict = field(default_factory=dict)
    loss_mask: list[int] | None = None
    #: ``tokens`` / ``response_length`` as a custom rollout set them, until :meth:`settle`
    _pending: dict = field(default_factory=dict, repr=False, compare=False)

    #: ``Sample.Status.TRUNCATED`` etc., as the original nests it
    Status = Status

    # ---- the original's other attribute names, for reward code written against it

    @property
    def tokens(self) -> list[int]:
        """The prompt's token ids, then the response's."""
        return self._pending.get("tokens", self.prompt_ids + self.response_ids)

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        self._pending["tokens"] = list(value)

    @property
    def response_length(self) -> int:
        """The last ``response_length`` of ``tokens`` are the response."""
        return self._pending.get("response_length", len(self.response_ids))

    @response_length.setter
    def response_length(self, value: int) -> None:
        self._pending["response_length"] = value

    @property
    def rollout_log_probs(self) -> list[float] | None:
        return self.rollout_logprobs

    @rollout_log_probs.setter
    def rollout_log_probs(self, value: list[float] | None) -> None:
        self.rollout_logprobs = None if value is None else list(value)

    def settle(self, where: str) -> Sample:
        """Split ``tokens`` at ``response_length`` (as a custom rollout set them) into the prompt
        and response ids, and check the response's mask and log-probs against it; a ValueError
        names ``where`` (the function) and what to change."""
        tokens, n = self.tokens, self.response_length
        self._pending.clear()
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise ValueError(f"{where}: sample.tokens must be a list of token ids (prompt, then response)")
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < len(tokens):
            raise ValueError(f"{where}: sample.response_length must be an integer in [0, {len(tokens)}) (the last "
                             f"response_length of sample.tokens's {len(tokens)} are the response), got {n!r}")
        self.prompt_ids, self.response_ids = tokens[: len(tokens) - n], tokens[len(tokens) - n :]
        for name, values in (("loss_mask", self.loss_mask), ("rollout_log_probs", self.rollout_logprobs)):
            if values is not None and len(values) != n:
                raise ValueError(f"{where}: sample.{name} has {len(values)} entries for {n} response tokens: give "
                                 "one per response token (or None)")
        if self.loss_mask is not None:
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError(f"{where}: sample.loss_mask must hold 0 or 1 per response token")
            self.loss_mask = [int(m) for m in self.loss_mask]
        if self.status is Status.PENDING:  # a function that never set it: it generated to the end
            self.status = Status.COMPLETED
        if not isinstance(self.status, Status) or self.status is Status.FAILED:
            raise ValueError(f"{where}: sample.status must be Sample.Status.COMPLETED, TRUNCATED or ABORTED when it "
                             f"returns, got {self.status!r}")
        return self

    def get_reward_value(self, args=None) -> float | None:
        """The number the trainer uses (``reward`` is already the ``--reward-key`` value)."""
        return self.reward

    @classmethod
    def generated(cls, row: Row, dataset: str, group_index: int, prompt_ids: list[int], result) -> Sample:
        """The sample of an engine's ``GenerateResult`` for ``row``; ``metadata`` is the
        row's metadata (the original's ``sample.metadata``), with ``question`` (the prompt's
        text) and ``label`` added where the row has none (the judge prompt reads them)."""
        return cls(
            index=row.index, dataset=dataset, group_index=group_index, prompt=row.prompt, label=row.label,
            metadata={"question": question_text(row.prompt), "label": row.label, **row.metadata},
            prompt_ids=prompt_ids, response_ids=list(result.token_ids), response=result.text,
            rollout_logprobs=list(result.logprobs), finish_reason=result.finish_reason,
            weight_version=result.weight_version, status=Status.from_finish_reason(result.finish_reason),
        )

    # ---- dict-style access, for reward code written against dict samples

    def keys(self) -> list[str]:
        """The fields that are set, then the extra keys."""
        return [n for n in _FIELD_KEYS if not (n in _SET_LATER and getattr(self, n) is None)] + list(self.extra)

    def __getitem__(self, key: str) -> Any:
        if key in self.extra:
            return self.extra[key]
        if key not in _FIELD_KEYS:
            raise KeyError(key)
        value = getattr(self, key)
        if value is None and key in _SET_LATER:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _FIELD_KEYS:
            setattr(self, key, value)
        else:
            self.extra[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


#: the fields that read as keys (all but ``extra``, whose entries are keys themselves)
_FIELD_KEYS = tuple(f.name for f in dataclasses.fields(Sample) if f.name not in ("extra", "_pending"))


# ---------------------------------------------------------------------------- bookkeeping


def chunks(items: list[T], size: int) -> list[list[T]]:
    """Consecutive runs of ``size`` items (the last may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def flatten(groups: list[list[T]]) -> list[T]:
    return [item for group in groups for item in group]


def shard_over_dp(chunk: list[T], dp: int) -> list[list[T]]:
    """Round-robin shards of one optimizer step's items, one per DP rank. With fewer items
    than DP ranks every rank takes the whole chunk (no rank may be left without data)."""
    shards = [chunk[rank::dp] for rank in range(dp)]
    if any(not shard for shard in shards):
        return [chunk] * dp
    return shards


def is_correct(sample: Sample) -> bool:
    """Whether a sample counts as correct, for ``reward/accuracy`` and ``eval/accuracy``
    alike: the reward's own ``acc`` when it returned a dict with one, else reward > 0."""
    info = sample.reward_info
    if isinstance(info, dict) and "acc" in info:
        return bool(info["acc"])
    return sample.reward > 0


def describe(sample: Sample) -> str:
    """Which sample, for error messages: its row, data set, question and label."""
    question = question_text(sample.prompt)
    return (f"the sample of row {sample.index} ({sample.dataset} data; question {question[:80]!r}, "
            f"label {sample.label!r})")


def truncated_fraction(samples: list[Sample]) -> float:
    return sum(s.status is Status.TRUNCATED for s in samples) / len(samples)


def rollout_metrics(samples: list[Sample], rollout_seconds: float) -> dict:
    """``rollout/response_len|tokens_per_s|truncated|min_weight_version`` of a batch."""
    lengths = [len(s.response_ids) for s in samples]
    return {"rollout/response_len": sum(lengths) / len(lengths),
            "rollout/tokens_per_s": sum(lengths) / max(rollout_seconds, 1e-9),
            "rollout/truncated": truncated_fraction(samples),
            "rollout/min_weight_version": min(s.weight_version for s in samples)}


SAMPLES_DIR = "samples"


def write_samples(run_dir: str, step: int, samples: list, advantages: list, template: str | None = None) -> str:
    """``--save-debug-rollout-data``: the step's samples as JSONL,
    ``RUN_DIR/samples/step_NNNNNN.jsonl`` (``step``: the steps done with it), one line each:
    its group and index, prompt, label, response, finish reason, weight version, reward, the
    reward's details (the judge's verdict and reply for dapo-genrm) and the advantage it trains
    with (``advantages``: the training batch's, one per sample). With ``template``
    (``--save-debug-rollout-path``): at ``template.format(rollout_id=step - 1)`` instead, a
    ``.pt`` path holding ``torch.save({"rollout_id", "samples": [dict]})`` as the original's.
    Written to a temporary name and renamed; returns the path."""
    import json
    import os

    rows = [{"group": s.group_index, "index": s.index, "prompt": s.prompt, "label": s.label, "response": s.response,
             "finish_reason": s.finish_reason, "weight_version": s.weight_version, "reward": s.reward,
             "reward_info": s.reward_info, "advantage": float(advantage)} for s, advantage in zip(samples, advantages)]
    if template is None:
        folder = os.path.join(run_dir, SAMPLES_DIR)
        path = os.path.join(folder, f"step_{step:06d}.jsonl")
    else:
        path = os.path.abspath(template.format(rollout_id=step - 1))
        folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    if path.endswith(".pt"):
        import torch

        torch.save({"rollout_id": step - 1, "samples": json.loads(json.dumps(rows, default=str))}, path + ".tmp")
    else:
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
    os.replace(path + ".tmp", path)
    return path
