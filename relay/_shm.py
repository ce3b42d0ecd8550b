"""Large buffers between processes of one host go through shared memory, not the socket.

A buffer of at least ``RELAY_SHM_MIN_BYTES`` (default 4 MiB) sent to a same-host peer (an
``ipc://`` inbox) is written once into shared memory under ``/dev/shm/relay-<job id>/`` and
its name travels in the message header (covered by the MAC). The receiver maps it and
decodes arrays and tensors as views of that mapping: one copy in total instead of the
socket's several.

The sender's **arena** (:class:`Arena`) keeps its files and reuses them: each segment is a
file whose first page holds a state byte (free or busy) and whose data starts at the next
page. The sender writes into a free segment it keeps mapped (its pages touched by earlier
messages: on this kind of VM a copy into fresh memory runs at ~0.45 GB/s, into touched
memory at ~11 GB/s) and marks it busy; the receiver marks it free when its last view of the
data is garbage-collected. Segments of the arena total at most ``ARENA_BYTES`` per process;
past that (every segment busy: say a receiver holds its arrays, or died) a buffer goes into
a one-off file instead, which the receiver unlinks at once and owns. The job's root process
creates the directory and removes it (every file in it) when it exits. ``RELAY_SHM=0`` turns
shared memory off.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import secrets
import shutil
import threading
import weakref

from ._settings import settings

_ROOT = "/dev/shm"
_NAME = re.compile(r"^[0-9]+-[0-9]+$")  # a one-off file
_SEGMENT = re.compile(r"^[0-9]+-a[0-9]+$")  # an arena segment
_HEAD = mmap.PAGESIZE  # a segment's state page; its data starts after it
FREE, BUSY = 0, 1
ARENA_BYTES = 2 << 30  # the most a process's arena segments hold together
_seq = itertools.count()
_generated_job: str | None = None  # the job id this process made up (it is the job's root)


def enabled() -> bool:
    return settings().shm and os.path.isdir(_ROOT)


def job_id() -> str:
    """``RELAY_JOB_ID``, else an id made up once by this process (the root of its job);
    the spawner passes it to its workers."""
    global _generated_job
    job = settings().job_id
    if job:
        return job
    if _generated_job is None:
        _generated_job = secrets.token_hex(8)
    return _generated_job


def job_dir() -> str:
    job = job_id()
    if not re.fullmatch(r"[0-9a-f]{8,64}", job):
        raise RuntimeError(f"RELAY_JOB_ID must be a hex id (8 to 64 digits), got {job!r}")
    return os.path.join(_ROOT, f"relay-{job}")


def create_job_dir() -> str:
    path = job_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def remove_job_dir() -> None:
    _arena.reset()  # its files go with the directory
    try:
        shutil.rmtree(job_dir(), ignore_errors=True)
    except RuntimeError:
        pass


class Arena:
    """This process's reusable segments (the sending side): ``put`` copies a buffer into the
    smallest free segment that holds it (a new one, its size the next power of two, while
    the arena has room), marks it busy and returns its name; None when the arena is full."""

    def __init__(self, limit: int = ARENA_BYTES):
        self.limit = limit
        self.segments: list[tuple[str, int, mmap.mmap]] = []  # (name, capacity, the writer's mapping)
        self.bytes = 0
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def put(self, view: memoryview) -> str | None:
        n = len(view)
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's segments are not its own
                self.segments, self.bytes, self._pid = [], 0, os.getpid()
            free = [seg for seg in self.segments if seg[1] >= n and seg[2][0] == FREE]
            seg = min(free, key=lambda s: s[1]) if free else self._grow(n)
            if seg is None:
                return None
            name, _, mm = seg
            mm[0] = BUSY
        mm[_HEAD:_HEAD + n] = view
        return name

    def reset(self) -> None:
        """Forget every segment (their files are being removed; views others hold stay valid)."""
        with self._lock:
            self.segments, self.bytes = [], 0

    def _grow(self, n: int):
        cap = 1 << max(n - 1, 1).bit_length()
        if self.bytes + cap > self.limit:
            return None
        name = f"{self._pid}-a{next(_seq)}"
        fd = os.open(os.path.join(job_dir(), name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, _HEAD + cap)
            mm = mmap.mmap(fd, _HEAD + cap)
        finally:
            os.close(fd)
        self.segments.append((name, cap, mm))
        self.bytes += cap
        return self.segments[-1]


_arena = Arena()


def write(buf) -> str:
    """Put ``buf`` into shared memory (an arena segment, else a one-off file); return its
    name (relative to the job dir)."""
    view = memoryview(buf).cast("B")
    name = _arena.put(view)
    return name if name is not None else _write_file(view)


def _write_file(view: memoryview) -> str:
    name = f"{os.getpid()}-{next(_seq)}"
    path = os.path.join(job_dir(), name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return name


def take(name: str, size: int) -> memoryview:
    """A view of the ``size`` bytes another process put under ``name``: an arena segment
    (marked free again when the view and everything made from it are garbage-collected),
    or a one-off file (unlinked at once)."""
    if isinstance(name, str) and _SEGMENT.match(name):
        return _take_segment(name, size)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"bad shared-memory buffer name {name!r}")
    path = os.path.join(job_dir(), name)
    fd = os.open(path, os.O_RDWR)
    try:
        os.unlink(path)
        if size == 0:
            return memoryview(b"")
        if os.fstat(fd).st_size != size:
            raise ValueError(f"shared-memory buffer {name!r} has the wrong size")
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return memoryview(mm)


def _take_segment(name: str, size: int) -> memoryview:
    """Map a segment's data; its file descriptor stays open until the mapping is collected,
    then marks the segment free (:func:`_free`)."""
    fd = os.open(os.path.join(job_dir(), name), os.O_RDWR)
    try:
        if os.fstat(fd).st_size < _HEAD + size:
            raise ValueError(f"shared-memory segment {name!r} is smaller than its message")
        mm = mmap.mmap(fd, _HEAD + size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mm, _free, fd)
    return memoryview(mm)[_HEAD:]


def _free(fd: int) -> None:
    """Mark the segment open as ``fd`` free (its state byte) and close ``fd``."""
    try:
        os.pwrite(fd, bytes([FREE]), 0)
    finally:
        os.close(fd)


def release(names: list[str]) -> None:
    """Give back the shared memory of a message that will not be delivered (best effort):
    segments marked free, one-off files removed."""
    for name in names:
        try:
            path = os.path.join(job_dir(), name)
            if isinstance(name, str) and _SEGMENT.match(name):
                _free(os.open(path, os.O_RDWR))
            else:
                os.unlink(path)
        except (OSError, RuntimeError, ValueError):
            pass
