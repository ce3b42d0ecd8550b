"""End to end with ``--engine sglang``: ``relay train`` (Split, Defer-swap) and ``relay judge``
start one SGLang server per engine, spanning its GPUs, with the arguments the original
computes, and drive them through SGLang's own routes. The server is the protocol-faithful
fake (tests/engines/fake_sglang.py: same arguments, routes and shapes as the pinned sglang
version of engines/sglang/protocol.json), started by the adapter in place of
``python -m sglang.launch_server`` (``RELAY_SGLANG_LAUNCH``); it records every request to a
file (``FAKE_SGLANG_RECORD``) that these tests read. Its tokens are deterministic, not a
model's: what is tested is the launcher path, the arguments and the call sequence."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from engines.sglang.args import protocol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

RELAY = os.path.join(os.path.dirname(sys.executable), "relay")  # the console script a user types


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engines.models.model_builder import make_model
    from launcher.demo_task import write_demo_data

    root = tmp_path_factory.mktemp("sglang-e2e")
    return {
        "policy": make_model("qwen3", "tiny", str(root / "policy"), seed=1),
        "judge": make_model("qwen3", "tiny", str(root / "judge"), seed=7),
        "train": write_demo_data(str(root / "data"))["train"],
        "cache": str(root / "cache"),
    }


def fake_env(tiny: dict, record: str, **more) -> dict:
    os.makedirs(record, exist_ok=True)
    return dict(os.environ, PYTHONPATH=ROOT, RELAY_CACHE=tiny["cache"], RELAY_SGLANG_LAUNCH="tests.engines.fake_sglang",
                FAKE_SGLANG_RECORD=record, **more)


def servers(record: str) -> list[dict]:
    """One per server: its start (argv, env, pid) and its requests, in order."""
    out = []
    for name in sorted(os.listdir(record)):
        with open(os.path.join(record, name)) as f:
            entries = [json.loads(line) for line in f]
        assert entries[0]["event"] == "start"
        argv = entries[0]["argv"]
        flags = dict(zip(argv, argv[1:]))
        out.append({**entries[0], "flags": flags, "requests": entries[1:], "model": flags["--model-path"]})
    return out


def expected_argv(model: str, port: str, base_gpu: int, extra: list[str]) -> list[str]:
    return ["--model-path", model, "--host", "127.0.0.1", "--port", port, "--device", "cpu", "--tp-size", "1",
            "--dp-size", "1", "--pp-size", "1", "--ep-size", "1", "--base-gpu-id", str(base_gpu), "--gpu-id-step",
            "1", *extra]


def calls(server: dict) -> list[tuple]:
    """The control calls in order (a run of /generate is one ("generate",) entry)."""
    out: list[tuple] = []
    for r in server["requests"]:
        if r["path"] == "/generate":
            if not out or out[-1] != ("generate",):
                out.append(("generate",))
            continue
        body = r["body"] or {}
        detail = body.get("tags") or body.get("mode") or body.get("weight_version")
        out.append((r["path"].lstrip("/"), *([detail] if detail is not None else [])))
    return out


def check_protocol(server: dict) -> None:
    """Every request is a route and method of the pinned version with keys it takes."""
    record = protocol()
    for r in server["requests"]:
        assert r["method"] in record["routes"][r["path"]], r
        body = r["body"] or {}
        assert set(body) <= set(record["requests"].get(r["path"], ())), r  # /flush_cache takes no body
        assert set(body.get("sampling_params") or {}) <= set(record["sampling_params"]), r


def check_gone(all_servers: list[dict]) -> None:
    for s in all_servers:
        with pytest.raises(ProcessLookupError):
            os.kill(s["pid"], 0)


DRAIN_RELEASE = [("pause_generation", "abort"), ("abort_request",), ("flush_cache",)]
ALL = ["weights", "kv_cache", "cuda_graph"]  # the CUDA graphs go and come back with the KV cache


def rollout_step(version: str) -> list[tuple]:
    return [("generate",), *DRAIN_RELEASE, ("release_memory_occupation", ALL),
            ("resume_memory_occupation", ["weights"]), ("update_weights_from_tensor", version),
            ("resume_memory_occupation", ["kv_cache", "cuda_graph"]), ("continue_generation",)]


def train(tiny: dict, config: str, run_dir: str, record: str, *extra: str) -> None:
    cmd = [RELAY, "train", "--config", config, "--engine", "sglang",
           "--prompt-data", tiny["train"], "--run-dir", run_dir, "--num-rollout", "2", "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "8", "--global-batch-size", "32", "--rollout-max-response-len", "4",
           "--genrm-gateway-port", "0", "--hf-checkpoint", tiny["policy"], "--genrm-model-path", tiny["judge"],
           "--genrm-sampling-config", '{"temperature": 0.0, "max_response_len": 8}', "--genrm-parse", "loose",
           "--lr", "1e-3", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=360, env=fake_env(tiny, record))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "shut down cleanly" in p.stdout
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if r.get("kind") == "train"]
    engines = len(recs[0]["sync/engine_versions"])
    assert [r["sync/engine_versions"] for r in recs] == [[1] * engines, [2] * engines]


def check_rollout(rollouts: list[dict], policy: str) -> None:
    saver = ["--max-total-tokens", "16384", "--enable-memory-saver", "--cuda-graph-backend-prefill", "disabled",
             "--skip-server-warmup"]
    for gpu, s in enumerate(rollouts):
        assert s["argv"] == expected_argv(policy, s["flags"]["--port"], gpu, saver)  # no weights CPU backup
        assert s["env"] == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpu + 1))),
                            "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true", "PYTORCH_CUDA_ALLOC_CONF": None}
        assert calls(s) == rollout_step("1") + rollout_step("2") + [("generate",)]  # the last: the probe
    updates = [[r["tensors"] for r in s["requests"] if r["path"] == "/update_weights_from_tensor"] for s in rollouts]
    from safetensors import safe_open

    with safe_open(os.path.join(policy, "model.safetensors"), "pt") as f:
        sums = {name: float(f.get_tensor(name).double().sum()) for name in f.keys()}
    assert all(set(u) == set(sums) for per_server in updates for u in per_server)  # every weight, every version
    assert updates[0] == updates[1]  # both engines got the same weights
    # The fake's tokens are no model's, so the judge's verdicts carry no signal (the gradient is 0) and the
    # weights each sync delivers are the trainer's unchanged ones: the checkpoint's, value for value.
    assert updates[0][0] == pytest.approx(sums, rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("config", ["tiny-cpu-split", "tiny-cpu-defer"])
def test_relay_train_starts_sglang_servers_with_the_originals_arguments_and_syncs_through_its_routes(
    config, tiny, tmp_path
):
    record = str(tmp_path / "record")
    train(tiny, config, str(tmp_path / "run"), record)
    got = servers(record)
    for s in got:
        check_protocol(s)
    check_gone(got)
    rollouts = sorted((s for s in got if s["model"] == tiny["policy"]), key=lambda s: int(s["flags"]["--base-gpu-id"]))
    judges = sorted((s for s in got if s["model"] == tiny["judge"]), key=lambda s: int(s["flags"]["--base-gpu-id"]))
    assert len(rollouts) == 2 and len(judges) == 2
    check_rollout(rollouts, tiny["policy"])
    # judges: the engine config's fraction and context length, memory saver, weights kept in CPU memory
    judge_args = ["--mem-fraction-static", "0.3" if config == "tiny-cpu-split" else "0.8", "--context-length", "8192",
                  "--max-total-tokens", "16384", "--enable-memory-saver", "--cuda-graph-backend-prefill", "disabled",
                  "--enable-weights-cpu-backup", "--skip-server-warmup"]
    first = 2 if config == "tiny-cpu-split" else 0  # Split: bundles 2-3; Defer-swap: the rollout's own
    release = [*DRAIN_RELEASE, ("release_memory_occupation", ALL)]
    wake = [("resume_memory_occupation", ALL), ("continue_generation",)]
    for i, s in enumerate(judges):
        assert s["argv"] == expected_argv(tiny["judge"], s["flags"]["--port"], first + i, judge_args)
        assert not [r for r in s["requests"] if "weights" in r["path"] and "memory" not in r["path"]]  # never synced
        if config == "tiny-cpu-split":  # awake while the rollout generates, asleep while the trainer trains
            assert calls(s) == ([("generate",)] + release + wake) * 2
        else:  # asleep from the start, awake only to score each batch
            assert calls(s) == release + (wake + [("generate",)] + release) * 2


def test_fully_async_updates_live_sglang_servers_paused_in_retract_mode(tiny, tmp_path):
    """Dedicated pools: no memory saver, nothing released; each weight version goes in while
    the server is paused in retract mode (requests in flight resume after the update)."""
    record = str(tmp_path / "record")
    train(tiny, "tiny-cpu-async", str(tmp_path / "run"), record, "--max-staleness", "1")
    got = servers(record)
    for s in got:
        check_protocol(s)
    check_gone(got)
    (rollout,) = [s for s in got if s["model"] == tiny["policy"]]
    (judge,) = [s for s in got if s["model"] == tiny["judge"]]
    # bundles: actor 0-1, rollout 2, judge 3; no memory saver (they never sleep)
    assert rollout["argv"] == expected_argv(tiny["policy"], rollout["flags"]["--port"], 2, [
        "--max-total-tokens", "16384", "--enable-weights-cpu-backup", "--skip-server-warmup"])
    assert judge["argv"] == expected_argv(tiny["judge"], judge["flags"]["--port"], 3, [
        "--mem-fraction-static", "0.3", "--context-length", "8192", "--max-total-tokens", "16384",
        "--enable-weights-cpu-backup", "--skip-server-warmup"])
    assert rollout["env"]["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] is None
    control = [c for c in calls(rollout) if c != ("generate",)]
    live = [("pause_generation", "retract"), ("update_weights_from_tensor", "1"), ("continue_generation",),
            ("pause_generation", "retract"), ("update_weights_from_tensor", "2"), ("continue_generation",)]
    assert control[:6] == live and all(c == ("abort_request",) for c in control[6:])  # aborts: the run's end
    assert {r["path"] for r in judge["requests"]} == {"/generate"}


@pytest.mark.timeout(480)
def test_relay_judge_starts_one_sglang_server_per_engine_and_serves_through_it(tiny, tmp_path):
    from tests.launcher.test_launch import free_port, read_until

    record, port = str(tmp_path / "record"), free_port()
    env = fake_env(tiny, record, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    for key in ("RELAY_JOB_SECRET", "RELAY_JOB_SECRET_FILE", "RELAY_JOB_ID"):
        env.pop(key, None)
    cmd = [RELAY, "judge", "--config", "tiny-cpu-split", "--engine", "sglang",
           "--genrm-model-path", tiny["judge"], "--port", str(port)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        read_until(p, "judge ready", 300)
        body = json.dumps({"messages": [{"role": "user", "content": "Is 2+2=4? Reply 1 or 0."}],
                           "sampling_params": {"max_new_tokens": 3}}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/genrm/generate", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        p.send_signal(signal.SIGINT)
        p.wait(60)
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()
    assert len(answer["response"]) == 3  # the fake's three tokens, as text
    got = servers(record)
    check_gone(got)
    assert sorted(int(s["flags"]["--base-gpu-id"]) for s in got) == [0, 1]  # --resource genrm: 2 engines x 1 GPU
    for s in got:
        check_protocol(s)
        gpu = int(s["flags"]["--base-gpu-id"])
        # no memory saver (relay judge shares its GPUs with nobody); weights CPU backup as for every judge
        assert s["argv"] == expected_argv(tiny["judge"], s["flags"]["--port"], gpu, [
            "--mem-fraction-static", "0.3", "--context-length", "8192", "--max-total-tokens", "8192",
            "--enable-weights-cpu-backup", "--skip-server-warmup"])
        assert s["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, range(gpu + 1)))
        assert s["env"]["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] is None
        assert {r["path"] for r in s["requests"]} <= {"/generate"}
    generated = [r for s in got for r in s["requests"] if r["path"] == "/generate"]
    assert len(generated) == 1 and generated[0]["body"]["sampling_params"]["max_new_tokens"] == 3
    assert generated[0]["body"]["input_ids"] and "text" not in generated[0]["body"]  # tokenized by the engine actor
