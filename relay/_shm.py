"""Large buffers between processes of one host go through shared memory, not the socket.

A buffer of at least ``RELAY_SHM_MIN_BYTES`` (default 4 MiB) sent to a same-host peer (an
``ipc://`` inbox) is written once into a file in ``/dev/shm/relay-<job id>/`` and its name
travels in the message header (covered by the MAC). The receiver maps the file, unlinks it
at once (it owns it from then on) and decodes arrays and tensors as views of that mapping:
one copy in total instead of the socket's several. The memory is freed when the last view
is garbage-collected. The job's root process creates the directory and removes it (and
anything a dead receiver left in it) when it exits. ``RELAY_SHM=0`` turns this off.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import secrets
import shutil

from ._settings import settings

_ROOT = "/dev/shm"
_NAME = re.compile(r"^[0-9]+-[0-9]+$")
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
    try:
        shutil.rmtree(job_dir(), ignore_errors=True)
    except RuntimeError:
        pass


def write(buf) -> str:
    """Write ``buf`` to a new shared-memory file; return its name (relative to the job dir)."""
    name = f"{os.getpid()}-{next(_seq)}"
    path = os.path.join(job_dir(), name)
    view = memoryview(buf).cast("B")
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
    """Map a file another process wrote, unlink it, and return a view of it."""
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


def release(names: list[str]) -> None:
    """Remove files of a message that will not be delivered (best effort)."""
    for name in names:
        try:
            os.unlink(os.path.join(job_dir(), name))
        except (OSError, RuntimeError):
            pass
