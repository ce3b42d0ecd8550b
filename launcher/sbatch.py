"""``relay sbatch``: a slurm script that runs one torchrun per node, the head node being the
rendezvous (torchrun's c10d store)."""

from __future__ import annotations

import os
import shlex


def render_sbatch(
    config: str,
    nodes: int,
    overrides: list[str],
    *,
    partition: str | None = None,
    time: str | None = None,
    gpus_per_node: int = 8,
    job_name: str = "relay",
    port: int = 29500,
) -> str:
    if nodes < 1:
        raise ValueError("--nodes must be at least 1")
    config_path = os.path.abspath(config) if os.path.exists(config) else config
    extra = " ".join(shlex.quote(a) for a in overrides)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        "#SBATCH --exclusive",
        "#SBATCH --output=%x-%j.out",
    ]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if time:
        lines.append(f"#SBATCH --time={time}")
    lines += [
        "",
        "# One torchrun per node; the first node of the allocation hosts the rendezvous store.",
        "# Rank 0 becomes the controller, the other ranks node agents (see README).",
        "set -euo pipefail",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export RELAY_JOB_SECRET=${RELAY_JOB_SECRET:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}",
        "",
        "srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '",
        "  export RELAY_HOST=$(hostname -I | awk \"{print \\$1}\")",
        f"  exec torchrun --nnodes {nodes} --nproc-per-node 1 \\",
        "    --rdzv-backend c10d --rdzv-id \"$SLURM_JOB_ID\" \\",
        f"    --rdzv-endpoint \"$HEAD_NODE:{port}\" \\",
        f"    -m launcher --config {shlex.quote(config_path)} --nnodes {nodes} --gpus-per-node {gpus_per_node}" + (f" {extra}" if extra else ""),
        "'",
        "",
    ]
    return "\n".join(lines)
