"""Moved to examples/generate_reward_model/agentic_routing.py (the original's module
path); this old path still imports."""

from examples.generate_reward_model.agentic_routing import *  # noqa: F403
