"""The launcher's ``RELAY_*`` environment variables (relay's :class:`~relay.Layer` shape), and
every layer's at once: :data:`LAYERS` (docs/relay.md's table), :func:`check_all`."""

from __future__ import annotations

import relay
from engines.settings import settings as engines_settings
from relay.variables import Layer, Variable, flag_off, seconds, text
from reward.settings import settings as reward_settings

VARIABLES = (
    Variable("RELAY_AGENT_TIMEOUT", "agent_timeout", 10.0, seconds, "launcher",
             "a node agent exits when the controller stops acking its beats for this many seconds"),
    Variable("RELAY_JOB_RUN_DIR", "job_run_dir", "", text, "launcher",
             "the job's run directory (workers' log files go there)"),
    Variable("RELAY_FORK_SERVER", "fork_server", True, flag_off, "launcher",
             "node agents fork each worker from a process that imported torch, transformers and Megatron "
             "once (seconds faster to start); `0`: each worker starts as a new process"),
    Variable("RELAY_EXIT_CODE_FILE", "exit_code_file", "", text, "launcher",
             "where `python -m launcher` writes its exit code"),
)
settings = Layer("launcher", "launcher / you", VARIABLES)
LAYERS = (engines_settings, reward_settings, settings)  # above relay's own, in layer order


def check_all() -> None:
    """Parse every layer's variables now (ValueError naming the first bad one)."""
    relay.settings()
    for layer in LAYERS:
        layer()
