"""``relay sbatch``: a slurm script that runs one torchrun per node, the head node (the first
of the allocation, where the batch script runs) hosting the rendezvous (torchrun's c10d store).

Contract of the script (docs/launcher.md, "Slurm"):

- The launcher's arguments travel as a bash array handed to ``srun bash -c BODY relay-node
  ARGS...``: each reaches ``python -m launcher`` byte for byte (JSON, spaces, quotes, newlines).
- ``HEAD_NODE`` and ``RDZV_PORT`` are exported before ``srun``, so every node sees them. The
  port is ``--port``, else the first free port on the head node from ``20000 + JOB_ID % 10000``
  upward (within 20000-29999): two jobs sharing a node do not collide.
- Logs: the batch script to ``LOG_DIR/%x-%j.out``, each node to ``LOG_DIR/%x-%j-node%n.log``
  (appended across requeues); each node's launcher exit code to ``LOG_DIR/%x-%j-node%n.exit``.
- Preemption / time limit: ``--signal=TERM@GRACE`` asks slurm for SIGTERM GRACE seconds before
  the limit. Slurm delivers it to every process of the step (torchrun and the launcher get it
  directly); the shells in between survive it and wait, and torchrun waits up to GRACE
  seconds for the launcher (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``). When a node's launcher exits
  with :data:`~launcher.exitcodes.EXIT_CHECKPOINTED_ON_SIGNAL`, the job requeues itself
  (``scontrol requeue``, unless it was cancelled) and the next run passes ``--resume``.
"""

from __future__ import annotations

import os
import shlex

from launcher.exitcodes import EXIT_CHECKPOINTED_ON_SIGNAL, EXIT_CODE_FILE_ENV

#: Rendezvous ports derived from the job id lie in [PORT_BASE, PORT_BASE + PORT_SPAN).
PORT_BASE = 20000
PORT_SPAN = 10000

# The per-node program (srun runs it on every node as ``bash -c NODE_BODY relay-node ARGS...``).
# It is a fixed text: the launcher's arguments arrive as "$@", never spliced into code.
NODE_BODY = r"""# one node: torchrun for this node; its launcher writes its exit code to RELAY_EXIT_CODE_FILE
export {exit_env}="$RELAY_LOG_PREFIX-node$SLURM_NODEID.exit"
resume=()
if [ "${{SLURM_RESTART_COUNT:-0}}" -gt 0 ]; then resume=(--resume); fi
echo "relay: node $SLURM_NODEID ($(hostname)) of job $SLURM_JOB_ID," \
     "restart ${{SLURM_RESTART_COUNT:-0}}, rendezvous $HEAD_NODE:$RDZV_PORT"
# slurm sends SIGTERM to every process of the step: torchrun and the launcher get it directly
# (re-sending it would cut torchrun's wait for the checkpoint short); this shell only waits.
trap 'echo "relay: node $SLURM_NODEID got SIGTERM; waiting for torchrun"' TERM
torchrun --nnodes {nnodes} --nproc-per-node 1{max_restarts} --rdzv-backend c10d --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" -m launcher "$@" ${{resume[@]+"${{resume[@]}}"}} &
pid=$!
while wait "$pid"; rc=$?; [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null; do :; done
exit "$rc"
"""

PICK_PORT = f"""import os, socket
first = int(os.environ["SLURM_JOB_ID"]) % {PORT_SPAN}
for i in range({PORT_SPAN}):
    port = {PORT_BASE} + (first + i) % {PORT_SPAN}
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            continue
    print(port)
    break
"""


