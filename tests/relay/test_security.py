"""A peer without the job secret is dropped and counted, never answered - except a hello,
which gets a constant, rate-limited rejection so a client learns at once that its secret is
wrong or missing."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from relay import _wire, job_secret, this_host
from relay._auth import Signer
from tests.helpers import run
from tests.relay.actors import Counter, Echo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_rogue_client_is_dropped_and_counted():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        echo = procs.spawn("echo", Echo)
        counter = procs.spawn("counter", Counter, 0)
        await counter.initialized()
        addr = procs.procs[0].addr
        before = await echo.stats.call_one()

        rogue = zmq.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(addr)
        # 1. A well-formed call signed with the wrong secret.
        header = msgpack.packb([1, 1, "counter", "incr", 0, True, msgpack.packb([[1000], {}])])
        wrong = Signer(secrets.token_bytes(32))
        rogue.send_multipart([wrong.sign(header), header])
        # 2. No MAC at all / garbage frames / a truncated message.
        rogue.send_multipart([header])
        rogue.send_multipart([b"\x00" * 32, b"\xc1garbage"])
        rogue.send_multipart([b"x"])
        # 3. A replayed MAC from a different header.
        rogue.send_multipart([wrong.sign(b"other"), header])
        await asyncio.sleep(0.5)
        assert rogue.poll(200) == 0, "the rogue got an answer"
        rogue.close()

        after = await echo.stats.call_one()
        dropped = after.get("dropped_unauthenticated", 0) - before.get("dropped_unauthenticated", 0)
        malformed = after.get("dropped_malformed", 0) - before.get("dropped_malformed", 0)
        assert dropped + malformed == 5 and dropped >= 3
        # Nothing reached the actor, and the process still serves the job.
        assert await counter.value.call_one() == 0
        assert await counter.incr.call_one(1) == 1
        await procs.stop()

    run(main())


def test_heartbeats_from_a_rogue_are_ignored(monkeypatch):
    """A forged heartbeat cannot keep a frozen process 'alive' (the beat is MAC'd too)."""
    from relay._heartbeat import HeartbeatMonitor

    lost = []
    ctx = zmq.Context.instance()
    mon = HeartbeatMonitor(ctx, "inproc://hb-test", lambda p, t: lost.append(p))
    mon.start()
    mon.watch("p0")
    sock = ctx.socket(zmq.DEALER)
    sock.connect("inproc://hb-test")
    beat = msgpack.packb(["p0"])
    sock.send_multipart([Signer(secrets.token_bytes(32)).sign(beat), beat])
    good = Signer()
    sock.send_multipart([good.sign(beat), beat])
    assert sock.poll(2000) and len(sock.recv_multipart()) == 2  # the genuine beat is acked
    assert sock.poll(300) == 0  # the forged one is not
    mon.stop()
    mon.join(5)
    sock.close(0)
    assert mon.dropped == 1


# ------------------------------------------------------------------------------------------
# The authentication handshake: a client outside the job learns at once that its secret is
# wrong or missing, instead of waiting out its call timeout.

_CLIENT = """
import asyncio, json, sys
from relay import AuthenticationError, ProcMesh, ProcRef

async def main():
    mesh = ProcMesh.attach([ProcRef("srv", sys.argv[1], "srv", 0)])
    try:
        await mesh.authenticate()
        print(json.dumps({"ok": True}))
    except AuthenticationError as e:
        print(json.dumps({"ok": False, "type": type(e).__name__, "error": str(e)}))

asyncio.run(main())
"""


def _client(addr: str, tmp_path, **env_changes) -> dict:
    """Run a real client process that attaches to ``addr`` and authenticates (30 s bound)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RELAY_JOB_SECRET", "RELAY_JOB_SECRET_FILE", "RELAY_JOB_ID")
    }
    env.update({k: v for k, v in env_changes.items() if v is not None})
    out = subprocess.run([sys.executable, "-c", _CLIENT, addr], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_handshake_acks_the_job_secret_and_rejects_a_wrong_or_missing_one(tmp_path):
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        echo = procs.spawn("echo", Echo)
        await echo.initialized()
        addr = procs.procs[0].addr
        secret = job_secret().hex()  # the job's secret, which the server holds
        good_file = tmp_path / "good.secret"
        good_file.write_text(secret + "\n")
        wrong_file = tmp_path / "wrong.secret"
        wrong_file.write_text(secrets.token_hex(32))
        before = await echo.stats.call_one()

        def clients():
            return {
                "env": _client(addr, tmp_path, RELAY_JOB_SECRET=secret),
                "file": _client(addr, tmp_path, RELAY_JOB_SECRET_FILE=str(good_file)),
                "missing": _client(addr, tmp_path),
                "wrong": _client(addr, tmp_path, RELAY_JOB_SECRET=secrets.token_hex(32)),
                "wrong_file": _client(addr, tmp_path, RELAY_JOB_SECRET_FILE=str(wrong_file)),
            }

        got = await asyncio.to_thread(clients)
        assert got["env"] == {"ok": True} and got["file"] == {"ok": True}
        for case in ("missing", "wrong", "wrong_file"):
            assert got[case]["type"] == "AuthenticationError", got[case]
            assert f"the relay process at {addr} rejected this process: not authenticated" in got[case]["error"]
            assert "export RELAY_JOB_SECRET=" in got[case]["error"] and "RELAY_JOB_SECRET_FILE=" in got[case]["error"]
        assert "has no RELAY_JOB_SECRET (nor RELAY_JOB_SECRET_FILE)" in got["missing"]["error"]
        assert (
            "its secret differs from the server's (this process's secret comes from RELAY_JOB_SECRET)"
            in got["wrong"]["error"]
        )
        assert f"comes from RELAY_JOB_SECRET_FILE={wrong_file}" in got["wrong_file"]["error"]

        after = await echo.stats.call_one()
        delta = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in ("auth_handshakes", "auth_rejections_sent", "dropped_unauthenticated")
        }
        assert delta == {"auth_handshakes": 2, "auth_rejections_sent": 3, "dropped_unauthenticated": 3}
        await procs.stop()

    run(main())


def test_a_secret_file_that_cannot_be_used_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.secret"
    bad.write_text("not hex\n")
    for path, says in (
        (bad, "the file must hold the job's secret as one hex string"),
        (tmp_path / "none", "cannot read the secret file"),
    ):
        env = {k: v for k, v in os.environ.items() if k not in ("RELAY_JOB_SECRET", "RELAY_JOB_SECRET_FILE")}
        env["RELAY_JOB_SECRET_FILE"] = str(path)
        out = subprocess.run(
            [sys.executable, "-c", _CLIENT, "ipc:///nonexistent"], env=env, capture_output=True, text=True, timeout=30
        )
        assert out.returncode != 0 and f"RELAY_JOB_SECRET_FILE={path}: {says}" in out.stderr


def test_no_answer_to_a_hello_is_an_authentication_error_naming_the_secret(tmp_path):
    """Nothing listens at the address: the handshake ends after its timeout, not the call's."""
    got = _client(f"ipc://{tmp_path}/nobody", tmp_path)
    assert got["type"] == "AuthenticationError"
    assert f"no authenticated answer from the relay process at ipc://{tmp_path}/nobody within 5 s" in got["error"]
    assert f"nothing listens there: no socket file {tmp_path}/nobody" in got["error"]
    assert "export RELAY_JOB_SECRET=" in got["error"]


def test_a_rejection_is_constant_smaller_than_the_hello_and_rate_limited():
    """Hellos signed with another secret: each answer (if any) is the constant
    AUTH_REJECTED and no bigger than the hello; at most the burst plus the rate over the
    elapsed time are answered; the rest are counted as suppressed. A signed hello sent the
    same way is acked with a reply signed by the job's secret, echoing its nonce."""
    from relay._auth import AUTH_REJECTED
    from relay._messages import HELLO_MAX as _HELLO_MAX
    from relay._messages import HELLO_PREFIX as _HELLO_PREFIX
    from relay._messages import K_AUTH
    from relay._transport import REJECT_BURST as _REJECT_BURST
    from relay._transport import REJECT_RATE as _REJECT_RATE

    for rid in (1, 2**16, 2**64 - 1):  # the hello layout the server recognizes without decoding
        packed = msgpack.packb([K_AUTH, rid, secrets.token_hex(16)])
        assert packed[:2] == _HELLO_PREFIX and len(packed) <= _HELLO_MAX

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        echo = procs.spawn("echo", Echo)
        await echo.initialized()
        before = await echo.stats.call_one()
        rogue = zmq.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(procs.procs[0].addr)
        wrong = Signer(secrets.token_bytes(32))
        n = 50
        t0 = time.monotonic()
        hello = b""
        for rid in range(1, n + 1):
            header = msgpack.packb([K_AUTH, rid, secrets.token_hex(16)])
            hello = wrong.sign(header) + header
            rogue.send(hello)
        # A hello-shaped message with an extra frame, and an unsigned call: no answer at all.
        rogue.send_multipart([hello, b"extra"])
        rogue.send_multipart([msgpack.packb([1, 1, "echo", "echo", 0, True, None, None])])
        after = before

        def dropped(k):
            return after.get(k, 0) - before.get(k, 0)

        while dropped("dropped_unauthenticated") + dropped("dropped_malformed") < n + 2:
            await asyncio.sleep(0.05)
            after = await echo.stats.call_one()
        assert dropped("dropped_unauthenticated") == n + 1 and dropped("dropped_malformed") == 1
        elapsed = time.monotonic() - t0
        replies = []
        while rogue.poll(300):
            replies.append(rogue.recv_multipart())
        assert replies and all(r == [AUTH_REJECTED] for r in replies)
        assert len(AUTH_REJECTED) < len(hello)
        sent = after.get("auth_rejections_sent", 0) - before.get("auth_rejections_sent", 0)
        suppressed = after.get("auth_rejections_suppressed", 0) - before.get("auth_rejections_suppressed", 0)
        assert sent == len(replies) and sent + suppressed == n
        assert sent <= _REJECT_BURST + _REJECT_RATE * elapsed + 1
        assert suppressed > 0

        # The same, signed with the job's secret: a signed ack that echoes the nonce.
        good = Signer()
        nonce = secrets.token_hex(16)
        header = msgpack.packb([K_AUTH, 7, nonce])
        rogue.send(good.sign(header) + header)
        assert rogue.poll(5000)
        (frame,) = rogue.recv_multipart()
        mac, reply = frame[:32], frame[32:]
        assert good.verify(mac, reply)
        kind, rid, status, payload = msgpack.unpackb(reply)[:4]
        assert (kind, rid, status) == (2, 7, 0) and _wire.decode(payload, []) == nonce
        rogue.close()
        await procs.stop()

    run(main())


def test_unauthenticated_messages_are_logged_at_most_once_per_interval(capfd):
    """A first line soon after the first drop; what arrives within the interval after it is
    summed into one later line, with the running total."""

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1}, env={"RELAY_AUTH_LOG_INTERVAL": "2"})
        echo = procs.spawn("echo", Echo)
        await echo.initialized()
        rogue = zmq.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(procs.procs[0].addr)
        wrong = Signer(secrets.token_bytes(32))
        header = msgpack.packb([1, 1, "echo", "echo", 0, True, None, None])
        err = ""

        async def wait_lines(k: int) -> list:
            nonlocal err
            while True:
                err += capfd.readouterr().err
                lines = [ln for ln in err.splitlines() if "unauthenticated message(s)" in ln]
                if len(lines) >= k:
                    return lines
                await asyncio.sleep(0.05)

        for _ in range(5):
            rogue.send(wrong.sign(header) + header)
        await wait_lines(1)
        for _ in range(7):  # inside the interval after the first line: no line each
            rogue.send(wrong.sign(header) + header)
        lines = await wait_lines(2)
        await asyncio.sleep(0.5)
        err += capfd.readouterr().err
        lines = [ln for ln in err.splitlines() if "unauthenticated message(s)" in ln]
        counts = [int(re.search(r"dropped (\d+) unauthenticated", ln).group(1)) for ln in lines]
        assert len(lines) == 2 and sum(counts) == 12 and counts[1] >= 7, lines
        assert (
            "(total 12)" in lines[1] and "RELAY_JOB_SECRET" in lines[1] and "at most one such line per 2 s" in lines[1]
        )
        assert (await echo.stats.call_one())["dropped_unauthenticated"] == 12
        rogue.close()
        await procs.stop()

    run(main())
