"""Shared fixtures: every test runs with a tag that its processes inherit, and fails if any
process carrying that tag outlives it (they are killed so later tests are not affected)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from tests.helpers import tagged_pids


@pytest.fixture(autouse=True)
def no_leftover_processes(request):
    """Fail the test if a process it started (directly or not) is still alive after it."""
    tag = uuid.uuid4().hex
    os.environ["RELAY_TEST_TAG"] = tag
    yield
    deadline = time.monotonic() + 10
    left = tagged_pids(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = tagged_pids(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind by {request.node.name}: {left}"
