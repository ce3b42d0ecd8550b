"""The shared-memory arena (relay/_shm.py), in one process (the sender's and the receiver's
sides are functions of the module): a segment is reused once its receiver's views are gone,
never while one lives; the arena's size is bounded, past it buffers go into one-off files."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

from relay import _shm

pytestmark = pytest.mark.unit


@pytest.fixture
def job(monkeypatch):
    monkeypatch.setenv("RELAY_JOB_ID", "ab" * 8)
    monkeypatch.setattr(_shm, "_arena", _shm.Arena(limit=24 << 20))
    _shm.create_job_dir()
    yield _shm.job_dir()
    _shm.remove_job_dir()


def _state(job: str, name: str) -> int:
    with open(os.path.join(job, name), "rb") as f:
        return f.read(1)[0]


def test_a_segment_is_reused_only_after_its_views_are_gone(job):
    a = np.arange(1 << 20, dtype=np.float32)  # 4 MiB
    name = _shm.write(a)
    assert _shm._SEGMENT.match(name) and _state(job, name) == _shm.BUSY
    got = np.frombuffer(_shm.take(name, a.nbytes), dtype=np.float32)
    assert np.array_equal(got, a)
    second = _shm.write(a + 1)  # the first one is still held: another segment
    assert second != name
    view = got[10:20]  # a view of the view keeps the segment busy
    del got
    gc.collect()
    assert _state(job, name) == _shm.BUSY and view[0] == 10
    del view
    gc.collect()
    assert _state(job, name) == _shm.FREE
    third = _shm.write(a[: 1 << 19])  # half the size: still the smallest free segment that holds it
    assert third == name and np.array_equal(np.frombuffer(_shm.take(third, a.nbytes // 2), np.float32), a[: 1 << 19])
    _shm.release([second])  # a message that will not be delivered gives its segment back
    assert _state(job, second) == _shm.FREE


def test_a_full_arena_falls_back_to_one_off_files(job):
    a = np.ones(3 << 20, dtype=np.uint8)  # 3 MiB: 4 MiB segments, 6 fit in 24 MiB
    held = [_shm.take(_shm.write(a), a.nbytes) for _ in range(6)]
    name = _shm.write(a)
    assert _shm._NAME.match(name), name  # the arena is full: a one-off file
    assert bytes(_shm.take(name, a.nbytes)) == a.tobytes()
    assert name not in os.listdir(job)  # taken: unlinked
    assert _shm._arena.bytes == 24 << 20
    del held
    gc.collect()
    assert _shm._SEGMENT.match(_shm.write(a))  # free again: back in the arena


def test_a_segment_name_is_checked_and_its_size_too(job):
    with pytest.raises(ValueError, match="bad shared-memory buffer name"):
        _shm.take("../x-a1", 10)
    name = _shm.write(np.zeros(1 << 20, np.uint8))
    with pytest.raises(ValueError, match="smaller than its message"):
        _shm.take(name, (1 << 20) + 1 + os.path.getsize(os.path.join(job, name)))


def test_a_new_job_directory_starts_a_new_arena(job):
    """A process that runs relay twice (two asyncio.run) removes and re-creates the job's
    directory in between: the arena must not hand out segments whose files are gone."""
    a = np.ones(1 << 20, np.float32)
    first = _shm.write(a)
    _shm.release([first])
    _shm.remove_job_dir()
    _shm.create_job_dir()
    name = _shm.write(a)
    assert name != first and np.array_equal(np.frombuffer(_shm.take(name, a.nbytes), np.float32), a)
