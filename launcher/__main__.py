"""``python -m launcher --config X.yaml [--hold S] [--flag value ...]``: the torchrun entry.

    torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HEAD:29500 -m launcher --config X.yaml

Rank 0 becomes the controller (and its node's agent); every other rank an agent.
"""

from __future__ import annotations

import sys

from launcher.job import main
from reward.rewards import use_working_directory

if __name__ == "__main__":
    use_working_directory()  # already first under -m; also exported to the processes it starts
    sys.exit(main(sys.argv[1:]))
