"""Real launches on localhost: relay train, a 2-"node" torchrun job, faults, signals (the
slurm script: test_sbatch.py)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers import reap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relay_cli(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [PY, "-m", "launcher.cli", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
    )


def torchrun_node(port: int, run_id: str, *args) -> subprocess.Popen:
    cmd = [
        TORCHRUN,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        run_id,
        "-m",
        "launcher",
        *args,
    ]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def procs_with_env(key: str, value: str | None = None) -> list[int]:
    tag = os.environ["RELAY_TEST_TAG"]
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RELAY_TEST_TAG={tag}".encode() not in env:
            continue
        for item in env:
            k, _, v = item.decode(errors="replace").partition("=")
            if k == key and (value is None or v == value):
                out.append(int(pid))
    return out


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_relay_train_places_an_actor_on_every_bundle_and_shuts_down():
    p = relay_cli("train", "--config", "tiny-cpu-split")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit() and "(cpu)" in line]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]  # bundle 0..3 on node 0
    assert {r[1] for r in rows} == {"0"} and len({r[3] for r in rows}) == 4  # 4 distinct worker pids
    assert "actor, rollout" in out and "actor, genrm[__default__]" in out
    assert "shut down cleanly" in out


def test_two_node_torchrun_launch_on_localhost():
    port = free_port()
    nodes = [torchrun_node(port, "two-node", "--config", "tiny-cpu-split", "--gpus-per-node", "2") for _ in range(2)]
    outs = [n.communicate(timeout=150) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    out = next(o for o, _ in outs if "placed a probe actor" in o)
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit() and "(cpu)" in line]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [r[5] for r in rows] == ["0", "1", "2", "3"]  # torch.distributed ranks of the actor group
    assert "shut down cleanly" in out


def test_killing_an_agent_stops_the_job_within_10_s():
    port = free_port()
    # The first torchrun hosts the rendezvous store (it binds the port) and, having the lower
    # pid on this host, gets rank 0: killing rank 1's agent then leaves the store alive, as
    # on a real cluster where the head node hosts it.
    nodes = [torchrun_node(port, "kill-agent", "--config", "tiny-cpu-split", "--gpus-per-node", "2", "--hold", "120")]
    wait_for(lambda: _listening(port), 30, "the rendezvous store")
    nodes.append(
        torchrun_node(port, "kill-agent", "--config", "tiny-cpu-split", "--gpus-per-node", "2", "--hold", "120")
    )
    try:
        wait_for(lambda: len(procs_with_env("RELAY_BUNDLE")) == 4, 90, "4 workers")
        agent = wait_for(
            lambda: [p for p in procs_with_env("GROUP_RANK", "1") if "launcher" in open(f"/proc/{p}/cmdline").read()],
            10,
            "the rank-1 agent",
        )[0]
        os.kill(agent, signal.SIGKILL)
        t0 = time.monotonic()
        controller_node = None
        while time.monotonic() - t0 < 30 and controller_node is None:
            for n in nodes:
                if n.poll() is not None and n.returncode != 0:
                    out, err = n.communicate()
                    if "job failed" in err:
                        controller_node = (time.monotonic() - t0, err)
            time.sleep(0.1)
        assert controller_node is not None, "the controller did not report the failure"
        elapsed, err = controller_node
        assert elapsed < 10, (elapsed, err[-3000:])
        assert f"node 1 agent (host 127.0.0.1, pid {agent})" in err and "bundles 2..3" in err
        # the agent's death is seen by its missed heartbeats or, sooner, by its dropped connection
        assert "missed heartbeats" in err or "connection lost (the process exited or its host is unreachable)" in err, (
            err[-3000:]
        )
    finally:
        reap(nodes)


def read_until(p: subprocess.Popen, needle: str, timeout: float) -> str:
    """Read p's stdout until a line contains ``needle`` (the job is then fully up). Fails at
    once, with the process's stderr, when it exits first."""
    import threading

    seen: list[str] = []
    found, ended = threading.Event(), threading.Event()

    def pump():
        for line in p.stdout:
            seen.append(line)
            if needle in line:
                found.set()
                return
        ended.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found.wait(0.2) and not ended.is_set() and time.monotonic() < deadline:
        pass
    if not found.is_set() and ended.is_set():
        rc = p.wait(30)
        err = p.stderr.read() if p.stderr is not None else ""
        raise AssertionError(f"{needle!r} not printed; the process exited {rc}: {''.join(seen)[-2000:]}\n{err[-3000:]}")
    assert found.is_set(), f"{needle!r} not printed in {timeout} s: {''.join(seen)[-2000:]}"
    return "".join(seen)


