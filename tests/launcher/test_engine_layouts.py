"""What a judge's engine_config asks of the built-in engine: dp_size replicas within an
engine's GPUs, ep_size expert-parallel groups within a replica where they fit (else a
warning: not used), and a warning that pipeline parallelism is SGLang's."""

from __future__ import annotations

import json

import pytest

from launcher.allocator import make_plan
from launcher.config import ConfigError, load_config
from launcher.job_checks import check_job
from launcher.rl.engine_pool import replicas

pytestmark = pytest.mark.unit


def config(engine_config: str, per_engine: str = "2"):
    return load_config("tiny-cpu-split", ["--genrm-num-gpus-per-engine", per_engine, "--genrm-engine-config",
                                          engine_config])


def test_dp_size_splits_each_engine_into_replicas_of_its_gpus():
    cfg = config('{"dp_size": 2}')
    check_job(cfg)
    (claim,) = [c for c in make_plan(cfg).claims if c.role == "genrm"]
    assert replicas(cfg, claim, [["b2", "b3"]]) == [["b2"], ["b3"]]
    assert replicas(config("{}"), claim, [["b2", "b3"]]) == [["b2", "b3"]]  # one engine over both


def test_the_pipeline_size_is_sglangs_and_the_built_in_engine_says_so(caplog):
    check_job(config('{"pp_size": 2, "ep_size": 2}'))  # ep_size 2 over the engine's 2 GPUs: its expert groups
    assert "pp_size 2 is for --engine sglang; the built-in engine runs each engine tensor-parallel" in caplog.text
    assert "ep_size" not in caplog.text


@pytest.mark.parametrize("engine_config,gpus", [('{"ep_size": 4}', 2), ('{"dp_size": 2, "ep_size": 2}', 1)])
def test_an_ep_size_beyond_a_replicas_gpus_is_not_used_by_the_built_in_engine_and_it_says_so(caplog, engine_config,
                                                                                             gpus):
    """The original's 397B judge asks TP = DP = EP = 8 of SGLang (all inside one engine); the
    built-in engine's dp_size makes replicas, so such an ep_size is dropped with a warning."""
    from engines.interface import backend_options

    check_job(config(engine_config))
    assert f"does not divide each replica's {gpus} GPUs" in caplog.text
    ep = json.loads(engine_config)["ep_size"]
    options = {"gpu_ids": list(range(gpus)), "engine_config": json.loads(engine_config)}
    assert backend_options("torch", options)["ep_size"] == 1
    assert backend_options("torch", {**options, "gpu_ids": list(range(ep))})["ep_size"] == ep


@pytest.mark.parametrize("engine_config,says", [
    ('{"dp_size": 3}', "dp_size 3 does not divide the engine's 2 GPUs"),
    ('{"dp_size": 0}', "dp_size must be a positive integer, got 0"),
    ('{"ep_size": 0}', "ep_size must be a positive integer, got 0"),
])
def test_a_bad_dp_size_is_refused_naming_the_key(engine_config, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        check_job(config(engine_config))
