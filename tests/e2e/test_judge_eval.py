"""``relay judge eval`` (issue 50): a trained judge scored on labelled pairs through the
training reward's path, and a second side compared on the same pairs in one run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_grpo_modes import ROOT, TEMPLATE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600, func_only=True)]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")


def test_judge_eval_scores_pairs_and_compares_a_second_side(data, tmp_path):
    with open(data["eval"]) as f:
        rows = [json.loads(line) for line in f][:12]
    pairs = []
    for row in rows:
        question = row["prompt"][0]["content"] if isinstance(row["prompt"], list) else row["prompt"]
        wrong = str((int(row["label"]) + 3) % 10)
        pairs += [{"question": question, "label": row["label"], "response": row["label"], "expected": 1},
                  {"question": question, "label": row["label"], "response": wrong, "expected": 0}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    out = tmp_path / "eval"
    p = subprocess.run(
        [RELAY, "judge", "eval", "--config", "tiny-cpu-split", "--data", str(path), "--out", str(out),
         "--genrm-model-path", data["judge"], "--genrm-prompt-template", TEMPLATE, "--genrm-parse", "loose",
         "--genrm-sampling-config", '{"temperature": 0.0, "max_response_len": 8}',
         "--compare", "--genrm-parse strict"],
        cwd=ROOT, capture_output=True, text=True, timeout=500, env=dict(os.environ, RELAY_CACHE=data["cache"]))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert f"relay judge eval: {len(pairs)} pairs from {path}" in p.stdout and "agreement" in p.stdout
    with open(out / "eval.json") as f:
        report = json.load(f)
    assert set(report) == {"A", "B"}
    for side in ("A", "B"):
        fig = report[side]["__default__"]
        assert fig["pairs"] == len(pairs)
        assert sum(sum(row.values()) for row in fig["confusion"].values()) == len(pairs)
        assert sum(fig["confusion"]["expected_1"].values()) == len(pairs) // 2
        with open(fig["wrong_file"]) as f:
            wrong = [json.loads(line) for line in f]
        assert len(wrong) == len(pairs) - fig["right"]
        assert all(not w["ok"] and w["verdict"] != w["expected"] for w in wrong)
        assert fig["parse_failures"] == fig["confusion"]["expected_1"]["unreadable"] + fig["confusion"][
            "expected_0"]["unreadable"]
    assert report["A"]["__default__"]["agreement"] >= 0.75  # the demo's trained judge, on its own task


def test_judge_eval_refuses_unreadable_pairs_naming_the_flag(tmp_path):
    p = subprocess.run([RELAY, "judge", "eval", "--config", "tiny-cpu-split", "--data", str(tmp_path / "none.jsonl")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"--data {tmp_path / 'none.jsonl'}: cannot read it (No such file" in p.stderr, p.stderr
    (tmp_path / "bad.jsonl").write_text('{"label": "1"}\n')
    p = subprocess.run([RELAY, "judge", "eval", "--config", "tiny-cpu-split", "--data", str(tmp_path / "bad.jsonl")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "bad.jsonl:1: a row needs label, response and expected" in p.stderr, p.stderr
