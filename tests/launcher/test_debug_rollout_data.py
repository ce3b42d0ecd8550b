"""``--save-debug-rollout-data`` in both forms: bare (RUN_DIR/samples/step_NNNNNN.jsonl) and
the original's ``--save-debug-rollout-data PATH`` (a template formatted with ``{rollout_id}``,
the 0-based step; ``.pt`` files hold ``torch.save({"rollout_id", "samples"})`` as the
original's, anything else JSONL); a template that does not format is refused at load time."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from launcher.config import ConfigError, load_config
from launcher.rl.sample import write_samples


def samples(n: int = 3) -> list:
    return [SimpleNamespace(group_index=i // 2, index=i, prompt=f"p{i}", label="7", response=f"Answer: {i}",
                            finish_reason="stop", weight_version=2, reward=float(i == 1),
                            reward_info={"acc": int(i == 1), "judge_response": "1" if i == 1 else "0"})
            for i in range(n)]


def test_the_originals_path_form_sets_the_template_and_the_bare_form_does_not():
    cfg = load_config(None, ["--save-debug-rollout-data", "/tmp/dbg/rollout_{rollout_id}.pt", "--lr", "1e-6"])
    assert cfg.save_debug_rollout_data is True and cfg.save_debug_rollout_path == "/tmp/dbg/rollout_{rollout_id}.pt"
    assert cfg.lr == 1e-6  # the flag after it is still read
    cfg = load_config(None, ["--save-debug-rollout-data=/tmp/x_{rollout_id}.jsonl"])
    assert cfg.save_debug_rollout_path == "/tmp/x_{rollout_id}.jsonl"
    cfg = load_config(None, ["--save-debug-rollout-data", "--lr", "1e-6"])
    assert cfg.save_debug_rollout_data is True and cfg.save_debug_rollout_path is None
    assert load_config(None, ["--save-debug-rollout-data", "false"]).save_debug_rollout_data is False


def test_a_template_that_does_not_format_is_refused_naming_the_placeholder():
    with pytest.raises(ConfigError, match=r"takes \{rollout_id\} only.*KeyError: 'step'"):
        load_config(None, ["--save-debug-rollout-data", "/tmp/x_{step}.pt"])


def test_a_pt_template_gets_the_originals_torch_save_and_others_jsonl(tmp_path):
    path = write_samples(str(tmp_path / "run"), 3, samples(), [0.5, -1.0, 0.5],
                         str(tmp_path / "dbg" / "rollout_{rollout_id}.pt"))
    assert path == str(tmp_path / "dbg" / "rollout_2.pt")  # the third step: rollout_id 2
    data = torch.load(path, weights_only=True)
    assert data["rollout_id"] == 2 and [s["index"] for s in data["samples"]] == [0, 1, 2]
    assert data["samples"][1]["reward_info"]["judge_response"] == "1" and data["samples"][1]["advantage"] == -1.0
    path = write_samples(str(tmp_path / "run"), 1, samples(2), [1.0, 1.0],
                         str(tmp_path / "dbg" / "r{rollout_id}.jsonl"))
    assert [json.loads(line)["response"] for line in open(path)] == ["Answer: 0", "Answer: 1"]
    bare = write_samples(str(tmp_path / "run"), 1, samples(1), [0.0])
    assert bare == str(tmp_path / "run" / "samples" / "step_000001.jsonl")
    assert not list((tmp_path / "dbg").glob("*.tmp"))