def test_killing_a_worker_names_node_bundle_and_roles():
    p = relay_cli("train", "--config", "tiny-cpu-split", "--hold", "120")
    try:
        read_until(p, "holding the job", 60)  # mid-run: everything placed
        worker = procs_with_env("RELAY_BUNDLE", "2")[0]
        os.kill(worker, signal.SIGKILL)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 1
    assert re.search(
        rf"relay: job failed: node 0 \(host [^)]+\): the worker of bundle 2 "
        rf"\(roles: actor, genrm\[__default__\]; pid {worker}\) was killed by signal SIGKILL",
        err,
    ), err


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signals_stop_everything_cleanly(sig, code):
    p = relay_cli("train", "--config", "tiny-cpu-split", "--hold", "120")
    try:
        read_until(p, "holding the job", 60)
        p.send_signal(sig)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == code, err
    assert f"stopped by {signal.Signals(sig).name}" in err
    wait_for(lambda: not procs_with_env("RELAY_BUNDLE"), 10, "workers to exit")


def test_invalid_layout_fails_before_starting_anything():
    p = relay_cli("train", "--config", "tiny-cpu-split", "--rollout-num-gpus", "3")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "GPU allocation must satisfy one of" in err and "placed" not in out


def test_network_interface_sets_the_address_and_nccl_gloo_interfaces_of_every_worker():
    p = relay_cli("train", "--config", "tiny-cpu-split", "--network-interface", "lo", "--hold", "120")
    try:
        read_until(p, "holding the job", 60)
        workers = set(procs_with_env("RELAY_BUNDLE"))
        assert len(workers) == 4
        assert workers <= set(procs_with_env("NCCL_SOCKET_IFNAME", "lo")) & set(
            procs_with_env("GLOO_SOCKET_IFNAME", "lo")
        )
        assert workers <= set(procs_with_env("RELAY_HOST", "127.0.0.1"))
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 143


def test_an_interface_without_an_address_is_refused_naming_the_host_and_its_interfaces():
    p = relay_cli("train", "--config", "tiny-cpu-split", "--network-interface", "nosuch0")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and "placed" not in out
    assert f"--network-interface 'nosuch0': that interface has no IPv4 address on {socket.gethostname()}" in err
    assert "interfaces with one: lo (127.0.0.1)" in err


def test_a_missing_input_stops_the_job_before_any_worker_starts_naming_node_and_flag(tmp_path):
    data, model = tmp_path / "nope.jsonl", tmp_path / "no-model"
    p = relay_cli("train", "--config", "tiny-cpu-split", "--prompt-data", str(data), "--hf-checkpoint", str(model))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1 and "placed a probe actor" not in out
    host = socket.gethostname()
    # the judge (under .cache, built on first use by the tiny configs) is not reported
    assert (
        f"relay: job failed: node 0 (host {host}): missing {model} (--hf-checkpoint); node 0 (host {host}): missing "
        f"{data} (--prompt-data)\n"
        in err
    )


def test_a_model_folder_without_a_checkpoint_stops_the_job_before_any_worker_starts(tmp_path):
    """An existing folder without config.json once passed the check and failed in the controller
    after every worker was placed, as "model ... not found"."""
    model, data = tmp_path / "empty-model", tmp_path / "d.jsonl"
    model.mkdir()
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    p = relay_cli("train", "--config", "tiny-cpu-split", "--hf-checkpoint", str(model), "--prompt-data", str(data),
                  "--run-dir", str(tmp_path))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1 and "placed a probe actor" not in out
    assert (f"relay: job failed: node 0 (host {socket.gethostname()}): --hf-checkpoint {model} is a folder without "
            "config.json, not a model checkpoint") in err, err[-3000:]


def test_a_bad_data_row_stops_the_job_before_any_worker_starts_naming_its_line(tmp_path):
    """A row without a reference once trained on "" (every reward 0, silently); bytes that are not
    UTF-8 once ended the job with a bare UnicodeDecodeError."""
    data = tmp_path / "d.jsonl"
    for content, message in (
        (b'{"prompt": "1+1?", "label": "2"}\n{"prompt": "2+2?"}\n',
         f"relay: job failed: DataError: --prompt-data: {data}:2 has no 'label': --rm-type dapo-genrm compares"),
        (b'{"prompt": "1+1?", "label": "2"}\n\xff{"prompt": "2+2?"}\n',
         f"relay: job failed: DataError: --prompt-data: {data}:2 is not UTF-8 text"),
    ):
        data.write_bytes(content)
        p = relay_cli("train", "--config", "tiny-cpu-split", "--prompt-data", str(data), "--run-dir", str(tmp_path))
        out, err = p.communicate(timeout=120)
        assert p.returncode == 1 and "placed a probe actor" not in out and message in err, err[-3000:]


