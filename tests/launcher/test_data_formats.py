"""Prompt data as JSONL, parquet or a local HF ``datasets`` directory: the same rows, the
same row checks, errors naming the file and the row (issue 48)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher.data import DataError, load_rows

pytestmark = pytest.mark.integration
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
ROWS = [
    {"prompt": "What is 1+1?", "label": "2", "metadata": {"question": "1+1", "source": "a"}},
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "label": "4", "metadata": {"question": "2+2",
                                                                                        "source": "b"}},
    {"prompt": "What is 3+3?", "label": "6", "metadata": {"question": "3+3", "source": "c"}},
]


def _write(tmp_path, rows, kind: str) -> str:
    if kind == "jsonl":
        path = tmp_path / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return str(path)
    import datasets

    path = tmp_path / kind
    data = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({"train": data, "test": data}) if kind == "dict" else data).save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["parquet", "dataset", "dict"])
def test_every_format_gives_the_rows_jsonl_gives(tmp_path, kind):
    """Text prompts and chat prompts (one type per column, as parquet and datasets hold them),
    labels and metadata objects: the same rows as the JSONL file of the same objects."""
    text_only = [r for r in ROWS if isinstance(r["prompt"], str)]  # one prompt type per column
    chat_only = [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in text_only]
    for rows in (text_only, chat_only):
        (tmp_path / kind).mkdir(exist_ok=True)
        want = load_rows(_write(tmp_path / kind, rows, "jsonl"))
        got = load_rows(_write(tmp_path / kind, rows, kind))
        assert [(r.index, r.prompt, r.label, r.metadata) for r in got] == [
            (r.index, r.prompt, r.label, r.metadata) for r in want]


@pytest.mark.parametrize("kind", ["parquet", "dataset"])
def test_a_bad_row_is_named_by_its_file_and_row(tmp_path, kind):
    rows = [ROWS[0], {"prompt": "no label here", "metadata": {"question": "x", "source": "d"}}]
    path = _write(tmp_path, rows, kind)
    assert len(load_rows(path)) == 2  # a missing label reads as "" unless a grader needs it
    with pytest.raises(DataError, match=rf"--prompt-data: {path}.* row 2 has no 'label': --rm-type dapo compares"):
        load_rows(path, label_for="--rm-type dapo")
    with pytest.raises(DataError, match=r"row 1 needs an object with a 'problem'"):
        load_rows(path, input_key="problem")


def test_missing_readers_and_unreadable_files_say_what_to_do(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"cannot read '.*x\.parquet' as parquet"):
        load_rows(str(tmp_path / "x.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is a directory but not a dataset saved with save_to_disk"):
        load_rows(str(tmp_path / "empty"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"needs pyarrow: pip install 'relay-rl\[data\]'"):
        load_rows(str(tmp_path / "x.parquet"))
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"needs the datasets package: pip install 'relay-rl\[data\]'"):
        load_rows(str(tmp_path / "empty"))


def test_relay_train_dry_run_reads_a_parquet_file_as_the_job_does(tmp_path):
    path = _write(tmp_path, [r for r in ROWS if isinstance(r["prompt"], str)], "parquet")
    p = subprocess.run([RELAY, "train", "--config", "tiny-cpu-split", "--prompt-data", path, "--dry-run"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"--prompt-data {path}: 2 rows; row 0: question 'What is 1+1?'" in p.stdout, p.stdout
