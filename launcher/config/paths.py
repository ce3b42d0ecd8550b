"""The input paths a job reads, checked on every node before any worker starts: a missing
model or data file stops the job at once with "node N (host H): missing PATH (--flag)" (a
model path that is a file or a folder without config.json: "--flag PATH is a folder without
config.json, not a model checkpoint ..."),
instead of minutes later inside a worker; so does a run directory a node cannot write (its
workers' logs go there).

Where each is needed: models (``--hf-checkpoint``, the judges' model paths) on every node,
since workers anywhere load them; data (``--prompt-data``, ``--eval-prompt-data``) only on
node 0, whose controller alone reads it. A relative path resolves against each agent's
working directory, as its workers' do. A model that ``ensure_model`` builds on first use
(under ``$RELAY_CACHE``, the tiny CPU configs) is not required to exist.
"""

from __future__ import annotations

import asyncio
import os

from launcher.config.rules import RESERVED_INSTANCE
from launcher.config.schema import JobConfig

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
        out += judge_models(cfg)
    if cfg.prompt_data:
        out.append(["--prompt-data", cfg.prompt_data, "data"])
    for name, path in cfg.eval_sets:
        out.append(["--eval-prompt-data" if name == cfg.eval_prompt_name else f"--eval-prompt-sets[{name!r}]", path,
                    "data"])
    return out


def model_problem(path: str) -> str | None:
    """Why ``path`` cannot be loaded here as a model (None: it holds a checkpoint's config.json,
    or ``ensure_model`` builds it on first use): "missing", or what the folder lacks."""
    from engines.models.model_builder import builds_on_first_use

    if os.path.isfile(os.path.join(path, "config.json")) or builds_on_first_use(path):
        return None
    if not os.path.exists(path):
        return "missing"
    what = "a file" if not os.path.isdir(path) else "a folder without config.json"
    return f"{what}, not a model checkpoint (a Hugging Face model folder: config.json, *.safetensors, tokenizer)"


def judge_models(cfg: JobConfig) -> list[Input]:
    """The judges' model paths (inputs of kind "model"), each with the flag that set it."""
    return [
        ["--genrm-model-path" if name == RESERVED_INSTANCE else f"--genrm-instances[{name!r}].model_path",
         inst.model_path, "model"]
        for name, inst in cfg.genrm.items()
    ]


def describe(flag: str, path: str, why: str) -> str:
    """One entry of :func:`missing_here`, as its messages say it."""
    unset = " (is an environment variable of the config unset?)" if "${" in path else ""
    return (f"missing {path} ({flag})" if why == "missing" else f"{flag} {path} is {why}") + unset


def problems_here(inputs: list[Input]) -> str | None:
    """One message naming each input this machine cannot read ("missing PATH (--flag)"), or None."""
    return "; ".join(describe(*entry) for entry in missing_here(inputs)) or None


def missing_here(inputs: list[Input]) -> list[list[str]]:
    """[flag, path, why] of each input this machine cannot read: why "missing", or (models)
    what the path is instead of a checkpoint."""
    out = []
    for flag, path, kind in inputs:
        why = model_problem(path) if kind == "model" else None if os.path.exists(path) else "missing"
        if why:
            out.append([flag, path, why])
    return out


def unwritable_here(run_dir: str) -> str | None:
    """Why this node cannot write its workers' logs under ``run_dir`` (RUN_DIR/logs, created
    now), or None when it can."""
    logs = os.path.join(run_dir, "logs")
    try:
        os.makedirs(logs, exist_ok=True)
    except OSError as e:
        return e.strerror or str(e)
    return None if os.access(logs, os.W_OK | os.X_OK) else "not writable"


async def check_inputs_on_every_node(cfg: JobConfig, mode: str, agents: dict, run_dir: str) -> str | None:
    """Ask every node's agent (``{node: NodeAgent mesh}``) which inputs it lacks and whether it
    can write ``run_dir``; return one message naming each problem with its node, host and flag,
    or None if there is none."""
    inputs = job_inputs(cfg, mode)
    models = [i for i in inputs if i[2] == "model"]
    nodes = sorted(agents)
    replies = await asyncio.gather(
        *(agents[n].check_paths.call_one(inputs if n == 0 else models, run_dir).result(60) for n in nodes)
    )
    problems = [
        f"node {n} (host {reply['host']}): {describe(*entry)}"
        for n, reply in zip(nodes, replies)
        for entry in reply["missing"]
    ]
    problems += [
        f"node {n} (host {reply['host']}): cannot write --run-dir {run_dir} ({reply['unwritable']}): choose a "
        "directory this user can create and write on every node"
        for n, reply in zip(nodes, replies)
        if reply.get("unwritable")
    ]
    return "; ".join(problems) or None
