"""The trainer's torch.distributed rendezvous is bounded and names who is stuck: a rank that
cannot form the group raises within RELAY_DIST_INIT_TIMEOUT (instead of torch's 30-minute
default), naming its rank, bundle, node and host, and torchrun's inherited
TORCHELASTIC_USE_AGENT_STORE does not make it wait for a store nobody hosts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

JOIN = """
import torch.distributed as dist
from engines.trainer.actor import _init_process_group
_init_process_group(dist, "gloo")
t = __import__("torch").ones(1)
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
dist.barrier()
dist.destroy_process_group()  # gloo can abort at exit without it (docs: cpu-feasibility, teardown)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_proc(rank: int, world: int, port: int, **env) -> subprocess.Popen:
    e = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        RELAY_BUNDLE=str(10 + rank),
        RELAY_NODE="1",
        RELAY_HOST="127.0.0.1",
        RELAY_DIST_INIT_TIMEOUT="3",
        **env,
    )
    return subprocess.Popen(
        [sys.executable, "-c", JOIN], cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_ranks_form_the_group_even_with_torchruns_agent_store_flag():
    port = free_port()
    procs = [rank_proc(r, 2, port, TORCHELASTIC_USE_AGENT_STORE="True") for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert all("sum 2" in o[0] for o in outs)


def test_a_rank_left_alone_fails_fast_naming_itself():
    port = free_port()
    lone = rank_proc(0, 2, port)  # rank 1 never comes
    _, err = lone.communicate(timeout=60)
    assert lone.returncode != 0
    assert (
        "trainer rank 0 of 2 (bundle 10, node 1, host 127.0.0.1): torch.distributed did not form within 3 s" in err
    ), err[-2000:]
    assert "not every rank joined the store" in err and "missing: rank 1" in err and "RELAY_DIST_INIT_TIMEOUT" in err

    orphan = rank_proc(1, 2, free_port())  # nobody hosts its store
    _, err = orphan.communicate(timeout=60)
    assert orphan.returncode != 0
    assert (
        "trainer rank 1 of 2 (bundle 11, node 1, host 127.0.0.1)" in err and "could not join the store of rank 0" in err
    ), err[-2000:]
