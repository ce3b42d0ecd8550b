"""The hooks and reward functions the shipped configs name, inside the package (they install
with it): the original's ``examples/generate_reward_model/`` ones, which the repository keeps
at that documented import path as re-exports of these."""
