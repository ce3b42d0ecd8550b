"""The original's documented import path of the two-judge reward
(``--custom-rm-path examples.generate_reward_model.reward_dual_genrm_quality_safety.reward_func``):
the function itself ships in the package, reward/examples/reward_dual_genrm_quality_safety.py."""

from reward.examples.reward_dual_genrm_quality_safety import reward_func

__all__ = ["reward_func"]
