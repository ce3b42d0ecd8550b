"""Prompt data: JSONL, parquet or a local HF dataset, in the dapo-math-17k / aime-2024 schema.

Each line is an object with ``prompt`` (text, or chat messages ``[{role, content}, ...]``),
``label`` (the reference answer) and, as the original reads it, ``metadata`` (an object:
its entries are the sample's ``metadata``, e.g. ``question`` for the judge, or what an
agentic reward reads); every other key is kept as metadata too. For ``relay sft`` a line
also has ``response`` (the target text).

The order is deterministic: epoch ``e`` visits the rows in file order or (training with
``--rollout-shuffle``, and ``relay sft``) in a permutation seeded by ``(seed, e)``, and step
``s`` takes the next ``batch`` rows of that endless sequence, so a resumed run sees exactly
the prompts the original run would have.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field


class DataError(ValueError):
    """The data file is unusable; the message names the file, line and what to change."""


@dataclass
class Row:
    index: int
    prompt: str | list
    label: str
    response: str | None = None
    metadata: dict = field(default_factory=dict)


def load_rows(path: str, what: str = "--prompt-data", need_response: bool = False, input_key: str = "prompt",
              label_key: str = "label", label_for: str | None = None, metadata_key: str = "metadata") -> list[Row]:
    """The rows of a JSONL file (UTF-8), a parquet file (``.parquet``, through pyarrow) or a
    local HF ``datasets`` directory (``save_to_disk``'s: a dataset, or a dataset dict's
    ``train`` split): each row an object with the prompt under ``input_key`` (text or chat
    messages), the reference answer under ``label_key`` (required when ``label_for`` names
    what compares against it, e.g. "--rm-type dapo"; otherwise a missing or null one reads
    as ""), a ``response`` (for SFT), the row's metadata object under ``metadata_key`` (its
    entries, beside any other key of the row, are the row's metadata). Raises DataError
    naming the file and the line or row that is wrong."""
    keys = dict(need_response=need_response, input_key=input_key, label_key=label_key, label_for=label_for,
                metadata_key=metadata_key)
    if os.path.isdir(path):
        objects = _dataset_rows(path, what)
    elif path.endswith(".parquet"):
        objects = _parquet_rows(path, what)
    else:
        objects = _jsonl_rows(path, what)
    rows: list[Row] = []
    for where, obj in objects:
        rows.append(_row(len(rows), obj, f"{what}: {where}", **keys))
    if not rows:
        raise DataError(f"{what}: {path!r} has no rows")
    return rows


def _jsonl_rows(path: str, what: str):
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{what}: cannot read {path!r}: {e.strerror}") from None
    with f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{what}: {path}:{n} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                                "JSONL files are UTF-8 (parquet files end in .parquet)") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{what}: {path}:{n} is not JSON: {e}") from None
            yield f"{path}:{n}", obj


def _parquet_rows(path: str, what: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{what}: {path} is parquet, which needs pyarrow: pip install 'relay-rl[data]'") from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{what}: cannot read {path!r} as parquet: {e}") from None
    for n, obj in enumerate(table.to_pylist(), 1):
        yield f"{path} row {n}", obj


def _dataset_rows(path: str, what: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{what}: {path} is a directory: a local HF dataset needs the datasets package: "
                        "pip install 'relay-rl[data]'") from None
    try:
        data = datasets.load_from_disk(path)
    except (OSError, ValueError, FileNotFoundError) as e:
        raise DataError(f"{what}: {path} is a directory but not a dataset saved with save_to_disk: {e}") from None
    name = path
    if isinstance(data, datasets.DatasetDict):
        if "train" not in data:
            raise DataError(f"{what}: {path} holds the splits {sorted(data)}, none named 'train': give the split's "
                            f"directory ({path}/<split>)")
        data, name = data["train"], f"{path}[train]"
    for n, obj in enumerate(data, 1):
        yield f"{name} row {n}", obj


def _row(index: int, obj, where: str, *, need_response: bool, input_key: str, label_key: str,
         label_for: str | None, metadata_key: str) -> Row:
    """One row's checks, the same for every format (``where``: the flag, file and line or row)."""
    if not isinstance(obj, dict) or input_key not in obj:
        hint = "" if input_key != "prompt" else " (another key: --input-key KEY)"
        raise DataError(f"{where} needs an object with a {input_key!r} (text or chat messages){hint}")
    obj = dict(obj)
    prompt = obj.pop(input_key)
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )
    if not ok:
        raise DataError(f"{where}: {input_key!r} must be text or a list of {{role, content}} messages")
    response = obj.pop("response", None)
    if need_response and not isinstance(response, str):
        raise DataError(f"{where} needs a 'response' (the target text) for relay sft")
    label = obj.pop(label_key, None)
    if label is None and label_for:
        hint = "" if label_key != "label" else " (another key: --label-key KEY)"
        raise DataError(f"{where} has no {label_key!r}: {label_for} compares each answer with this reference "
                        f"answer{hint}")
    meta = obj.pop(metadata_key, None)
    if meta is not None and not isinstance(meta, dict):
        raise DataError(f"{where}: {metadata_key!r} must be an object (the row's metadata, as --metadata-key names "
                        f"it), not {type(meta).__name__}")
    return Row(index, prompt, "" if label is None else str(label), response, {**obj, **(meta or {})})


def row_keys(cfg) -> dict:
    """The config's data-row keys, as :func:`load_rows` takes them (``--input-key``,
    ``--label-key``, ``--metadata-key``)."""
    return dict(input_key=cfg.input_key, label_key=cfg.label_key, metadata_key=cfg.metadata_key)


def job_datasets(cfg) -> tuple[list[Row], list[tuple[str, list[Row]]]]:
    """The training rows and each evaluation set as ``(name, rows)``, read as the job reads
    them: the built-in rewards that compare with the reference need every row's label.
    Raises DataError."""
    compares = cfg.rm_type in ("dapo", "dapo-genrm") and not cfg.custom_rm_path
    label_for = f"--rm-type {cfg.rm_type}" if compares else None
    rows = load_rows(cfg.prompt_data, **row_keys(cfg), label_for=label_for)
    evals = [(name, load_rows(path, "--eval-prompt-data" if k == 0 else f"--eval-prompt-data {name}",
                              **row_keys(cfg), label_for=label_for))
             for k, (name, path) in enumerate(cfg.eval_sets)]
    return rows, evals


def question_text(prompt: str | list) -> str:
    """The last user turn of a chat prompt, or the text prompt itself."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")


def prompt_ids(
    tokenizer, prompt: str | list, apply_chat_template: bool = True, chat_template_kwargs: dict | None = None
) -> list[int]:
    """Token ids of a prompt as the policy sees it: through the chat template (a text prompt
    becomes one user turn) with the generation prompt appended, or the raw text."""
    if not apply_chat_template:
        return list(tokenizer(question_text(prompt))["input_ids"])
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {}))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class PromptOrder:
    """The endless, seeded sequence of rows (see the module docstring)."""

    def __init__(self, rows: list[Row], seed: int, shuffle: bool = True):
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle  # False: every epoch in file order (the original without --rollout-shuffle)
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        p = self._perms.get(epoch)
        if p is None:
            p = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"{self.seed}:{epoch}").shuffle(p)
            self._perms = {epoch: p}
        return p

    def batch(self, step: int, size: int) -> list[Row]:
        out = []
        for k in range(step * size, (step + 1) * size):
            epoch, i = divmod(k, len(self.rows))
            out.append(self.rows[self._perm(epoch)[i]])
        return out
