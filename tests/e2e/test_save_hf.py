"""`relay train --save-hf DIR`: the GRPO policy as HF checkpoints, as the original saves them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_grpo_modes import ROOT, records, train_cmd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600, func_only=True)]
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")


def test_grpo_writes_hf_checkpoints_that_load_in_transformers_with_the_trainers_log_probs(data, tmp_path):
    """--save-interval 1 over 2 steps: DIR/step_000001 and DIR/step_000002. The last one,
    loaded in transformers, gives the greedy probe token the log-prob the rollout engines
    reported after the last weight sync (the trainer's weights): within 1e-4."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.config import load_config
    from launcher.data import load_rows, prompt_ids

    run_dir, hf_dir = str(tmp_path / "run"), str(tmp_path / "hf")
    cmd = [RELAY, *train_cmd("tiny-cpu-split", data, run_dir, "--save-interval", "1", "--save-hf", hf_dir)[3:]]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env=dict(os.environ, RELAY_CACHE=data["cache"]))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(os.listdir(hf_dir)) == ["step_000001", "step_000002"]
    assert f"wrote the HF checkpoint of step 2 to {hf_dir}/step_000002" in p.stdout
    last = records(run_dir)[-1]
    model = AutoModelForCausalLM.from_pretrained(os.path.join(hf_dir, "step_000002"), torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(hf_dir, "step_000002"))
    cfg = load_config("tiny-cpu-split")
    row = load_rows(data["train"])[0]
    ids = prompt_ids(tokenizer, row.prompt, cfg.apply_chat_template, cfg.chat_template_kwargs)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, -1)
    token = int(logprobs.argmax())
    assert token == last["sync/probe_tokens"][0], json.dumps(last)[:500]
    assert float(logprobs[token]) == pytest.approx(last["sync/probe_logprobs"][0], abs=1e-4)
