"""The original system's launch lines, unchanged, through `relay plan`: its documented
`python3 relax/entrypoints/train.py ...` lines (quoted from its GenRM documentation, only the
entry point replaced) and the examples/run-*.sh scripts that carry its argument arrays."""

from __future__ import annotations

import glob
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
