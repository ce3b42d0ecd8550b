"""End to end: ``relay train`` with engines that span GPUs (``--rollout-num-gpus-per-engine``,
``--genrm-num-gpus-per-engine``): in colocate Split on 4 virtual bundles, one rollout engine
over bundles 0-1 and one judge engine over 2-3, each a tensor-parallel built-in engine
(engines/torch/tp.py) whose follower rank lives in the other bundle's worker. The step
trains, every sync reaches the engine (rank 0 broadcasts to its follower) and the judge's
verdicts vary within groups."""

from __future__ import annotations

import pytest

from tests.e2e.test_grpo_modes import (
    check_common,
    check_rollout_order,
    check_weights_changed,
    events,
    records,
    run_train,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400, func_only=True)]


def test_colocate_split_with_tensor_parallel_rollout_and_judge_engines(data, tmp_path):
    run_dir = str(tmp_path / "run")
    out = run_train("tiny-cpu-split", data, run_dir, "--rollout-num-gpus-per-engine", "2",
                    "--genrm-num-gpus-per-engine", "2", timeout=380)
    assert "started 1 rollout engine(s), 1 judge engine(s)" in out
    recs = records(run_dir)
    check_common(recs, samples=32)
    check_weights_changed(recs)
    assert all(r["sync/engine_versions"] == [r["step"] + 1] for r in recs)  # one engine, over two bundles
    evs = events(run_dir)
    check_rollout_order(evs, 1)
    assert sorted({e["engine"] for e in evs}) == ["genrm0", "rollout0"]
