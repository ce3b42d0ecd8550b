"""The heartbeat monitor as a state machine, driven by hand over inproc sockets."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from relay._auth import Signer
from relay._heartbeat import HeartbeatMonitor

pytestmark = pytest.mark.unit


@pytest.fixture
def monitor(monkeypatch):
    monkeypatch.setenv("RELAY_HEARTBEAT_INTERVAL", "0.05")
    monkeypatch.setenv("RELAY_HEARTBEAT_TIMEOUT", "0.5")
    lost: list = []
    ctx = zmq.Context.instance()
    addr = f"inproc://hb-{time.monotonic_ns()}"
    mon = HeartbeatMonitor(ctx, addr, lambda p, why: lost.append((p, why, time.monotonic())))
    mon.start()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(addr)
    signer = Signer()

    def beat(proc_id: str) -> None:
        body = msgpack.packb([proc_id])
        sock.send_multipart([signer.sign(body), body])
        assert sock.poll(2000)
        sock.recv_multipart()  # the ack

    yield mon, beat, lost
    mon.stop()
    mon.join(5)
    sock.close(0)


def test_a_beat_before_watch_counts(monitor):
    """A remote process beats before its supervisor learns of it; silence is then measured
    from that beat, not from a start-up grace."""
    mon, beat, lost = monitor
    beat("agent1")
    t0 = time.monotonic()
    mon.watch("agent1", grace=30)
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lost and lost[0][0] == "agent1" and "missed heartbeats" in lost[0][1]
    assert lost[0][2] - t0 < 2  # not after the 30 s grace


def test_regular_beats_keep_a_process_alive_and_silence_is_reported_once(monitor):
    mon, beat, lost = monitor
    mon.watch("w0")
    end = time.monotonic() + 1.5
    while time.monotonic() < end:  # three timeouts' worth of regular beats
        beat("w0")
        time.sleep(0.05)
    assert lost == []
    time.sleep(1.2)
    assert [p for p, _, _ in lost] == ["w0"]
    mon.unwatch("w0")


def test_no_beat_at_all_is_reported_after_the_grace(monitor):
    mon, beat, lost = monitor
    mon.watch("never", grace=0.2)
    time.sleep(1.5)
    assert lost and "sent no heartbeat" in lost[0][1]
