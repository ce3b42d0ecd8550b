"""`relay judge` serves a Qwen3.5 hybrid judge (``qwen3_5_moe``: Gated DeltaNet linear
attention, gated full attention, MoE with a shared expert) through the gateway: its greedy
answers are transformers' greedy answers to the same chat-templated prompts. And `relay judge`
refuses a bad engine_config before starting anything."""

from __future__ import annotations

import os
import secrets
import subprocess

import pytest

from tests.helpers import interrupt
from tests.launcher.test_launch import free_port, read_until
from tests.reward.test_context_limit import post
from tests.reward.test_original_curl_calls import RELAY, ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

PROMPTS = ["Is 2+2=4?", "Answer: 17\nReference: 17", "Which is larger, 3 or 5?"]


def transformers_answers(path: str, new_tokens: int) -> list[str]:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    out = []
    for prompt in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return out


def test_relay_judge_serves_a_qwen35_hybrid_judge_as_transformers_answers(tmp_path):
    from engines.models.model_builder import make_model

    judge = make_model("qwen3_5_moe", "tiny", str(tmp_path / "q35-judge"), seed=7)
    port = free_port()
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"), RELAY_JOB_SECRET=secrets.token_hex(32))
    p = subprocess.Popen([RELAY, "judge", "--config", "tiny-cpu-split", "--port", str(port), "--genrm-model-path",
                          judge], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        read_until(p, "judge ready", 300)
        answers = []
        for prompt in PROMPTS:
            status, body = post(port, {"messages": [{"role": "user", "content": prompt}],
                                       "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}})
            assert status == 200, body
            answers.append(body["response"])
    finally:
        interrupt(p)
    assert answers == transformers_answers(judge, 8)


@pytest.mark.parametrize("engine_config,says", [
    ('{"ep_size": 0}', "ep_size must be a positive integer, got 0"),
    ('{"dp_size": 3}', "dp_size 3 is SGLang's data-parallel attention inside one tensor-parallel engine"),
])
def test_relay_judge_refuses_a_bad_engine_config_before_starting_anything(tmp_path, engine_config, says):
    """relay judge checks each judge's engine_config as relay train does: exit 2 naming the
    key (an ep_size of 0 crashed an engine with ZeroDivisionError before)."""
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"), RELAY_JOB_SECRET=secrets.token_hex(32))
    p = subprocess.run([RELAY, "judge", "--config", "tiny-cpu-split", "--genrm-num-gpus-per-engine", "2",
                        "--port", str(free_port()), "--genrm-engine-config", engine_config], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert says in p.stderr and "Traceback" not in p.stderr
