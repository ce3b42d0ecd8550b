"""The input paths a job reads, checked on every node before any worker starts: a missing
model or data file stops the job at once with "node N (host H): missing PATH (--flag)",
instead of minutes later inside a worker.

Where each is needed: models (``--hf-checkpoint``, the judges' model paths) on every node,
since workers anywhere load them; data (``--prompt-data``, ``--eval-prompt-data``) only on
node 0, whose controller alone reads it. A relative path resolves against each agent's
working directory, as its workers' do. A model that ``ensure_model`` builds on first use
(under ``$RELAY_CACHE``, the tiny CPU configs) is not required to exist.
"""

from __future__ import annotations

import asyncio
import os

from .config import JobConfig
from .config_rules import RESERVED_INSTANCE

#: An input: [flag, path, kind], kind "model" (every node) or "data" (node 0).
Input = list[str]


def job_inputs(cfg: JobConfig, mode: str) -> list[Input]:
    """The paths a job of ``mode`` ("train" or "sft") will read; none for a train job
    without ``--prompt-data`` (it only places the job)."""
    if mode != "sft" and not cfg.prompt_data:
        return []
    out: list[Input] = []
    if cfg.hf_checkpoint:
        out.append(["--hf-checkpoint", cfg.hf_checkpoint, "model"])
    if mode != "sft":
        for name, inst in cfg.genrm.items():
            flag = "--genrm-model-path" if name == RESERVED_INSTANCE else f"--genrm-instances[{name!r}].model_path"
            out.append([flag, inst.model_path, "model"])
    for flag, path in (("--prompt-data", cfg.prompt_data), ("--eval-prompt-data", cfg.eval_prompt_data)):
        if path:
            out.append([flag, path, "data"])
    return out


def missing_here(inputs: list[Input]) -> list[list[str]]:
    """[flag, path] of each input absent on this machine (models built on first use excepted)."""
    from engines.model_builder import builds_on_first_use

    return [
        [flag, path]
        for flag, path, kind in inputs
        if not os.path.exists(path) and not (kind == "model" and builds_on_first_use(path))
    ]


async def check_inputs_on_every_node(cfg: JobConfig, mode: str, agents: dict) -> str | None:
    """Ask every node's agent (``{node: NodeAgent mesh}``) which inputs it lacks; return one
    message naming each missing path with its node, host and flag, or None if none is missing."""
    inputs = job_inputs(cfg, mode)
    if not inputs:
        return None
    models = [i for i in inputs if i[2] == "model"]
    nodes = sorted(agents)
    replies = await asyncio.gather(
        *(agents[n].check_paths.call_one(inputs if n == 0 else models).result(60) for n in nodes)
    )
    problems = [
        f"node {n} (host {reply['host']}): missing {path} ({flag})"
        + (" (is an environment variable of the config unset?)" if "${" in path else "")
        for n, reply in zip(nodes, replies)
        for flag, path in reply["missing"]
    ]
    return "; ".join(problems) or None
