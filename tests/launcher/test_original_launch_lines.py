"""The original system's launch lines, unchanged, through `relay plan`: its documented
`python3 relax/entrypoints/train.py ...` lines (quoted from its GenRM documentation, only the
entry point replaced) and the examples/run-*.sh scripts that carry its argument arrays."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")

#: (the documentation's line, the layout `relay plan` must report)
DOC_LINES = [
    ("""python3 relax/entrypoints/train.py \\
    --genrm-model-path /path/to/genrm/model \\
    --genrm-num-gpus-per-engine 4 \\
    --genrm-engine-config '{"max_context_len": 10240}' \\
    --genrm-sampling-config '{"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 1024}' \\
    --resource '{"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 4]}' \\
    --colocate \\
    --rm-type dapo-genrm""", "colocate, Split"),
    ("""python3 relax/entrypoints/train.py \\
    --genrm-model-path /path/to/genrm/model \\
    --genrm-num-gpus-per-engine 8 \\
    --genrm-engine-config '{"max_context_len": 10240, "mem_fraction_static": 0.3}' \\
    --genrm-sampling-config '{"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 1024}' \\
    --rollout-num-gpus-per-engine 1 \\
    --sglang-mem-fraction-static 0.6 \\
    --resource '{"actor": [1, 8], "rollout": [1, 8], "genrm": [1, 8]}' \\
    --colocate \\
    --rm-type dapo-genrm""", "colocate, Shared"),
    ("""python3 relax/entrypoints/train.py \\
    --genrm-model-path /path/to/genrm/model \\
    --genrm-num-gpus-per-engine 1 \\
    --genrm-engine-config '{"max_context_len": 10240}' \\
    --genrm-sampling-config '{"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 1024}' \\
    --resource '{"actor": [1, 2], "rollout": [1, 3], "reference": [1, 1], "actor_fwd": [1, 1], "advantages": [1, 0], "genrm": [1, 1]}' \\
    --fully-async \\
    --rm-type dapo-genrm""", "fully-async"),
    ("""python3 relax/entrypoints/train.py \\
    --genrm-instances '{
        "quality": {"model_path": "/path/to/quality-judge", "num_gpus": 2, "num_gpus_per_engine": 2,
                     "sampling_config": {"temperature": 0.1, "max_response_len": 64}},
        "safety":  {"model_path": "/path/to/safety-judge",  "num_gpus": 2, "num_gpus_per_engine": 2,
                     "sampling_config": {"temperature": 0.1, "max_response_len": 32,
                                          "chat_template_kwargs": {"enable_thinking": false}}}
    }' \\
    --rollout-num-gpus 4 \\
    --resource '{"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 4]}' \\
    --colocate \\
    --custom-rm-path examples.generate_reward_model.reward_dual_genrm_quality_safety.reward_func \\
    --reward-key score""", "colocate, Split"),
]


def _plan(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RELAY_LAUNCH=f"{RELAY} plan"))


@pytest.mark.parametrize("line,layout", DOC_LINES, ids=["split", "shared", "fully-async", "dual-genrm"])
def test_the_documentations_launch_lines_plan_unchanged(line, layout):
    p = _plan(line.replace("python3 relax/entrypoints/train.py", f"{RELAY} plan", 1))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"layout: {layout}" in p.stdout


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(ROOT, "examples", "run-qwen*.sh"))),
                         ids=os.path.basename)
def test_the_example_scripts_plan_with_the_originals_argument_arrays(script):
    """Each script is the original's, with its argument arrays, under `relay train` / torchrun;
    RELAY_LAUNCH="relay plan" runs the same arguments through the planner. Flags without
    effect here say so (once each), none is refused."""
    p = _plan(f"bash {script}")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "layout: " in p.stdout
    assert "--log-passrate has no effect here: evaluation always logs eval/accuracy and eval/pass@k" in p.stderr
    assert p.stderr.count("--log-passrate has no effect") == 1


@pytest.mark.parametrize("name", ["run-qwen3-4B-8xgpu-colocated.sh", "run-qwen3-4B-8xgpu-async.sh"])
def test_the_documentations_quick_start_paths_plan(name):
    """Its Quick Start runs `bash examples/generate_reward_model/run-*.sh`: those paths work."""
    p = _plan(f"bash examples/generate_reward_model/{name}")
    direct = _plan(f"bash examples/{name}")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "layout: " in p.stdout and p.stdout == direct.stdout


def test_the_shipped_async_config_plans_as_the_documented_async_script():
    config = subprocess.run([RELAY, "plan", "--config", "qwen3-4b-8gpu-async"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, MODEL_DIR="exps", DATA_DIR="exps"))
    script = _plan("bash examples/run-qwen3-4B-8xgpu-async.sh")
    assert config.returncode == 0 and script.returncode == 0, config.stderr + script.stderr
    assert config.stdout == script.stdout and "layout: fully-async" in config.stdout


#: the colocated script's line plus the original's flags that its documented lines leave out
#: (the drop-in issues' flags), each with its meaning here
FLAG_LINES = {
    "batching": "--rollout-shuffle --rollout-seed 42 --use-dynamic-batch-size --max-tokens-per-gpu 9216",
    "data": "--apply-chat-template --apply-chat-template-kwargs '{\"enable_thinking\": false}' "
            "--metadata-key extra_info --eval-reward-key acc",
    "eval-sets": "--eval-prompt-data aime ${DATA_DIR}/aime-2024/aime-2024.jsonl "
                 "math500 ${DATA_DIR}/math-500/math-500.jsonl",
    "custom-rollout": "--custom-generate-function-path examples.generate_reward_model.agentic_rollout.generate "
                      "--custom-rm-path examples.generate_reward_model.agentic_routing.agentic_reward_func "
                      "--genrm-instances '{\"planner_judge\": {\"model_path\": \"j\", \"num_gpus\": 1}, "
                      "\"tool_call_judge\": {\"model_path\": \"j\", \"num_gpus\": 1}, "
                      "\"final_answer_judge\": {\"model_path\": \"j\", \"num_gpus\": 2}}'",
    "dp-attention": "--engine sglang --genrm-num-gpus-per-engine 4 "
                    "--genrm-engine-config '{\"dp_size\": 4, \"ep_size\": 4, \"max_context_len\": 10240}'",
    "loss": "--calculate-per-token-loss --disable-rewards-normalization --disable-grpo-std-normalization "
            "--adam-beta1 0.9 --adam-beta2 0.98 --adam-eps 1e-8 --eval-temperature 0.6 --entropy-coef 0.001",
}


@pytest.fixture
def data_dir(tmp_path):
    """The scripts' ${DATA_DIR} files, a few rows each (a metadata object under 'extra_info')."""
    rows = [{"prompt": f"What is {n} mod 10?", "label": str(n % 10), "extra_info": {"source": "corpus", "n": n}}
            for n in range(20, 26)]
    for name in ("dapo-math-17k/dapo-math-17k.jsonl", "aime-2024/aime-2024.jsonl", "math-500/math-500.jsonl"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(tmp_path)


def _launch(command: str, launch: str, data_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, RELAY_LAUNCH=launch, DATA_DIR=data_dir))


