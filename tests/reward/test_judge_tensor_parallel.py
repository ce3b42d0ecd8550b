"""`relay judge` runs a built-in engine over several GPUs: with ``--genrm-num-gpus-per-engine
2`` its one engine is two processes (rank 0 and a follower, each seeing its own GPU), it
answers greedily exactly as the one-GPU engines do, ``GET /genrm/engines`` shows the ranks,
and a follower killed mid-run brings the whole engine back on both GPUs."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
import urllib.request

import pytest

from tests.helpers import interrupt, live_pids_by_env
from tests.launcher.test_launch import free_port, read_until
from tests.reward.test_context_limit import post
from tests.reward.test_original_curl_calls import RELAY, ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

PROMPTS = ["Is 2+2=4?", "Answer: 17\nReference: 17", "Which is larger, 3 or 5?"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}


def _engine_procs(tag: str) -> dict[int, bytes]:
    """pid -> CUDA_VISIBLE_DEVICES of every live judge engine process of this test."""
    return {pid: env.get(b"CUDA_VISIBLE_DEVICES", b"") for pid, env in live_pids_by_env().items()
            if env.get(b"RELAY_TEST_TAG") == tag.encode() and env.get(b"RELAY_PROC_ID", b"").startswith(b"judge-")}


def _answers(port: int) -> list[str]:
    out = []
    for prompt in PROMPTS:
        status, body = post(port, {"messages": [{"role": "user", "content": prompt}], "sampling_params": GREEDY})
        assert status == 200, body
        out.append(body["response"])
    return out


def _judge(tmp_path, tag: str, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"), RELAY_JOB_SECRET=secrets.token_hex(32),
               RELAY_TEST_TAG=tag)
    p = subprocess.Popen([RELAY, "judge", "--config", "tiny-cpu-split", "--port", str(port), *args], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p, port


def test_relay_judge_serves_a_tensor_parallel_engine_and_rebuilds_it_when_a_rank_dies(tmp_path):
    p, port = _judge(tmp_path, "judge-tp1")
    try:
        read_until(p, "judge ready", 240)
        expected = _answers(port)
    finally:
        interrupt(p)

    p, port = _judge(tmp_path, "judge-tp2", "--genrm-num-gpus-per-engine", "2")
    try:
        read_until(p, "judge ready", 240)
        procs = _engine_procs("judge-tp2")
        assert sorted(procs.values()) == [b"0", b"1"], procs  # two ranks, each on its own GPU
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/genrm/engines", timeout=30) as r:
            report = json.loads(r.read())["instances"]["__default__"]
        (engine,) = report["engines"]
        assert engine["gpus"] == [0, 1] and engine["tp"] == 2 and engine["dp"] == 1, engine
        assert engine["state"] == "awake", engine
        assert _answers(port) == expected  # TP=2 greedy == TP=1 greedy

        follower = next(pid for pid, gpu in procs.items() if gpu == b"1")
        os.kill(follower, signal.SIGKILL)
        read_until(p, "is back", 240)
        deadline = time.monotonic() + 30
        while True:
            now = _engine_procs("judge-tp2")
            if len(now) == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(now.values()) == [b"0", b"1"] and not set(now) & set(procs), (procs, now)
        assert _answers(port) == expected
    finally:
        interrupt(p)
    assert not _engine_procs("judge-tp2")