def test_a_taken_gateway_port_stops_the_job_before_anything_starts(tmp_path):
    """A second job with a judge on a node once placed every worker, then failed ~15 s later."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = relay_cli("train", "--config", "tiny-cpu-split", "--prompt-data", str(data), "--run-dir", str(tmp_path),
                      "--genrm-gateway-port", str(port))
        out, err = p.communicate(timeout=60)
    assert p.returncode == 2 and out == "", (out, err)
    assert (f"the judge gateway cannot listen on 127.0.0.1:{port} (Address already in use: another job or server is "
            "there); choose another port (--genrm-gateway-port; 0 picks a free one)") in err


def test_a_restarted_job_waits_a_moment_for_its_previous_judge_to_free_the_port(tmp_path):
    """With fault tolerance the port check gives a taken port 10 s to be freed (the failed run's
    judge may still be exiting); without it, it answers at once."""
    import threading

    from launcher.config import load_config
    from launcher.job import gateway_port_taken

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    args = ["--prompt-data", str(data), "--genrm-gateway-port", str(port)]
    t0 = time.monotonic()
    assert "cannot listen on" in gateway_port_taken(load_config("tiny-cpu-split", args))
    assert time.monotonic() - t0 < 1.0
    threading.Timer(1.0, taken.close).start()
    t0 = time.monotonic()
    assert gateway_port_taken(load_config("tiny-cpu-split", [*args, "--use-fault-tolerance"])) is None
    assert 0.9 < time.monotonic() - t0 < 5.0


def test_a_run_dir_that_cannot_be_written_stops_the_job_before_any_worker_starts(tmp_path):
    """Each worker once failed to open its log there: four tracebacks and "bundle -1 (roles: ?)"."""
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "file" / "run"  # under a regular file: even root cannot create it
    p = relay_cli("train", "--config", "tiny-cpu-split", "--run-dir", str(run_dir), "--num-rollout", "1")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1 and "placed a probe actor" not in out and "Traceback" not in err, err[-3000:]
    assert (
        f"relay: job failed: node 0 (host {socket.gethostname()}): cannot write --run-dir {run_dir} (Not a directory): "
        "choose a directory this user can create and write on every node\n" in err
    ), err[-3000:]
    # past the check (patched out here), a worker that dies before its hello is named by its bundle and roles
    code = ("import sys, launcher.config.paths as p; p.unwritable_here = lambda d: None; "
            "from launcher.cli import main; "
            f"sys.exit(main(['train', '--config', 'tiny-cpu-split', '--run-dir', {str(run_dir)!r}]))")
    p = subprocess.Popen([PY, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1, err[-3000:]
    assert re.search(r"relay: job failed: node 0 \(host [^)]*\): the worker of bundle [0-3] \(roles: actor, "
                     r"(rollout|genrm\[__default__\]); pid (\d+|not known yet)\) exited with code 1", err), err[-3000:]


def test_a_model_missing_on_another_node_names_that_node(tmp_path):
    """Two "nodes" in two working directories: the relative model path exists only in the
    controller's; the agent's check (its workers would load it) names node 1."""
    here, there = tmp_path / "node0", tmp_path / "node1"
    (here / "models" / "policy").mkdir(parents=True)
    (here / "models" / "policy" / "config.json").write_text("{}")
    there.mkdir()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1?", "label": "2"}\n')
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    port = free_port()
    args = [
        TORCHRUN,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "missing-model",
        "-m",
        "launcher",
        "--config",
        "tiny-cpu-split",
        "--gpus-per-node",
        "2",
        "--hf-checkpoint",
        "models/policy",
        "--prompt-data",
        str(prompts),
    ]
    # the first torchrun hosts the store and gets rank 0 (see test_killing_an_agent_stops_the_job_within_10_s)
    nodes = [subprocess.Popen(args, cwd=here, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    try:
        wait_for(lambda: _listening(port), 30, "the rendezvous store")
        nodes.append(
            subprocess.Popen(args, cwd=there, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
        outs = [n.communicate(timeout=120) for n in nodes]
    finally:
        reap(nodes)
    assert [n.returncode for n in nodes] == [1, 1], [
        o[1][-2000:] for o in outs
    ]  # every node exits non-zero when the job failed
    assert (
        f"relay: job failed: node 1 (host {socket.gethostname()}): missing models/policy (--hf-checkpoint)\n"
        in outs[0][1]
    )
    assert "placed a probe actor" not in outs[0][0]
