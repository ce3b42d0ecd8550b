"""Shared fixtures: every test runs with a tag that its processes inherit, and fails if any
process carrying that tag outlives it (they are killed so later tests are not affected)."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

import relay
from tests.helpers import tagged_pids


@pytest.fixture(autouse=True)
def unexpected_failures(request):
    """A supervision failure nobody handles would make relay's default fault hook exit the
    test process; record it instead and fail the test that caused it (tests that expect
    failures take the ``faults`` fixture, which replaces this hook)."""
    seen: list = []
    prev = relay.set_unhandled_fault_hook(seen.append)
    yield seen
    relay.set_unhandled_fault_hook(prev)
    if "faults" not in request.fixturenames:
        assert not seen, f"unhandled supervision failures: {[str(f) for f in seen]}"


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


@pytest.fixture
def faults():
    """Record unhandled failures at the root (for tests that expect some)."""
    seen: list = []
    prev = relay.set_unhandled_fault_hook(seen.append)
    yield seen
    relay.set_unhandled_fault_hook(prev)
