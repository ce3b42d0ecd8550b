"""Reaching `relay judge` from outside: where its secret is, and the error a client with a
wrong or missing secret gets (at once, not after its 600 s call timeout)."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from tests.launcher.test_launch import free_port, read_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MSG = [{"role": "user", "content": "Is 2+2=4? Answer 1 or 0."}]

# A reward-code process outside the job: the default client (call timeout 600 s).
CLIENT = textwrap.dedent(
    f"""
    import asyncio, json, sys
    from reward.client import get_genrm_client
    async def main():
        client = get_genrm_client(sys.argv[1] if len(sys.argv) > 1 else None)  # else RELAY_GENRM_ADDR
        assert client.timeout == 1800.0  # the original's default
        try:
            text = await client.generate({MSG!r})
            print(json.dumps({{"response": text}}))
        except Exception as e:
            print(json.dumps({{"type": type(e).__name__, "error": str(e)}}))
    asyncio.run(main())
    """
)


def _env(**changes) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RELAY_JOB_SECRET", "RELAY_JOB_SECRET_FILE", "RELAY_JOB_ID")
    }
    env["PYTHONPATH"] = ROOT
    env.update(changes)
    return env


def _client(addr: str, env: dict, shell_prefix: str = "") -> dict:
    """Run the client in a process of its own, bounded by 30 s (its calls' own timeout is
    1800 s: only the handshake can end it this soon). With ``shell_prefix``, bash runs it
    first (e.g. the exports `relay judge` printed) and the client takes its address from
    the environment."""
    if shell_prefix:
        cmd = ["bash", "-c", f'{shell_prefix} && exec "$0" -c "$1"', sys.executable, CLIENT]
    else:
        cmd = [sys.executable, "-c", CLIENT, addr]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(480)  # the judge's start, on a loaded 2-core machine, dominates
def test_relay_judge_without_a_secret_writes_it_to_a_0600_file_that_clients_use(tmp_path):
    port = free_port()
    cache = tmp_path / "xdg"
    env = _env(RELAY_CACHE=str(tmp_path / "cache"), XDG_CACHE_HOME=str(cache), RELAY_AUTH_LOG_INTERVAL="3")
    p = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "judge", "--config", "tiny-cpu-split", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = read_until(p, "judge ready", 300)
        path = str(cache / "relay" / f"judge-{port}.secret")
        addr = re.search(r"relay address for reward code: (\S+)\)", out).group(1)
        assert f"relay secret: written to {path} (readable by you only; a new one each start)" in out
        exports = f"export RELAY_GENRM_ADDR={addr} RELAY_JOB_SECRET_FILE={path}"
        assert f"  reward code outside this process: {exports}\n" in out
        assert f"  (or instead of the file: export RELAY_JOB_SECRET=$(cat {path}))\n" in out
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        secret = open(path).read().strip()
        assert len(bytes.fromhex(secret)) == 32

        # The two ways the judge printed work, as printed.
        assert "response" in _client(addr, _env(), shell_prefix=exports)
        assert "response" in _client(
            addr, _env(), shell_prefix=f"export RELAY_GENRM_ADDR={addr} && export RELAY_JOB_SECRET=$(cat {path})"
        )
        # No secret, a wrong one: the error names the secret and what to set.
        for env_changes, origin in (
            ({}, "this process has no RELAY_JOB_SECRET (nor RELAY_JOB_SECRET_FILE)"),
            ({"RELAY_JOB_SECRET": secrets.token_hex(32)}, "this process's secret comes from RELAY_JOB_SECRET"),
        ):
            got = _client(addr, _env(**env_changes))
            assert got["type"] == "AuthenticationError", got
            assert got["error"].startswith(
                f"judge client: the relay process at {addr} rejected this process: not authenticated"
            )
            assert origin in got["error"]
            assert (
                "export RELAY_JOB_SECRET=<the server's hex secret>, or RELAY_JOB_SECRET_FILE=<a file holding it>"
                in got["error"]
            )
            assert "`relay judge` prints the file that holds its secret" in got["error"]

        # The judge counts what it rejected, in /genrm/metrics.
        url = f"http://127.0.0.1:{port}/genrm/metrics"
        m = json.loads(subprocess.run(["curl", "-s", url], capture_output=True, text=True, timeout=30).stdout)
        assert m["relay"]["dropped_unauthenticated"] == 2 and m["relay"]["auth_rejections_sent"] == 2
        assert m["relay"]["auth_handshakes"] == 2
        prometheus = f"http://127.0.0.1:{port}/metrics"
        text = subprocess.run(["curl", "-s", prometheus], capture_output=True, text=True, timeout=30).stdout
        assert "genrm_relay_dropped_unauthenticated_total 2\n" in text

        p.send_signal(signal.SIGINT)
        p.wait(60)
        assert p.returncode == 0
        assert not os.path.exists(path)  # removed at a clean stop
    finally:
        if p.poll() is None:
            p.kill()
        _, err = p.communicate()
    # ... and logs it (the judge's process, at most one line per RELAY_AUTH_LOG_INTERVAL).
    lines = [ln for ln in err.splitlines() if "unauthenticated message(s)" in ln]
    assert lines and "(total 2)" in lines[-1] and "RELAY_JOB_SECRET" in lines[-1], err[-3000:]
    assert sum(int(re.search(r"dropped (\d+) unauthenticated", ln).group(1)) for ln in lines) == 2


@pytest.mark.parametrize(
    ("env_changes", "says"),
    [
        ({"RELAY_JOB_SECRET": "not-hex"}, "relay judge: RELAY_JOB_SECRET must be a hex string"),
        (
            {"RELAY_JOB_SECRET_FILE": "/nonexistent/judge.secret"},
            "relay judge: RELAY_JOB_SECRET_FILE=/nonexistent/judge.secret: cannot read the secret file",
        ),
    ],
)
def test_relay_judge_with_an_unusable_secret_says_what_to_change(tmp_path, env_changes, says):
    env = _env(RELAY_CACHE=str(tmp_path / "cache"), XDG_CACHE_HOME=str(tmp_path / "xdg"), **env_changes)
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "judge", "--config", "tiny-cpu-split", "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert not os.path.exists(tmp_path / "cache")  # nothing was started or built


def test_relay_judge_takes_its_secret_from_the_variable_else_the_file_else_makes_one(tmp_path, monkeypatch):
    import relay._auth
    from launcher.serve_judge import _choose_secret, _secret_lines

    key = secrets.token_hex(32)
    monkeypatch.setattr(relay._auth, "_generated", None)
    monkeypatch.setattr(relay._auth, "_from_file", None)
    monkeypatch.setenv("RELAY_JOB_SECRET", key)
    assert _choose_secret() == ("env", "")
    assert _secret_lines("ipc:///a", "env", "") == [
        "relay secret: RELAY_JOB_SECRET as exported here; reward code outside this process needs the same value: "
        "export RELAY_GENRM_ADDR=ipc:///a RELAY_JOB_SECRET=<the same value>"
    ]
    path = tmp_path / "judge.secret"
    path.write_text(key + "\n")
    monkeypatch.delenv("RELAY_JOB_SECRET")
    monkeypatch.setenv("RELAY_JOB_SECRET_FILE", str(path))
    assert _choose_secret() == ("file", str(path)) and os.environ["RELAY_JOB_SECRET"] == key  # children inherit it
    assert _secret_lines("ipc:///a", "file", str(path)) == [
        f"relay secret: from {path}; reward code outside this process: export RELAY_GENRM_ADDR=ipc:///a "
        f"RELAY_JOB_SECRET_FILE={path}"
    ]
    monkeypatch.delenv("RELAY_JOB_SECRET")
    monkeypatch.delenv("RELAY_JOB_SECRET_FILE")
    source, made = _choose_secret()
    assert source == "generated" and os.environ["RELAY_JOB_SECRET"] == made and len(bytes.fromhex(made)) == 32
