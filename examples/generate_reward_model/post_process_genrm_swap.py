"""The original's documented import path of the Defer-swap hook
(``--custom-reward-post-process-path
examples.generate_reward_model.post_process_genrm_swap.custom_reward_post_process``): the
hook itself ships in the package, reward/examples/post_process_genrm_swap.py."""

from reward.examples.post_process_genrm_swap import custom_reward_post_process

__all__ = ["custom_reward_post_process"]
