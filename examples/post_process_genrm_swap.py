"""Moved to examples/generate_reward_model/post_process_genrm_swap.py (the original's module
path); this old path still imports."""

from examples.generate_reward_model.post_process_genrm_swap import *  # noqa: F403
