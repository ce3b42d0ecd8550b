"""Moved to examples/generate_reward_model/reward_dual_genrm_quality_safety.py (the original's module
path); this old path still imports."""

from examples.generate_reward_model.reward_dual_genrm_quality_safety import *  # noqa: F403
