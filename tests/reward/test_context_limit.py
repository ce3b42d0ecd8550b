"""The judge's ``engine_config.max_context_len`` (the original's default 8192): a request
whose prompt and response budget do not fit gets 400 naming the limit, through ``relay
judge``'s HTTP gateway; a request that fits is answered."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from tests.helpers import interrupt, live_pids_by_env
from tests.launcher.test_launch import free_port, read_until
from tests.reward.test_original_curl_calls import RELAY, ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def post(port: int, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/genrm/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_judge_request_beyond_max_context_len_gets_400_naming_the_limit(tmp_path):
    port = free_port()
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"), RELAY_JOB_SECRET=secrets.token_hex(32),
               RELAY_TEST_TAG="context-limit")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    p = subprocess.Popen([RELAY, "judge", "--config", "tiny-cpu-split", "--port", str(port), "--genrm-engine-config",
                          '{"max_context_len": 64}'], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        read_until(p, "judge ready", 240)
        # each of the judge's two engine processes sees its own GPU
        seen = [e.get(b"CUDA_VISIBLE_DEVICES") for e in live_pids_by_env().values()
                if e.get(b"RELAY_TEST_TAG") == b"context-limit"]
        assert sorted(v for v in seen if v is not None) == [b"0", b"1"], seen
        status, body = post(port, {"messages": [{"role": "user", "content": "x" * 200}]})
        assert status == 400, body
        assert "exceeds the engine's max_context_len 64" in body["error"], body
        # a prompt that cannot fit whatever its tokens is refused before it is tokenized (it was
        # tokenized in full, on the engines, first)
        started = time.monotonic()
        status, body = post(port, {"messages": [{"role": "user", "content": "x" * 1_000_000}]})
        assert status == 400 and "characters: at least" in body["error"], body
        assert "past the engines' max_context_len 64" in body["error"] and time.monotonic() - started < 2.0
        status, body = post(port, {"messages": [{"role": "user", "content": "1"}], "sampling_params": {
            "max_new_tokens": 4}})
        assert status == 200 and "response" in body, body
    finally:
        interrupt(p)



def start_relay_judge(tmp_path, port: int, *args: str):
    """``relay judge --config tiny-cpu-split --port PORT ARGS`` as a user types it, with its own
    cache and secret; returns the process once it said it is ready (the caller stops it)."""
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"), RELAY_JOB_SECRET=secrets.token_hex(32))
    p = subprocess.Popen([RELAY, "judge", "--config", "tiny-cpu-split", "--port", str(port), *args], cwd=ROOT,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        read_until(p, "judge ready", 240)
    except BaseException:
        p.kill()
        p.communicate()
        raise
    return p
