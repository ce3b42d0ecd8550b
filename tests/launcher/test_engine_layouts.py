"""What a judge's engine_config asks of the built-in engine: ep_size expert-parallel groups
within an engine where they fit (else a warning: not used), a warning that pipeline
parallelism is SGLang's, and dp_size (SGLang's data-parallel attention) refused naming
--engine sglang, at plan time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from launcher.config import ConfigError, load_config
from launcher.config.checks import check_job

pytestmark = pytest.mark.unit
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")


def config(engine_config: str, per_engine: str = "2"):
    return load_config("tiny-cpu-split", ["--genrm-num-gpus-per-engine", per_engine, "--genrm-engine-config",
                                          engine_config])


def test_dp_size_is_sglangs_and_the_built_in_engine_refuses_it_at_plan_time(tmp_path):
    """The original's 397B judge (TP = DP = EP = 8) runs data-parallel attention inside one
    SGLang engine; the built-in engine would have run 8 whole-model replicas, one per GPU."""
    with pytest.raises(ConfigError, match="dp_size 2 is SGLang's data-parallel attention inside one tensor-parallel "
                                          "engine of 2 GPUs; the built-in engine does not run it. Use --engine sglang"):
        check_job(config('{"dp_size": 2}'))
    check_job(load_config("tiny-cpu-split", ["--genrm-num-gpus-per-engine", "2", "--genrm-engine-config",
                                             '{"dp_size": 2}', "--engine", "sglang"]))
    p = subprocess.run([RELAY, "plan", "--config", "tiny-cpu-split", "--genrm-num-gpus-per-engine", "2",
                        "--genrm-engine-config", '{"dp_size": 2}'], capture_output=True, text=True, timeout=120,
                       cwd=str(tmp_path))
    assert p.returncode == 2 and "Use --engine sglang" in p.stderr, p.stderr


def test_the_pipeline_size_is_sglangs_and_the_built_in_engine_says_so(caplog):
    check_job(config('{"pp_size": 2, "ep_size": 2}'))  # ep_size 2 over the engine's 2 GPUs: its expert groups
    assert "pp_size 2 is for --engine sglang; the built-in engine runs each engine tensor-parallel" in caplog.text
    assert "ep_size" not in caplog.text


def test_an_ep_size_beyond_an_engines_gpus_is_not_used_by_the_built_in_engine_and_it_says_so(caplog):
    from engines.interface import backend_options

    check_job(config('{"ep_size": 4}'))
    assert "ep_size 4 does not divide the engine's 2 GPUs" in caplog.text
    options = {"gpu_ids": [0, 1], "engine_config": {"ep_size": 4}}
    assert backend_options("torch", options)["ep_size"] == 1
    assert backend_options("torch", {**options, "gpu_ids": list(range(4))})["ep_size"] == 4


@pytest.mark.parametrize("engine_config,says", [
    ('{"dp_size": 0}', "dp_size must be a positive integer, got 0"),
    ('{"ep_size": 0}', "ep_size must be a positive integer, got 0"),
])
def test_a_bad_dp_size_is_refused_naming_the_key(engine_config, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        check_job(config(engine_config))
