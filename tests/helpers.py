"""Test helpers: run a coroutine with a bound, and find processes a test started."""

from __future__ import annotations

import asyncio
import os


def tagged_pids(tag: str) -> list[int]:
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if f"RELAY_TEST_TAG={tag}".encode() in env.split(b"\0"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                out.append(int(entry))
    return out


def parent(pid: int) -> int:
    """The parent pid of ``pid`` (OSError once it is gone)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (processes that exit during the scan are left out)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if parent(int(entry)) == pid:
                out.append(int(entry))
        except OSError:
            continue
    return out


def live_pids_by_env() -> dict[int, dict[bytes, bytes]]:
    """{pid: environment} of every live (not zombie) process this user can read."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out[int(entry)] = env
    return out


def run(coro, timeout: float = 60.0):
    """Run a test coroutine in a fresh event loop, bounded by ``timeout``."""

    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def interrupt(p, timeout: float = 60) -> None:
    """Ctrl-C a Popen process (a clean stop), kill it if it is not gone within ``timeout``,
    and collect it."""
    import signal
    import subprocess

    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
    p.communicate()


def reap(procs) -> None:
    """Kill whichever of these Popen processes still run and collect them all (tests'
    ``finally``: nothing outlives the test)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def ended(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def kill_root_and_tagged(root) -> None:
    """Test cleanup: kill ``root`` (a ``subprocess.Popen``) if it still runs, and every
    process carrying this test's tag."""
    import signal

    if root.poll() is None:
        root.kill()
        root.wait()
    for pid in tagged_pids(os.environ["RELAY_TEST_TAG"]):
        os.kill(pid, signal.SIGKILL)


def compile_for_h200(src, options: dict):
    """A Triton kernel (``triton.compiler.ASTSource``) compiled for sm_90 (H100/H200) down to a
    cubin, on a machine without a GPU; skips the test where this Triton build has no CUDA
    backend."""
    import pytest
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except RuntimeError as e:
        if "backend" in str(e).lower():
            pytest.skip(str(e))
        raise


async def start_trainer(actor_cls, path: str, gpus: int = 1, **kw):
    """``(procs, trainer)``: ``actor_cls`` (a TrainerActor) over ``gpus`` bundles of this host,
    torch.distributed set up, initialized (240 s at most). End it with :func:`stop_trainer`."""
    from relay import setup_torch_distributed, this_host

    procs = this_host().spawn_procs(per_host={"gpus": gpus})
    await setup_torch_distributed(procs)
    t = procs.spawn("trainer", actor_cls, path, **kw)
    await t.initialized(240)
    return procs, t


async def stop_trainer(procs, t) -> None:
    await t.shutdown.call().result(60)
    await procs.stop()


def under_triton_interpreter(code: str, timeout: float = 300) -> float:
    """Run ``code`` in a fresh Python with ``TRITON_INTERPRET=1`` (how CPU checks Triton
    kernels) from the repository root; the number its last stdout line prints. Its stderr is
    the assertion message when it fails."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])
