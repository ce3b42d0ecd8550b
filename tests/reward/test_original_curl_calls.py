"""The original system's documented curl calls, unchanged but for the port, against `relay
judge` (its GenRM documentation: "Verify Service Health", "Call GenRM API Directly",
"Calling a Specific Instance: route_key", "No GenRM instance registered for route_key")."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from tests.helpers import interrupt
from tests.launcher.test_launch import free_port, read_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")

HEALTH = "curl http://localhost:8000/genrm/health"
GENERATE = """curl -X POST http://localhost:8000/genrm/generate \\
  -H "Content-Type: application/json" \\
  -d '{
    "messages": [
      {"role": "user", "content": "Evaluate the answer consistency..."}
    ]
  }'"""
ROUTE_KEY = """curl -X POST http://localhost:8000/genrm/generate \\
  -H "Content-Type: application/json" \\
  -d '{
    "messages": [{"role": "user", "content": "Judge safety..."}],
    "route_key": "safety"
  }'"""


def test_the_originals_curl_calls_run_unchanged_against_relay_judge(tmp_path):
    port = free_port()
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"), RELAY_JOB_SECRET=secrets.token_hex(32))
    p = subprocess.Popen([RELAY, "judge", "--config", "tiny-cpu-split", "--port", str(port)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def curl(command: str) -> dict:
        out = subprocess.run(["bash", "-c", command.replace("localhost:8000", f"localhost:{port}")],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    try:
        read_until(p, "judge ready", 240)
        assert curl(HEALTH) == {"status": "healthy", "service": "genrm"}  # the documented response
        assert set(curl(GENERATE)) == {"response"}
        # a single-instance judge only knows "__default__": the documented clear error, not a misroute
        error = curl(ROUTE_KEY)["error"]
        assert "No GenRM instance registered for route_key='safety'" in error and "__default__" in error
    finally:
        interrupt(p)
