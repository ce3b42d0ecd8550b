"""``relay judge`` on SIGTERM (or Ctrl-C) drains: admission closes, the requests in flight
are answered, then it stops."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import pytest

from tests.launcher.test_launch import free_port
from tests.reward.test_context_limit import post, start_relay_judge

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_sigterm_drains_relay_judge_the_requests_in_flight_are_answered(tmp_path):
    """SIGTERM under load: every request in flight gets its answer (64 of 64 were dropped
    without one), then the judge stops; it said how many it answered."""
    port = free_port()
    p = start_relay_judge(tmp_path, port)
    try:
        body = {"messages": [{"role": "user", "content": "1"}],
                "sampling_params": {"max_new_tokens": 512, "ignore_eos": True, "temperature": 1.0}}
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            calls = [pool.submit(post, port, {**body, "sampling_params": {**body["sampling_params"], "seed": k}})
                     for k in range(64)]
            time.sleep(1.0)  # in flight: 512 tokens each take the tiny judge seconds
            p.send_signal(signal.SIGTERM)
            answers = [c.result(timeout=120) for c in calls]
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert [status for status, _ in answers] == [200] * 64, [a for a in answers if a[0] != 200][:3]
    assert p.returncode == 0 and "judge stopping: answered" in out and "judge stopped" in out, out[-2000:]