def render_sbatch(
    config: str,
    nodes: int,
    gpus_per_node: int,
    overrides: list[str],
    *,
    device: str = "cuda",
    partition: str | None = None,
    time: str | None = None,
    job_name: str = "relay",
    port: int | None = None,
    log_dir: str = "logs",
    signal_grace: int = 300,
    max_restarts: int = 0,
) -> str:
    """The script's text. ``overrides`` are the launcher's config flags, passed on verbatim
    after ``--config CONFIG --nnodes NODES --gpus-per-node GPUS``; ``max_restarts`` > 0 is
    torchrun's ``--max-restarts`` (``--use-fault-tolerance``: the job's --max-global-restart).
    Raises ValueError for arguments slurm cannot take (the message names the option)."""
    log_dir = _checked(nodes, gpus_per_node, port, signal_grace, log_dir)
    config_path = os.path.abspath(config) if os.path.exists(config) else config
    launcher_args = ["--config", config_path, "--nnodes", str(nodes), "--gpus-per-node", str(gpus_per_node), *overrides]
    q = shlex.quote
    lines = _directives(job_name, nodes, device, gpus_per_node, log_dir, signal_grace, partition, time)
    pick_port = f"{port}" if port is not None else f"$(python3 - <<'PY'\n{PICK_PORT}PY\n)"
    lines += [
        "",
        '# Written by `relay sbatch` (docs/launcher.md, "Slurm"). One torchrun per node; the first node',
        "# of the allocation hosts the rendezvous store; rank 0 becomes the controller, the other ranks",
        "# node agents. A launcher that checkpointed on SIGTERM exits "
        f"{EXIT_CHECKPOINTED_ON_SIGNAL}: the job then requeues itself and resumes.",
        "set -uo pipefail",
        ': "${SLURM_JOB_ID:?submit this script with sbatch}"',
        "",
        f"LOG_DIR={q(log_dir)}",
        f"EXIT_CHECKPOINTED_ON_SIGNAL={EXIT_CHECKPOINTED_ON_SIGNAL}",
        f"LAUNCHER_ARGS=({' '.join(q(a) for a in launcher_args)})",
        "",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        '[ -n "$HEAD_NODE" ] || '
        '{ echo "relay: scontrol found no host in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST" >&2; exit 1; }',
        f"RDZV_PORT={pick_port}",
        '[ -n "$RDZV_PORT" ] || '
        '{ echo "relay: no free rendezvous port on $HEAD_NODE; pass --port to relay sbatch" >&2; exit 1; }',
        "export HEAD_NODE RDZV_PORT",
        "export RELAY_JOB_SECRET=${RELAY_JOB_SECRET:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={max(signal_grace, 30)}  # how long torchrun waits for the launcher "
        f"after SIGTERM",
        'export RELAY_LOG_PREFIX="$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID"',
        'rm -f "$RELAY_LOG_PREFIX"-node*.exit',
        "",
        "read -r -d '' NODE_BODY <<'NODE' || true",
        NODE_BODY.format(
            nnodes=nodes,
            exit_env=EXIT_CODE_FILE_ENV,
            max_restarts=f" --max-restarts {max_restarts}" if max_restarts else "",
        ).rstrip("\n"),
        "NODE",
        "",
        "# The batch shell outlives SIGTERM (preemption sends it here too) until every node is done.",
        "trap 'echo \"relay: the batch script got SIGTERM; waiting for the nodes\" >&2' TERM",
        'srun --kill-on-bad-exit=0 --ntasks-per-node=1 --open-mode=append --output="$LOG_DIR/%x-%j-node%n.log" \\',
        '    bash -c "$NODE_BODY" relay-node "${LAUNCHER_ARGS[@]}" &',
        "srun_pid=$!",
        'while wait "$srun_pid"; rc=$?; [ "$rc" -gt 128 ] && kill -0 "$srun_pid" 2>/dev/null; do :; done',
        "",
        'if grep -qsx "$EXIT_CHECKPOINTED_ON_SIGNAL" "$RELAY_LOG_PREFIX"-node*.exit; then',
        '    if scontrol show job "$SLURM_JOB_ID" | grep -q "JobState=CANCELLED"; then',
        '        echo "relay: checkpointed, but the job was cancelled: not requeueing (resubmit to resume)" >&2',
        '        exit "$EXIT_CHECKPOINTED_ON_SIGNAL"',
        "    fi",
        '    echo "relay: checkpointed on a signal; requeueing job $SLURM_JOB_ID (the next run passes --resume)"',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        '    echo "relay: scontrol requeue failed; resubmit this script to resume from the checkpoint" >&2',
        '    exit "$EXIT_CHECKPOINTED_ON_SIGNAL"',
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def _checked(nodes: int, gpus_per_node: int, port: int | None, signal_grace: int, log_dir: str) -> str:
    """ValueError naming the option slurm cannot take; else ``log_dir`` made absolute."""
    if nodes < 1:
        raise ValueError("--nodes must be at least 1")
    if gpus_per_node < 1:
        raise ValueError("--gpus-per-node must be at least 1")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"--port must be a TCP port (1-65535), got {port}")
    if signal_grace < 0:
        raise ValueError(f"--signal-grace must be >= 0 seconds, got {signal_grace}")
    log_dir = os.path.abspath(log_dir)
    if any(c.isspace() or c == "%" for c in log_dir):
        raise ValueError(
            f"--log-dir {log_dir!r}: slurm's --output cannot take spaces or '%' in a path; choose another directory"
        )
    return log_dir


def _directives(job_name: str, nodes: int, device: str, gpus_per_node: int, log_dir: str, signal_grace: int,
                partition: str | None, time: str | None) -> list[str]:
    """The script's ``#SBATCH`` lines."""
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if device == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += [
        "#SBATCH --exclusive",
        f"#SBATCH --output={log_dir}/%x-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
    ]
    if signal_grace:
        lines.append(f"#SBATCH --signal=TERM@{signal_grace}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time:
        lines.append(f"#SBATCH --time={time}")
    return lines