@pytest.mark.parametrize("name", sorted(FLAG_LINES))
def test_launch_lines_with_every_flag_plan_and_dry_run(name, data_dir):
    command = f"bash examples/run-qwen3-4B-8xgpu-colocated.sh {FLAG_LINES[name]}"
    plan = _launch(command, f"{RELAY} plan", data_dir)
    assert plan.returncode == 0, plan.stderr[-2000:]
    dry = _launch(command, f"{RELAY} train --dry-run", data_dir)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "unknown" not in dry.stderr and "refused" not in dry.stderr and "dry run: nothing was started" in dry.stdout
    assert f"--prompt-data {data_dir}/dapo-math-17k/dapo-math-17k.jsonl: 6 rows" in dry.stdout
    if name == "data":  # the row's metadata object, by --metadata-key
        assert "metadata keys ['n', 'source']" in dry.stdout
    if name == "eval-sets":
        assert "eval set 'aime'" in dry.stdout and "eval set 'math500'" in dry.stdout
    if name == "custom-rollout":
        assert "custom rollout examples.generate_reward_model.agentic_rollout.generate: imported" in dry.stdout


@pytest.mark.parametrize("script", sorted(glob.glob(os.path.join(ROOT, "examples", "run-qwen*.sh"))),
                         ids=os.path.basename)
def test_the_example_scripts_dry_run_on_their_data(script, data_dir):
    dry = _launch(f"bash {script}", f"{RELAY} train --dry-run", data_dir)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert "6 rows" in dry.stdout and "not on this machine" in dry.stdout  # the models are the cluster's


def test_a_dry_run_refuses_data_the_job_could_not_read(data_dir):
    bad = os.path.join(data_dir, "dapo-math-17k", "dapo-math-17k.jsonl")
    with open(bad, "a") as f:
        f.write('{"prompt": "no label"}\n')
    dry = _launch("bash examples/run-qwen3-4B-8xgpu-colocated.sh", f"{RELAY} train --dry-run", data_dir)
    assert dry.returncode == 2 and f"relay train --dry-run: --prompt-data: {bad}:7 has no 'label'" in dry.stderr
