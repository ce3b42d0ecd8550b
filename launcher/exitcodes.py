"""Exit codes of ``python -m launcher`` that wrappers act on, and how a wrapper learns them.

torchrun reports any failed worker as exit code 1 (and exits 1 itself after a SIGTERM), so the
launcher's own code does not survive it. ``python -m launcher`` therefore also writes its
exit code to the file named by ``RELAY_EXIT_CODE_FILE`` when that variable is set; the slurm
script of ``relay sbatch`` sets it per node and requeues the job when a node reports
:data:`EXIT_CHECKPOINTED_ON_SIGNAL`.
"""

from __future__ import annotations

import os
import sys

from launcher.settings import settings as launcher_settings

#: The controller wrote a complete checkpoint after SIGTERM (slurm's preemption or time-limit
#: warning) and stopped the job: requeue it and continue with ``--resume``. 75 is EX_TEMPFAIL.
EXIT_CHECKPOINTED_ON_SIGNAL = 75

#: Environment variable: a path where ``python -m launcher`` writes its exit code on exit.
EXIT_CODE_FILE_ENV = "RELAY_EXIT_CODE_FILE"


def record_exit_code(code: int) -> None:
    """Write ``code`` (decimal, one line) to ``$RELAY_EXIT_CODE_FILE`` if it is set.

    The file appears whole or not at all (written aside, then renamed). A failure to write
    is reported on stderr and otherwise ignored: the exit code itself is unaffected."""
    path = launcher_settings().exit_code_file
    if not path:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(f"{code}\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"relay: cannot write the exit code to {EXIT_CODE_FILE_ENV}={path}: {e}", file=sys.stderr, flush=True)
