"""The original system's ``examples/generate_reward_model/`` reward code, importable under
the same module paths (``--custom-rm-path
examples.generate_reward_model.reward_dual_genrm_quality_safety.reward_func``,
``--custom-reward-post-process-path
examples.generate_reward_model.post_process_genrm_swap.custom_reward_post_process``)."""
