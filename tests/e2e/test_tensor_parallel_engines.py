"""End to end: ``relay train`` with engines that span GPUs (``--rollout-num-gpus-per-engine``,
``--genrm-num-gpus-per-engine``): in colocate Split on 4 virtual bundles, one rollout engine
over bundles 0-1 and one judge engine over 2-3, each a tensor-parallel built-in engine
(engines/builtin/tp.py) whose follower rank lives in the other bundle's worker. The step
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


def bundle_pids(out: str) -> dict[int, int]:
    """bundle -> pid of its worker, from the placement table the job prints."""
    table = out.split("placed a probe actor on every bundle", 1)[1].split("workers' own output", 1)[0]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    return {int(r[0]): int(r[3]) for r in rows}


def test_colocate_split_with_tensor_parallel_rollout_and_judge_engines(data, tmp_path, split_run):
    run_dir = str(tmp_path / "run")
    out = run_train("tiny-cpu-split", data, run_dir, "--rollout-num-gpus-per-engine", "2",
                    "--genrm-num-gpus-per-engine", "2", timeout=380)
    assert "started 1 rollout engine(s), 1 judge engine(s)" in out
    assert "rollout e0 rank 1/2" in out and "engines=1 x 2 GPU (tensor parallel: a rank per GPU)" in out  # the plan
    # every rank runs in the worker of the bundle the plan gave it
    pids = bundle_pids(out)
    for line, bundles in (("rollout engine 0: tensor parallel 2", [0, 1]),
                          ("genrm[__default__] engine 0: tensor parallel 2", [2, 3])):
        (placed,) = [x for x in out.splitlines() if x.startswith(line)]
        assert f"ranks on bundles {bundles}" in placed and f"pids {[pids[b] for b in bundles]}" in placed, placed
    # the same first step as the one-GPU engines' run: the samples, hence the trained weights, are the same
    one, two = records(split_run)[0], records(run_dir)[0]
    assert two["reward/mean"] == one["reward/mean"] and two["train/loss"] == pytest.approx(one["train/loss"], abs=1e-5)
    assert two["sync/probe_logprobs"][0] == pytest.approx(one["sync/probe_logprobs"][0], abs=1e-4)
    recs = records(run_dir)
    check_common(recs, samples=32)
    check_weights_changed(recs)
    assert all(r["sync/engine_versions"] == [r["step"]] for r in recs)  # one engine, over two bundles
    evs = events(run_dir)
    check_rollout_order(evs, 1)
    assert sorted({e["engine"] for e in evs}) == ["genrm0", "rollout0"]


def test_two_judge_engines_share_the_load(data, tmp_path):
    run_dir = str(tmp_path / "run")
    out = run_train("tiny-cpu-split", data, run_dir, "--num-rollout", "1", "--genrm-num-gpus-per-engine", "1",
                    timeout=380)
    assert "started 2 rollout engine(s), 2 judge engine(s)" in out
    (check,) = records(run_dir, "judge_check")
    engine_requests = check["judge/self_check_engine_requests"]
    assert len(engine_requests) == 2 and all(n > 0 for n in engine_requests), engine_requests
    assert records(run_dir)[0]["reward/judged"] == 32
