"""GRPO under torchrun on two "nodes" of one host, each with its own loopback address
(127.0.0.2 and 127.0.0.3: relay then talks tcp:// between them, never ipc:// or /dev/shm),
trains like the same job on one node."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.e2e.test_grpo_modes import ROOT, records, train_cmd
from tests.helpers import reap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500, func_only=True)]
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_two_nodes(data: dict, run_dir: str, rdzv_id: str, *extra: str) -> list[subprocess.Popen]:
    """One torchrun per "node" (127.0.0.2 and 127.0.0.3) running the e2e GRPO job, 2 bundles each.
    The first hosts the rendezvous store (it binds the port before the second starts) and
    gets rank 0, as on a cluster where the head node hosts it: the other node can then die
    without taking the store (and the head's torchrun) with it."""
    import time

    args = train_cmd("tiny-cpu-split", data, run_dir, *extra)[4:]  # after "python -m launcher.cli train"
    port = free_port("127.0.0.2")
    nodes = []
    for host in ("127.0.0.2", "127.0.0.3"):
        env = dict(os.environ, RELAY_CACHE=data["cache"], RELAY_HOST=host)
        cmd = [
            TORCHRUN,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.2:{port}",
            "--rdzv-id",
            rdzv_id,
            "-m",
            "launcher",
            *args,
            "--gpus-per-node",
            "2",
        ]
        nodes.append(
            subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        )
        deadline = time.monotonic() + 60
        while len(nodes) == 1 and time.monotonic() < deadline and nodes[0].poll() is None:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.2", port)) == 0:
                    break
            time.sleep(0.05)
    return nodes


def test_two_node_torchrun_grpo_matches_one_node(data, split_run, tmp_path):
    expected = records(split_run)  # the same job on one node

    two = str(tmp_path / "two-nodes")
    nodes = start_two_nodes(data, two, "grpo-two-nodes")
    try:
        outs = [n.communicate(timeout=400) for n in nodes]
    finally:
        reap(nodes)
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-3000:] for o in outs]
    out = next(o for o, _ in outs if "placed a probe actor" in o)
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit() and "(cpu)" in line]
    addresses: dict[str, set] = {}  # node -> the addresses its workers listen on
    for r in rows:
        addresses.setdefault(r[1], set()).add(r[2].rsplit("/", 1)[1])
    assert sorted(map(sorted, addresses.values())) == [["127.0.0.2"], ["127.0.0.3"]], rows
    got = records(two)
    assert [r["step"] for r in got] == [1, 2]
    for a, b in zip(got, expected):
        assert a["reward/mean"] == b["reward/mean"] and a["samples"] == b["samples"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)
        assert a["sync/probe_logprobs"] == pytest.approx(b["sync/probe_logprobs"], rel=1e-4, abs=1e-5)


def test_killing_a_node_agent_mid_training_stops_the_job_promptly(data, tmp_path):
    """The head node does not wait out the dead node's engines (their event logs) before it
    exits: it reports the lost agent and exits 1 within the 10 s the issue asks."""
    import signal
    import time

    run_dir = str(tmp_path / "run")
    nodes = start_two_nodes(data, run_dir, "grpo-kill-agent", "--num-rollout", "50")
    try:
        deadline = time.monotonic() + 300
        while (
            not (os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and records(run_dir))
            and time.monotonic() < deadline
        ):
            assert all(n.poll() is None for n in nodes), [
                n.communicate()[1][-2000:] for n in nodes if n.poll() is not None
            ]
            time.sleep(0.1)
        agents = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_agent(int(p), "1")]
        assert len(agents) == 1, agents
        os.kill(agents[0], signal.SIGKILL)
        t0 = time.monotonic()
        head = None
        while head is None and time.monotonic() - t0 < 60:
            for n in nodes:
                if n.poll() is not None:
                    out, err = n.communicate()
                    if "placed a probe actor" in out:
                        head = (time.monotonic() - t0, n.returncode, err)
            time.sleep(0.05)
    finally:
        reap(nodes)
    assert head is not None, "the head node did not exit"
    elapsed, code, err = head
    assert code == 1 and "job failed: node 1 agent" in err, err[-3000:]
    assert elapsed < 10, (elapsed, err[-3000:])


def _is_agent(pid: int, group_rank: str) -> bool:
    """A torchrun worker running the launcher with this GROUP_RANK, started by this test."""
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False
    tag = f"RELAY_TEST_TAG={os.environ['RELAY_TEST_TAG']}".encode()
    return (
        tag in env
        and f"GROUP_RANK={group_rank}".encode() in env
        and b"launcher" in cmd
        and b"torchrun" not in cmd
        and b"relay._worker" not in cmd
    )
