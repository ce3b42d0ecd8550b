"""`relay train` with a Qwen3-MoE policy: expert parallelism and the load-balancing loss
through the whole GRPO stack on CPU (the trainer's experts split over 2 of its 4 DP ranks,
the reference trainer too; the built-in rollout engines serve the MoE model and take its
weight updates)."""

from __future__ import annotations

import pytest

from tests.e2e.test_grpo_modes import check_weights_changed, records, run_train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300, func_only=True)]


def test_grpo_trains_a_moe_policy_with_expert_parallelism(data, tmp_path):
    from engines.models.model_builder import make_model

    policy = make_model("qwen3_moe", "tiny", str(tmp_path / "moe-policy"), seed=2)
    run_dir = str(tmp_path / "run")
    run_train("tiny-cpu-split", {**data, "policy": policy}, run_dir, "--expert-model-parallel-size", "2",
              "--moe-aux-loss-coeff", "0.01", "--use-kl-loss", "--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl")
    recs = records(run_dir)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["train/moe_load_balancing_loss"] > 0 for r in recs)
    assert recs[0]["train/kl"] == pytest.approx(0.0, abs=1e-6) and recs[1]["train/kl"] > 0
    for r in recs:
        assert r["sync/engine_versions"] == [r["step"]] * len(r["sync/engine_versions"])
    check_weights_changed(recs)
