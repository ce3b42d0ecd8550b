"""A peer without the job secret is dropped and counted, never answered."""

from __future__ import annotations

import asyncio
import secrets

import msgpack
import pytest
import zmq

from relay import this_host
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
