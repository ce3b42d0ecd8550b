"""The allocator: the original system's layouts and errors, and properties over random inputs."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launcher.allocator import PlanError, make_plan
from launcher.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.unit


def plan(**kw):
    return make_plan(load_config(None, kw))


def ranges(p):
    return {c.label(): (p.bundles_of(c)[0].index, p.bundles_of(c)[-1].index + 1) for c in p.claims if c.size}


def test_split_offsets():
    p = plan(resource={"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 4]}, colocate=True, genrm_model_path="/j")
    assert p.mode == "colocate-split"
    assert ranges(p) == {"actor": (0, 8), "rollout": (0, 4), "genrm[__default__]": (4, 8)}


def test_shared_coresident_and_memory_fractions():
    kw = dict(resource={"actor": [1, 4], "rollout": [1, 4], "genrm": [1, 4]}, colocate=True, genrm_model_path="/j")
    p = plan(**kw, sglang_mem_fraction_static=0.5, genrm_engine_config={"mem_fraction_static": 0.3})
    assert p.mode == "colocate-shared" and ranges(p)["genrm[__default__]"] == (0, 4) and not p.warnings
    p = plan(**kw, sglang_mem_fraction_static=0.6, genrm_engine_config={"mem_fraction_static": 0.35})
    assert any("> 0.9" in w for w in p.warnings)
    with pytest.raises(PlanError, match="must sum below 1.0"):
        plan(**kw, sglang_mem_fraction_static=0.7, genrm_engine_config={"mem_fraction_static": 0.3})
    # no judge fraction: the rollout's, as in the original (0.4 + 0.4 fits; the default 0.5 + 0.5 does not)
    p = plan(**kw, sglang_mem_fraction_static=0.4)
    assert p.mode == "colocate-shared" and not p.warnings
    with pytest.raises(PlanError, match=r"no mem_fraction_static: the rollout's, by default 0.5\) reserve 1.00 .* set "
                                        r"the judge's engine_config.mem_fraction_static"):
        plan(**kw)


def test_defer_swap_detection_and_rejections():
    kw = dict(resource={"actor": [1, 4], "rollout": [1, 4], "genrm": [1, 4]}, colocate=True, genrm_model_path="/j")
    defer = dict(rm_type="dummy", defer_reward_to_post_process=True, custom_reward_post_process_path="m.f")
    p = plan(**kw, **defer, sglang_mem_fraction_static=0.85, genrm_engine_config={"mem_fraction_static": 0.85})
    assert p.mode == "colocate-defer" and [c.phases for c in p.claims if c.role == "genrm"] == [("score",)]
    with pytest.raises(PlanError, match="--rm-type dummy"):
        plan(**kw, defer_reward_to_post_process=True, custom_reward_post_process_path="m.f")
    with pytest.raises(PlanError, match="needs GenRM to share the actor placement group"):
        plan(
            resource={"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 4]},
            colocate=True,
            genrm_model_path="/j",
            **defer,
        )
    with pytest.raises(PlanError, match="needs GenRM to share the actor placement group"):
        plan(
            resource={"actor": [1, 4], "rollout": [1, 2], "genrm": [1, 2]},
            fully_async=True,
            genrm_model_path="/j",
            **defer,
        )


def test_the_original_systems_error_for_other_colocate_allocations():
    with pytest.raises(PlanError) as info:
        plan(resource={"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 2]}, colocate=True, genrm_model_path="/j")
    assert str(info.value) == (
        "In colocated mode with genRM enabled, GPU allocation must satisfy one of:\n"
        " (1) split: --rollout-num-gpus + --genrm-num-gpus == actor total (8), or\n"
        " (2) shared: --rollout-num-gpus == --genrm-num-gpus == actor total (8).\n"
        "Got rollout=4, genrm=2, actor total=8"
    )


def test_fully_async_pools_checks_and_roles_without_effect(caplog):
    """The original's fully-async line names actor_fwd and advantages: accepted, with a
    notice once, and left out of the plan (no GPUs reserved); critic is refused."""
    import launcher.config.rules

    launcher.config.rules._noticed.clear()
    with caplog.at_level("WARNING", logger="relay.config"):
        for _ in range(2):
            p = plan(
                resource={
                    "actor": [1, 4],
                    "rollout": [1, 2],
                    "genrm": [1, 1],
                    "reference": [1, 1],
                    "advantages": [1, 0],
                    "actor_fwd": [1, 1],
                },
                fully_async=True,
                genrm_model_path="/j",
            )
    assert p.mode == "fully-async" and set(p.pools) == {"actor", "rollout", "genrm", "reference"}
    assert sum(len(pool.bundles) for pool in p.pools.values()) == 8
    notices = [r.getMessage() for r in caplog.records if "has no effect here" in r.getMessage()]
    assert sorted(notices) == [
        "--resource 'actor_fwd' has no effect here (the trainer computes the old log-probs itself): no GPUs are "
        "reserved for it",
        "--resource 'advantages' has no effect here (the controller computes GRPO advantages (a few numbers per "
        "group)): no GPUs are reserved for it",
    ]
    with pytest.raises(ConfigError, match="trains without a critic"):
        plan(resource={"actor": [1, 4], "rollout": [1, 2], "critic": [1, 2]}, fully_async=True)
    with pytest.raises(PlanError, match="cannot be combined with --colocate"):
        plan(resource={"actor": [1, 4], "rollout": [1, 4]}, fully_async=True, colocate=True)
    with pytest.raises(PlanError, match="Insufficient GPU resources"):
        plan(resource={"actor": [1, 8], "rollout": [1, 8]}, fully_async=True, nnodes=1)


def test_engines_stay_on_one_node_with_contiguous_gpus():
    with pytest.raises(PlanError, match="cross a node boundary"):
        plan(
            resource={"actor": [1, 8], "rollout": [1, 6], "genrm": [1, 2]},
            colocate=True,
            gpus_per_node=4,
            genrm_model_path="/j",
            rollout_num_gpus_per_engine=3,
        )
    p = plan(
        resource={"actor": [2, 4], "rollout": [1, 4], "genrm": [1, 4]},
        colocate=True,
        gpus_per_node=4,
        genrm_model_path="/j",
        rollout_num_gpus_per_engine=4,
        genrm_num_gpus_per_engine=4,
    )
    assert p.nnodes == 2 and {b.node for b in p.bundles_of(p.claims[2])} == {1}


def test_several_judges_are_laid_out_by_prefix_sums():
    p = plan(
        resource={"actor": [1, 8], "rollout": [1, 4], "genrm": [1, 4]},
        colocate=True,
        genrm_instances={"quality": {"model_path": "/q", "num_gpus": 2}, "safety": {"model_path": "/s", "num_gpus": 2}},
    )
    assert ranges(p) == {"actor": (0, 8), "rollout": (0, 4), "genrm[quality]": (4, 6), "genrm[safety]": (6, 8)}


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(ROOT, "torchrun_configs", "*.yaml"))), ids=os.path.basename
)
def test_every_shipped_config_is_accepted_by_relay_plan(path):
    sft = ["--sft"] if path.endswith("-sft.yaml") else []  # relay sft configs place the actor only
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "plan", "--config", path, *sft],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "layout:" in out.stdout and "bundle" in out.stdout


def test_relay_plan_exits_nonzero_with_the_error():
    out = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "plan", "--config", "tiny-cpu-split", "--rollout-num-gpus", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "Got rollout=3, genrm=2, actor total=4" in out.stderr


# ---------------------------------------------------------------- properties


@st.composite
def layouts(draw):
    gpn = draw(st.sampled_from([1, 2, 4, 8]))
    actor = draw(st.integers(1, 16))
    rollout = draw(st.integers(1, 16))
    genrm = draw(st.integers(0, 16))
    kw = dict(
        resource={"actor": [1, actor], "rollout": [1, rollout], **({"genrm": [1, genrm]} if genrm else {})},
        gpus_per_node=gpn,
        rollout_num_gpus_per_engine=draw(st.sampled_from([1, 2, 4])),
        sglang_mem_fraction_static=draw(st.sampled_from([0.3, 0.5, 0.7, 0.85])),
    )
    mode = draw(st.sampled_from(["colocate", "fully_async", "dedicated"]))
    if mode != "dedicated":
        kw[mode] = True
    if genrm:
        kw["genrm_model_path"] = "/j"
        kw["genrm_num_gpus_per_engine"] = draw(st.sampled_from([1, 2]))
        kw["genrm_engine_config"] = {"mem_fraction_static": draw(st.sampled_from([0.2, 0.3, 0.5]))}
        if draw(st.booleans()):
            kw.update(rm_type="dummy", defer_reward_to_post_process=True, custom_reward_post_process_path="m.f")
    return kw


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_accepted_plans_fit_do_not_overlap_and_respect_nodes(kw):
    try:
        p = make_plan(load_config(None, kw))
    except PlanError as e:
        # Rejections are for the documented reasons only.
        text = str(e)
        assert any(
            s in text
            for s in (
                "GPU allocation must satisfy one of",
                "rollout must use the actor's GPUs",
                "cross a node boundary",
                "cannot be split into engines",
                "must sum below 1.0",
                "needs GenRM to share",
                "Insufficient GPU resources",
            )
        ), text
        # ... and the original system's colocate rule is exactly what is enforced.
        if "GPU allocation must satisfy" in text:
            r, g, a = kw["resource"]["rollout"][1], kw["resource"].get("genrm", [0, 0])[1], kw["resource"]["actor"][1]
            assert not (r + g == a or r == g == a)
        return
    except ConfigError:
        return
    gpn = kw["gpus_per_node"]
    for c in p.claims:
        pool = p.pools[c.pool]
        assert 0 <= c.start <= c.stop <= len(pool.bundles)  # fits its pool
        if c.role not in ("actor", "critic", "advantages"):
            for engine in p.engines_of(c):
                assert len({b.node for b in engine}) == 1  # one node per engine
                assert [b.gpu for b in engine] == list(range(engine[0].gpu, engine[0].gpu + len(engine)))
    for b in (b for pool in p.pools.values() for b in pool.bundles):
        assert b.index < p.total_bundles and b.node == b.index // gpn
    # No overlap except rollout/genrm sharing in Shared, and the trainer under colocate.
    owners: dict[int, list[str]] = {}
    for c in p.claims:
        for b in p.bundles_of(c):
            owners.setdefault(b.index, []).append(c.role)
    for idx, roles in owners.items():
        others = [r for r in roles if r != "actor"] if p.mode.startswith("colocate") else roles
        if p.mode in ("colocate-shared", "colocate-defer"):
            assert set(others) <= {"genrm", "rollout"} and others.count("rollout") <= 1 and others.count("genrm") <= 1
        else:
            assert len(others) <= 1, (idx, roles)
    if p.mode == "colocate-split":
        r, g, a = kw["resource"]["rollout"][1], kw["resource"]["genrm"][1], kw["resource"]["actor"][1]
        assert r + g == a
