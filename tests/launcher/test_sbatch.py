"""The `relay sbatch` script, run for real by bash under stub slurm commands (tests/slurm_stubs:
srun runs its command once per node with the variables slurm sets, scontrol expands node
lists and records requeues, torchrun records its exact argv and environment per node)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher.test_launch import procs_with_env, wait_for

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "tests" / "slurm_stubs"
pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

JSON = '{"actor": [1, 4], "rollout": [1, 2], "genrm": [1, 2]}'
TEMPLATE = "Judge 'this' \"fairly\":\n{question}\n  answer: {answer}  reference: {label}\n"
OVERRIDES = ["--resource", JSON, "--genrm-prompt-template", TEMPLATE, "--lr", "2e-6"]


def render(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``relay sbatch`` run in tmp_path (so its log directory lands there)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", "sbatch", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def slurm_env(tmp_path: Path, job_id: int, **extra: str) -> dict:
    """The environment sbatch gives the batch script, with the stubs first on PATH."""
    log = tmp_path / "slurm"
    log.mkdir(exist_ok=True)
    path = os.pathsep.join([str(STUBS), os.path.dirname(sys.executable), os.environ["PATH"]])
    return {
        **os.environ,
        "PATH": path,
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NAME": "relay",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "STUB_SLURM_LOG": str(log),
        **extra,
    }


def run_script(tmp_path: Path, job_id: int = 4242, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(tmp_path / "job.sbatch")],
        cwd=tmp_path,
        env=slurm_env(tmp_path, job_id, **extra),
        capture_output=True,
        text=True,
        timeout=60,
    )


def argv(tmp_path: Path, node: int) -> list[str]:
    return (tmp_path / "slurm" / f"torchrun-node{node}.argv").read_bytes().decode().split("\0")[:-1]


def env_of(tmp_path: Path, node: int) -> dict[str, str]:
    items = (tmp_path / "slurm" / f"torchrun-node{node}.env").read_bytes().decode().split("\0")[:-1]
    return dict(item.split("=", 1) for item in items)


def first_free_port(port: int) -> int:
    """The port the script should pick: the first one from ``port`` that can be bound here."""
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
                return port
            except OSError:
                port += 1


def requeues(tmp_path: Path) -> list[str]:
    log = tmp_path / "slurm" / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


# ---------------------------------------------------------------------------- item 3: the script works


def test_every_node_runs_torchrun_with_the_exact_launcher_arguments(tmp_path):
    p = render(
        tmp_path, "--config", "tiny-cpu-split", "--nodes", "2", "--gpus-per-node", "2", "-o", "job.sbatch", *OVERRIDES
    )
    assert p.returncode == 0, p.stderr
    port = first_free_port(20000 + 4242 % 10000)
    done = run_script(tmp_path, 4242)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-id",
        "4242",
        "--rdzv-endpoint",
        f"node01:{port}",
        "-m",
        "launcher",
        "--config",
        "tiny-cpu-split",
        "--nnodes",
        "2",
        "--gpus-per-node",
        "2",
        *OVERRIDES,
    ]
    secrets = set()
    for node in (0, 1):
        assert argv(tmp_path, node) == expected  # the JSON and the template byte for byte
        env = env_of(tmp_path, node)
        assert env["SLURMD_NODENAME"] == f"node0{node + 1}" and env["HEAD_NODE"] == "node01"
        assert env["RELAY_EXIT_CODE_FILE"] == str(tmp_path / "logs" / f"relay-4242-node{node}.exit")
        assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "300"
        secrets.add(env["RELAY_JOB_SECRET"])
        log = (tmp_path / "logs" / f"relay-4242-node{node}.log").read_text()  # srun --output, per node
        assert f"relay: node {node} (" in log and f"stub torchrun on node {node}" in log
    assert len(secrets) == 1 and len(secrets.pop()) == 64  # one job secret, shared by every node
    assert requeues(tmp_path) == []


def test_sbatch_checks_the_plan_with_the_nodes_and_gpus_it_passes(tmp_path):
    p = render(tmp_path, "--config", "tiny-cpu-split", "--nodes", "1", "--gpus-per-node", "2")
    assert p.returncode == 2 and p.stdout == ""
    assert (
        "invalid layout on 1 node(s) x 2 GPUs" in p.stderr
        and "the actor needs 4 GPUs but 1 node(s) x 2 give 2" in p.stderr
    )
    p = render(tmp_path, "--config", "tiny-cpu-split", "--nodes", "2", "--nnodes", "3")
    assert p.returncode == 2 and "relay sbatch sets --nnodes from --nodes; remove --nnodes" in p.stderr
    p = render(tmp_path, "--config", "tiny-cpu-split", "--nodes", "1", "--colocat")
    assert p.returncode == 2 and "did you mean 'colocate'" in p.stderr


def test_script_header(tmp_path):
    p = render(
        tmp_path,
        "--config",
        "qwen35-35b-a3b-16gpu-genrm-397b-split",
        "--nodes",
        "2",
        "--partition",
        "gpu",
        "--time",
        "24:00:00",
        "--signal-grace",
        "600",
        "--log-dir",
        "out/logs",
        "-o",
        "job.sbatch",
    )
    assert p.returncode == 0, p.stderr
    text = (tmp_path / "job.sbatch").read_text()
    logs = tmp_path / "out" / "logs"
    assert logs.is_dir()  # slurm does not create --output's directory: relay sbatch does
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=24:00:00",
        f"#SBATCH --output={logs}/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --signal=TERM@600",
        "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600",
    ]:
        assert line in text.splitlines() or line in text, line
    cpu = render(tmp_path, "--config", "tiny-cpu-split", "--nodes", "2", "--gpus-per-node", "2")
    assert cpu.returncode == 0 and "--gpus-per-node=" not in cpu.stdout  # virtual bundles: no GPUs requested


# ---------------------------------------------------------------------------- item 9: slurm in practice


def test_a_checkpoint_on_signal_requeues_the_job_and_the_next_run_resumes(tmp_path):
    assert (
        render(
            tmp_path, "--config", "tiny-cpu-split", "--nodes", "2", "--gpus-per-node", "2", "-o", "job.sbatch"
        ).returncode
        == 0
    )
    first = run_script(tmp_path, 4242, STUB_TORCHRUN="checkpoint")
    assert first.returncode == 0, first.stderr
    assert requeues(tmp_path) == ["requeue 4242"]
    assert "checkpointed on a signal; requeueing job 4242" in first.stdout
    assert (tmp_path / "logs" / "relay-4242-node0.exit").read_text() == "75\n"
    assert "--resume" not in argv(tmp_path, 0)

    # slurm starts the requeued job with the same id and SLURM_RESTART_COUNT=1
    again = run_script(tmp_path, 4242, STUB_TORCHRUN="exit:0", SLURM_RESTART_COUNT="1")
    assert again.returncode == 0, again.stderr
    for node in (0, 1):
        assert argv(tmp_path, node)[-1] == "--resume"
        log = (tmp_path / "logs" / f"relay-4242-node{node}.log").read_text()
        assert "restart 0" in log and "restart 1" in log  # the log is appended to, not truncated
    assert not list((tmp_path / "logs").glob("*.exit"))  # the last run's codes were cleared first
    assert requeues(tmp_path) == ["requeue 4242"]  # no second requeue: that run finished


def test_a_cancelled_job_is_not_requeued(tmp_path):
    assert (
        render(
            tmp_path, "--config", "tiny-cpu-split", "--nodes", "2", "--gpus-per-node", "2", "-o", "job.sbatch"
        ).returncode
        == 0
    )
    done = run_script(tmp_path, 4242, STUB_TORCHRUN="checkpoint", STUB_JOB_STATE="CANCELLED")
    assert done.returncode == 75 and "not requeueing" in done.stderr
    assert requeues(tmp_path) == []


def test_sigterm_to_every_process_of_the_job_ends_in_a_requeue(tmp_path):
    """Slurm's preemption / time-limit signal reaches every process of the step and the batch
    shell: the shells survive it and wait for the launcher, whose exit code drives the requeue."""
    assert (
        render(
            tmp_path, "--config", "tiny-cpu-split", "--nodes", "2", "--gpus-per-node", "2", "-o", "job.sbatch"
        ).returncode
        == 0
    )
    batch = subprocess.Popen(
        ["bash", str(tmp_path / "job.sbatch")],
        cwd=tmp_path,
        env=slurm_env(tmp_path, 77, STUB_TORCHRUN="wait-term"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: all((tmp_path / "slurm" / f"torchrun-node{n}.argv").exists() for n in (0, 1)),
            30,
            "torchrun on both nodes",
        )
        step = procs_with_env("SLURM_STEP_ID", "0")
        assert len(step) >= 4  # per node: the node shell and torchrun (and torchrun's children)
        for pid in [*step, batch.pid]:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        out, err = batch.communicate(timeout=60)
    finally:
        if batch.poll() is None:
            batch.kill()
            batch.communicate()
    assert batch.returncode == 0, err
    assert "the batch script got SIGTERM; waiting for the nodes" in err
    assert requeues(tmp_path) == ["requeue 77"]
    for node in (0, 1):
        log = (tmp_path / "logs" / f"relay-77-node{node}.log").read_text()
        assert f"relay: node {node} got SIGTERM; waiting for torchrun" in log and "the launcher checkpointed" in log


def test_rendezvous_ports_differ_between_jobs_and_skip_busy_ones(tmp_path):
    assert (
        render(
            tmp_path, "--config", "tiny-cpu-split", "--nodes", "2", "--gpus-per-node", "2", "-o", "job.sbatch"
        ).returncode
        == 0
    )

    def port_of(job_id: int) -> int:
        assert run_script(tmp_path, job_id).returncode == 0
        return int(argv(tmp_path, 0)[argv(tmp_path, 0).index("--rdzv-endpoint") + 1].rsplit(":", 1)[1])

    a, b = port_of(4242), port_of(4243)
    assert a != b and a == first_free_port(24242) and 20000 <= b < 30000
    with socket.socket() as busy:  # another job's rendezvous store on this head node
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("", a))
        busy.listen()
        assert port_of(14242) == first_free_port(a + 1)  # same base port as job 4242, which holds it
    fixed = render(tmp_path, "--config", "tiny-cpu-split", "--nodes", "2", "--gpus-per-node", "2", "--port", "29511")
    assert fixed.returncode == 0 and "RDZV_PORT=29511" in fixed.stdout


def test_launcher_writes_its_exit_code_for_the_script(tmp_path):
    dest = tmp_path / "code"
    env = {
        **os.environ,
        "RELAY_EXIT_CODE_FILE": str(dest),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    p = subprocess.run(
        [sys.executable, "-m", "launcher", "--config", "tiny-cpu-split", "--colocat"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and dest.read_text() == "2\n"


@pytest.mark.timeout(180)
def test_the_script_places_a_real_two_node_job(tmp_path):
    """The real torchrun and launcher on two "nodes" of this host (stub srun and scontrol):
    the rendezvous, the quoted arguments and the exit-code files work end to end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).symlink_to(STUBS / tool)
    p = render(
        tmp_path,
        "--config",
        "tiny-cpu-split",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "-o",
        "job.sbatch",
        *OVERRIDES,
        "--network-interface",
        "lo",
    )
    assert p.returncode == 0, p.stderr
    env = slurm_env(tmp_path, 31337, SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1")
    env["PATH"] = env["PATH"].replace(str(STUBS), str(bin_dir), 1)  # the real torchrun
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    done = subprocess.run(
        ["bash", str(tmp_path / "job.sbatch")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150
    )
    logs = [(tmp_path / "logs" / f"relay-31337-node{n}.log").read_text() for n in (0, 1)]
    assert done.returncode == 0, done.stderr + "\n".join(log[-3000:] for log in logs)
    controller = next(log for log in logs if "placed a probe actor" in log)
    assert "shut down cleanly" in controller
    rows = [
        line.split()
        for line in controller.splitlines()
        if line.strip() and line.split()[0].isdigit() and "(cpu)" in line
    ]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(0, 0), (1, 0), (2, 1), (3, 1)]  # 2 bundles on each node
    assert [(tmp_path / "logs" / f"relay-31337-node{n}.exit").read_text() for n in (0, 1)] == ["0\n", "0\n"]
    assert requeues(tmp_path) == []
