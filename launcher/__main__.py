"""``python -m launcher [--sft] --config X.yaml [--hold S] [--flag value ...]``: the torchrun entry
(``relay train``'s arguments, parsed by launcher/cli.py).

    torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD:29500 -m launcher --config X.yaml

Rank 0 becomes the controller (and its node's agent); every other rank an agent. The exit
code is also written to ``$RELAY_EXIT_CODE_FILE`` when set (see ``launcher/exitcodes.py``).
"""

from __future__ import annotations

import sys

from launcher.cli import torchrun_main
from launcher.exitcodes import record_exit_code
from reward.rewards import use_working_directory

if __name__ == "__main__":
    use_working_directory()  # already first under -m; also exported to the processes it starts
    code = 1  # an exception escaping main() exits 1, as Python does
    try:
        code = torchrun_main(sys.argv[1:])
    finally:
        record_exit_code(code)
    sys.exit(code)
