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


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def by_hand(monkeypatch):
    """A monitor driven by hand: its own clock, no thread, no socket (timeout 0.5 s)."""
    monkeypatch.setenv("RELAY_HEARTBEAT_INTERVAL", "0.05")
    monkeypatch.setenv("RELAY_HEARTBEAT_TIMEOUT", "0.5")
    clock = FakeClock()
    return HeartbeatMonitor(zmq.Context.instance(), "inproc://unused", lambda p, why: None, clock=clock), clock


def test_regular_beats_keep_a_process_alive_and_silence_is_reported_once(by_hand):
    mon, clock = by_hand
    mon.watch("w0")
    for _ in range(30):  # three timeouts' worth of regular beats
        clock.now += 0.05
        mon.record_beat("w0")
        assert mon.expired() == []
    clock.now += 0.5  # exactly the timeout: not yet
    assert mon.expired() == []
    clock.now += 0.01
    (lost,) = mon.expired()
    assert lost[0] == "w0" and "missed heartbeats for 0.5 s" in lost[1]
    clock.now += 10
    assert mon.expired() == []  # reported once


def test_no_beat_at_all_is_reported_after_the_grace(by_hand):
    mon, clock = by_hand
    mon.watch("never", grace=0.2)
    clock.now += 0.7  # timeout + grace
    assert mon.expired() == []
    clock.now += 0.01
    (lost,) = mon.expired()
    assert lost[0] == "never" and "sent no heartbeat in the 0.7 s since it was started" in lost[1]


def test_a_monitor_that_was_not_running_postpones_every_deadline(by_hand):
    mon, clock = by_hand
    mon.watch("w1")
    mon.record_beat("w1")
    clock.now += 5  # the monitor's own thread was not scheduled for 5 s
    mon.postpone(5)
    assert mon.expired() == []
    clock.now += 0.51
    assert [p for p, _ in mon.expired()] == ["w1"]
