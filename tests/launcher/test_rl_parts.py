"""The RL loop's pure parts (launcher/rl/), without processes: advantages, sample
bookkeeping, scoring, the phase timer, the fully-async bound, checkpoints on disk."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from launcher.config import load_config
from launcher.data import Row
from launcher.rl.async_rollout import GroupProducer, is_stale, slot_bound
from launcher.rl.checkpoints import Checkpoints
from launcher.rl.judge import judge_deltas
from launcher.rl.sample import (
    Sample,
    Status,
    chunks,
    flatten,
    is_correct,
    rollout_metrics,
    shard_over_dp,
)
from launcher.rl.scoring import Scorer, advantages, check_judged, reward_metrics
from launcher.rl.timing import PhaseTimer, union_seconds

pytestmark = pytest.mark.unit


def make_sample(reward=None, finish_reason="stop", version=0, index=3, group_index=0, response="Answer: 4") -> Sample:
    result = SimpleNamespace(token_ids=[7, 8, 9], text=response, logprobs=[-0.1, -0.2, -0.3],
                             finish_reason=finish_reason, weight_version=version)
    sample = Sample.generated(Row(index, "What is 2+2?", "4", metadata={"source": "x"}), "train", group_index, [1, 2],
                              result)
    sample.reward = reward
    return sample


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------- advantages


def test_advantages_normalize_each_group_by_its_mean_and_unbiased_std():
    samples = [make_sample(r) for r in (1.0, 0.0, 1.0, 1.0)]
    adv = advantages(samples, group_size=2)
    # the original's torch.std is unbiased: std(1, 0) = 1/sqrt(2)
    assert adv[0] == pytest.approx(0.5 ** 0.5, abs=1e-5) and adv[1] == pytest.approx(-(0.5 ** 0.5), abs=1e-5)
    assert adv[2:] == [0.0, 0.0]  # equal rewards: no signal, no division by zero


def test_advantages_of_degenerate_and_incomplete_groups():
    assert advantages([make_sample(1.0), make_sample(0.0)], group_size=1) == [0.0, 0.0]
    with pytest.raises(ValueError, match="do not form complete groups of 2"):
        advantages([make_sample(1.0)] * 3, group_size=2)


def test_advantages_from_a_post_process_hook_are_used_as_given():
    samples = [make_sample(1.0), make_sample(0.0)]
    samples[0].advantage, samples[1].advantage = 0.25, -0.25
    assert advantages(samples, group_size=2) == [0.25, -0.25]


# ---------------------------------------------------------------------------- samples


def test_a_sample_reads_as_attributes_and_as_the_dict_reward_code_expects():
    s = make_sample()
    assert s.prompt == s["prompt"] == "What is 2+2?" and s["label"] == "4" and s.get("response") == "Answer: 4"
    assert s["metadata"] == {"source": "x", "label": "4", "question": "What is 2+2?"}  # the row's, and the judge's keys
    assert s["prompt_ids"] == [1, 2] and s["response_ids"] == [7, 8, 9] and s["rollout_logprobs"] == [-0.1, -0.2, -0.3]
    assert "reward_info" not in s and s.get("reward_info") is None and "reward" not in s  # unset until scored
    with pytest.raises(KeyError):
        s["reward"]
    s["reward_info"] = {"score": 1.0}  # what a post-process hook does
    assert s.reward_info == {"score": 1.0} and "reward_info" in s
    s["trajectory"] = ["step"]  # a key that is not a field is kept
    assert s["trajectory"] == ["step"] and s.extra == {"trajectory": ["step"]} and "trajectory" in s
    as_dict = dict(s)
    assert as_dict["label"] == "4" and as_dict["trajectory"] == ["step"] and "extra" not in as_dict
    # the original's attribute names
    assert s.tokens == [1, 2, 7, 8, 9] and s.response_length == 3 and s.rollout_log_probs == [-0.1, -0.2, -0.3]
    assert s.status == Sample.Status.COMPLETED and Sample.Status.TRUNCATED is Status.TRUNCATED
    s.reward = 0.5
    assert s.get_reward_value(SimpleNamespace(reward_key="score")) == 0.5
    assert "tokens" not in dict(s)  # derived names are not keys


def test_a_rows_metadata_object_is_the_samples_metadata_as_the_original_reads_it(tmp_path):
    """The original (slime's Dataset): ``sample.metadata`` is the row's ``metadata`` object
    (``--metadata-key``); the judge's ``question`` and ``label`` come from it when it has
    them, else from the prompt and the label."""
    import json

    from launcher.data import DataError, load_rows

    path = tmp_path / "rows.jsonl"
    rows = [{"prompt": "Solve: x + 1 = 3. Think step by step.", "label": "2", "source": "aime",
             "metadata": {"question": "x + 1 = 3", "trajectory_steps": [{"module": "planner"}]}},
            {"prompt": "What is 2+2?", "label": "4"},
            {"prompt": "p", "label": "1", "extra_info": {"question": "q", "label": "L"}}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    a, b, _ = load_rows(str(path))
    sa = Sample.generated(a, "train", 0, [1], SimpleNamespace(token_ids=[2], text="2", logprobs=[-0.1],
                                                                 finish_reason="stop", weight_version=0))
    assert sa.metadata == {"question": "x + 1 = 3", "label": "2", "source": "aime",
                           "trajectory_steps": [{"module": "planner"}]}
    assert "metadata" not in sa.metadata
    sb = Sample.generated(b, "train", 0, [1], SimpleNamespace(token_ids=[2], text="4", logprobs=[-0.1],
                                                                 finish_reason="stop", weight_version=0))
    assert sb.metadata == {"question": "What is 2+2?", "label": "4"}
    # another key, as verl's data carries it
    c = load_rows(str(path), metadata_key="extra_info")[2]
    assert c.metadata == {"question": "q", "label": "L"}
    path.write_text(json.dumps({"prompt": "p", "label": "1", "metadata": "not an object"}))
    with pytest.raises(DataError, match="rows.jsonl:1: 'metadata' must be an object"):
        load_rows(str(path))


def test_status_follows_the_engines_finish_reason():
    assert make_sample(finish_reason="stop").status is Status.COMPLETED
    assert make_sample(finish_reason="length").status is Status.TRUNCATED
    assert make_sample(finish_reason="abort").status is Status.ABORTED


def test_groups_chunks_and_dp_shards():
    assert chunks(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    assert flatten([[0, 1], [2]]) == [0, 1, 2]
    assert shard_over_dp(list(range(8)), 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shard_over_dp([0, 1, 2], 4) == [[0, 1, 2]] * 4  # fewer items than ranks: every rank takes all
    assert shard_over_dp([5], 1) == [[5]]


def test_accuracy_and_rollout_metrics():
    a, b, c = make_sample(1.0), make_sample(0.0, finish_reason="length", version=2), make_sample(0.5, version=1)
    c.reward_info = {"score": 0.5, "acc": False, "judge_response": "0", "format_error": None}
    b.reward_info = {"score": 0.0, "acc": True, "format_error": "judge_error"}
    assert [is_correct(s) for s in (a, b, c)] == [True, True, False]  # the reward's acc wins over reward > 0
    m = reward_metrics([a, b, c])
    assert m["reward/mean"] == pytest.approx(0.5) and m["reward/accuracy"] == pytest.approx(2 / 3)
    assert m["reward/format_errors"] == 1 and m["reward/judged"] == 1
    r = rollout_metrics([a, b, c], rollout_seconds=3.0)
    assert r == {"rollout/response_len": 3.0, "rollout/tokens_per_s": 3.0, "rollout/truncated": pytest.approx(1 / 3),
                 "rollout/min_weight_version": 0}


def test_a_batch_judged_wrong_everywhere_is_refused():
    failed = [make_sample(0.0) for _ in range(2)]
    for s in failed:
        s.reward_info = {"format_error": "judge_error"}
    with pytest.raises(RuntimeError, match="step 4: the judge failed on all 2 samples"):
        check_judged(failed, "step 4")
    failed[0].reward_info = {"format_error": None}
    check_judged(failed, "step 4")


# ---------------------------------------------------------------------------- scoring


def test_scorer_sets_reward_records_spans_and_names_a_failing_reward():
    cfg = load_config(None, {"custom_rm_path": "mine.reward", "reward_key": "score"})
    clock = FakeClock()
    timer = PhaseTimer(clock)

    async def reward(sample):
        clock.now += 2.0
        if sample.index == 9:
            raise ValueError("boom")
        return {"score": 1.0, "acc": True}

    scorer = Scorer(cfg, reward, None, timer)
    s = make_sample()
    asyncio.run(scorer.score(s))
    assert s.reward == 1.0 and s.reward_info == {"score": 1.0, "acc": True}
    with pytest.raises(RuntimeError, match=r"the reward \(--custom-rm-path mine.reward\) failed on the sample of row 9 "
                                           r"\(train data; question 'What is 2\+2\?', label '4'\): ValueError: boom"):
        asyncio.run(scorer.score(make_sample(index=9)))
    timer.end_step()
    assert timer.metrics()["time/reward"] == pytest.approx(4.0)


def test_a_nan_reward_or_a_rewards_eval_key_is_taken_as_the_original_takes_it():
    """A NaN (or infinite) reward stops scoring naming the reward, the sample and the value;
    ``--eval-reward-key`` picks an eval sample's reward from the reward's dict."""
    import math

    from launcher.rl.scoring import NonFiniteReward

    cfg = load_config(None, {"custom_rm_path": "mine.reward", "reward_key": "score", "eval_reward_key": "acc"})

    async def reward(sample):
        return {"score": math.nan if sample.index == 5 else 0.5, "acc": 1.0}

    scorer = Scorer(cfg, reward, None, PhaseTimer(FakeClock()))
    train, held_out = make_sample(), make_sample()
    held_out.dataset = "eval"
    asyncio.run(scorer.score(train))
    asyncio.run(scorer.score(held_out))
    assert (train.reward, held_out.reward) == (0.5, 1.0)
    with pytest.raises(NonFiniteReward, match=r"the reward \(--custom-rm-path mine.reward\) gave the sample of row 5 "
                                              r".* the reward nan: rewards must be finite"):
        asyncio.run(scorer.score(make_sample(index=5)))


def test_post_process_hook_sees_the_batchs_group_size_and_sets_advantages():
    cfg = load_config(None, {"n_samples_per_prompt": 8, "custom_reward_post_process_path": "mine.hook"})
    seen = {}

    async def hook(args, samples):
        seen["n"] = args.n_samples_per_prompt
        return [1.0] * len(samples), [0.5] * len(samples)

    samples = [make_sample(), make_sample()]
    asyncio.run(Scorer(cfg, None, hook, PhaseTimer()).score_batch(samples, group_size=2))
    assert seen["n"] == 2 and cfg.n_samples_per_prompt == 8
    assert [(s.reward, s.advantage) for s in samples] == [(1.0, 0.5), (1.0, 0.5)]


def test_dapo_genrm_reaches_the_judge_at_the_address_it_is_given(monkeypatch):
    import reward.client
    from reward.rewards import make_reward_fn

    monkeypatch.delenv("RELAY_GENRM_ADDR", raising=False)
    asked = []

    class Client:
        async def generate(self, messages, sampling_params=None, route_key=None):
            return "1"

        def report_parse(self, route_key, ok):
            pass

    monkeypatch.setattr(reward.client, "get_genrm_client", lambda address=None: asked.append(address) or Client())
    cfg = load_config(None, {"rm_type": "dapo-genrm", "genrm_parse": "loose"})
    result = asyncio.run(make_reward_fn(cfg, judge_address="ipc:///judge")(make_sample()))
    assert asked == ["ipc:///judge"] and result["score"] == 1.0


def test_judge_deltas_between_two_snapshots():
    before = {"requests": 10, "cache_hits": 2, "parse_failures": 1, "latency_sum": 1.0, "latency_count": 10,
              "engine_requests": 8, "graph_capture_s": 0.5}
    after = {"requests": 14, "cache_hits": 3, "parse_failures": 1, "latency_sum": 3.0, "latency_count": 14,
             "engine_requests": 11, "graph_capture_s": 0.75}
    d = judge_deltas(before, after)
    assert d["judge/requests"] == 4 and d["judge/cache_hits"] == 1 and d["judge/engine_calls"] == 3
    assert d["judge/latency_mean"] == pytest.approx(0.5) and d["judge/engine_requests"] == 3
    assert d["judge/graph_capture_s"] == pytest.approx(0.25)
    assert judge_deltas({}, {}) == {}


# ---------------------------------------------------------------------------- the phase timer


def test_union_of_overlapping_spans():
    assert union_seconds([]) == 0.0
    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == 4.0
    assert union_seconds([(0, 10), (2, 3)]) == 10.0


def test_phase_timer_adds_phases_and_leaves_the_rest_to_orchestration():
    clock = FakeClock()
    timer = PhaseTimer(clock, span_names=("reward",))
    timer.begin_step()
    with timer.phase("rollout"):
        clock.now += 3.0
    with timer.phase("swap"):
        clock.now += 1.0
    clock.now += 0.5  # between phases: orchestration
    with timer.phase("swap"):
        clock.now += 1.5
    assert timer.seconds("swap") == 2.5 and timer.seconds("train") == 0.0
    assert timer.end_step() == 6.0
    m = timer.metrics()
    assert m == {"time/rollout": 3.0, "time/swap": 2.5, "time/reward": 0.0, "time/step": 6.0,
                 "time/orchestration": pytest.approx(0.5)}
    timer.begin_step()
    assert timer.metrics()["time/step"] == 0.0  # forgotten after metrics()


def test_spans_are_a_union_and_a_phase_of_the_same_name_wins():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    timer.begin_step()
    first, second = timer.span("reward"), timer.span("reward")
    first.__enter__()
    clock.now += 1.0
    second.__enter__()  # overlaps the first
    clock.now += 1.0
    first.__exit__(None, None, None)
    clock.now += 1.0
    second.__exit__(None, None, None)
    timer.end_step()
    m = timer.metrics()
    assert m["time/reward"] == 3.0 and m["time/orchestration"] == 3.0  # spans are no phase
    timer.begin_step()
    with timer.span("reward"):
        clock.now += 5.0
    with timer.phase("reward"):
        clock.now += 1.0
    assert timer.metrics()["time/reward"] == 1.0


def test_spans_can_outlive_a_step_boundary():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    with timer.span("reward"):
        clock.now += 2.0
    timer.begin_step(keep_spans=True)
    assert timer.metrics()["time/reward"] == 2.0
    with timer.span("reward"):
        clock.now += 2.0
    timer.begin_step()
    assert "time/reward" not in timer.metrics()


def test_a_phase_is_timed_when_it_raises():
    clock = FakeClock()
    timer = PhaseTimer(clock)
    with pytest.raises(RuntimeError), timer.phase("train"):
        clock.now += 2.0
        raise RuntimeError
    assert timer.seconds("train") == 2.0


# ---------------------------------------------------------------------------- fully-async bound


def test_slot_bound_and_staleness():
    assert slot_bound(rollout_batch_size=4, max_staleness=1) == 8
    assert slot_bound(rollout_batch_size=4, max_staleness=0) == 4
    group = [make_sample(version=2), make_sample(version=3)]
    assert not is_stale(group, trainer_version=3, max_staleness=1)
    assert is_stale(group, trainer_version=4, max_staleness=1)
    assert not is_stale(group, trainer_version=2, max_staleness=0)


def test_group_producer_never_holds_more_slots_than_the_bound():
    async def main():
        started: list[int] = []

        async def make_group(k):
            started.append(k)
            await asyncio.sleep(0)
            return [make_sample(group_index=k)]

        producer = GroupProducer(make_group, first_group=6, bound=3)
        producer.start()
        taken = [await producer.next_group() for _ in range(3)]
        await asyncio.sleep(0.01)
        assert started == [6, 7, 8] and producer.in_flight == 3  # every slot held: nothing more starts
        assert producer.release(2) == 3 and producer.in_flight == 1
        producer.drop()
        assert producer.dropped == 1 and producer.in_flight_max == 1  # a drop does not restart the count
        taken += [await producer.next_group() for _ in range(3)]

        async def abort():
            pass

        unused = await producer.finish(abort, timeout=5)
        return started, taken, unused, producer.generated

    started, taken, unused, generated = asyncio.run(main())
    assert [g[0].group_index for g in taken] == started[:6] == [6, 7, 8, 9, 10, 11]
    assert generated == len(started) and unused == len(started) - 6


# ---------------------------------------------------------------------------- checkpoints


def test_only_complete_checkpoints_count_and_pruning_keeps_the_newest(tmp_path):
    ckpts = Checkpoints(str(tmp_path))
    for step in range(4):
        os.makedirs(ckpts.path(step))
        if step != 3:
            ckpts.mark_complete(ckpts.path(step), step + 1, step + 1)
    assert ckpts.latest() == ckpts.path(2)
    ckpts.prune(keep=2)
    assert [os.path.basename(p) for p in ckpts.complete()] == ["step_000001", "step_000002"]
    assert not os.path.exists(ckpts.path(0)) and os.path.exists(ckpts.path(3))  # incomplete ones are left alone


# ---------------------------------------------------------------------------- fault tolerance


def test_with_fault_tolerance_samples_the_judge_failed_are_scored_again_until_judged(monkeypatch):
    """A batch is trained only when fully judged: a sample whose judge call failed is scored
    again (backoff) until the judge answers; without fault tolerance it keeps its failure."""
    import launcher.rl.scoring as scoring

    monkeypatch.setattr(scoring, "JUDGE_AGAIN_AFTER", 0.01)
    calls: dict[int, int] = {}

    async def reward(sample):  # the judge is down for each sample's first two calls
        calls[sample.index] = calls.get(sample.index, 0) + 1
        if calls[sample.index] <= 2:
            return {"score": 0.0, "format_error": "judge_error"}
        return {"score": 1.0, "judge_response": "1"}

    for fault_tolerant, expected in ((True, [1.0, 1.0]), (False, [0.0, 0.0])):
        calls.clear()
        cfg = load_config(None, {"reward_key": "score", "use_fault_tolerance": fault_tolerant})
        samples = [make_sample(index=i) for i in (1, 2)]
        asyncio.run(Scorer(cfg, reward, None, PhaseTimer()).score_all(samples))
        assert [s.reward for s in samples] == expected
        assert calls == ({1: 3, 2: 3} if fault_tolerant else {1: 1, 2: 1})


class _Call:
    def __init__(self, outcome):
        self.outcome = outcome

    async def result(self, timeout):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


def _engine(outcome, fault_tolerant: bool, bundle: int = 1):
    from launcher.rl.engine_pool import PooledEngine

    mesh = SimpleNamespace(stats=SimpleNamespace(call_one=lambda: _Call(outcome)))
    return PooledEngine("rollout", "", mesh, 0, bundle, fault_tolerant)


def test_calls_to_engines_leave_out_a_dead_one_only_with_fault_tolerance():
    from launcher.rl.engine_pool import call_engines
    from relay import MeshFailure, SupervisionError

    dead = SupervisionError(MeshFailure("m", "p", 0, "signal", "was killed by signal SIGKILL"))
    alive, gone = _engine({"weight_version": 3}, True), _engine(dead, True)
    assert asyncio.run(call_engines([alive, gone], "stats")) == [{"weight_version": 3}]
    assert gone.down is not None and "its process is gone" in gone.down and not gone.back.is_set()
    assert asyncio.run(call_engines([alive, gone], "stats")) == [{"weight_version": 3}]  # no longer called
    gone.replaced(SimpleNamespace(stats=SimpleNamespace(call_one=lambda: _Call({"weight_version": 3}))))
    assert gone.down is None and gone.back.is_set()
    with pytest.raises(SupervisionError):
        asyncio.run(call_engines([_engine(dead, False)], "stats"))
    with pytest.raises(ValueError):  # an engine's own error is never taken for a death
        asyncio.run(call_engines([_engine(ValueError("bad"), True)], "stats"))


def test_only_a_dead_engine_only_worker_is_rebuilt_and_only_with_fault_tolerance():
    """Tiny dedicated layout: the trainer on bundle 0, rollout on 1-2, the judge on 3."""
    from launcher.allocator import make_plan
    from launcher.rl.recovery import EngineRecovery
    from relay import MeshFailure

    started: list[tuple[int, int]] = []

    async def respawn(node, bundle):
        started.append((node, bundle))
        await asyncio.Event().wait()  # never comes back: close() cancels it

    async def main(fault_tolerant: bool, bundle: int) -> tuple[bool, list]:
        cfg = load_config("tiny-cpu-async", {"fully_async": False, "use_fault_tolerance": fault_tolerant,
                                             "resource": {"actor": [1, 1], "rollout": [1, 2], "genrm": [1, 1]}})
        plan = make_plan(cfg)
        engines = [_engine({}, fault_tolerant, b) for b in (1, 2, 3)]
        recovery = EngineRecovery(cfg, plan, engines, None, respawn, None, out=open(os.devnull, "w"))
        taken = recovery.worker_died(0, bundle, MeshFailure("m", "p", 0, "signal", "was killed by signal SIGKILL"))
        await asyncio.sleep(0)
        await recovery.close()
        return taken, [e.down is not None for e in engines]

    assert asyncio.run(main(True, 2)) == (True, [False, True, False])
    assert asyncio.run(main(True, 3)) == (True, [False, False, True])
    assert started == [(0, 2), (0, 3)]
    assert asyncio.run(main(True, 0)) == (False, [False, False, False])  # the trainer's: the job restarts
    assert asyncio.run(main(False, 2)) == (False, [False, False, False])
    assert started == [(0, 2), (0, 3)]


HOOK_CALLS: list = []


def sync_hook(args, samples):
    """A sync post-process hook (the original calls its hook synchronously)."""
    HOOK_CALLS.append([s.reward for s in samples])
    return [s.reward * 10 for s in samples], [0.5, -0.5] * (len(samples) // 2)


def test_the_post_process_hook_runs_on_every_training_batch_outside_defer_swap():
    """As the original's post_process_rewards: with --custom-reward-post-process-path the
    hook gives the rewards and advantages of each training batch after it was scored inline;
    in Defer-swap (no inline scoring) the batch is left to the deferred scoring."""
    from launcher.rl.loop import GRPOLoop
    from reward.rewards import load_post_process

    cfg = load_config(None, {"n_samples_per_prompt": 2, "rollout_batch_size": 2,
                             "custom_reward_post_process_path": "tests.launcher.test_rl_parts.sync_hook"})

    async def group(row, size, sampling, seed, group_index, score, dataset="train"):
        return [make_sample(reward=float(score), index=row, group_index=group_index) for _ in range(size)]

    loop = GRPOLoop.__new__(GRPOLoop)  # only what _generate_batch uses
    loop.cfg, loop.group = cfg, group
    loop.order = SimpleNamespace(batch=lambda step, n: list(range(n)))
    loop.scorer = Scorer(cfg, None, load_post_process(cfg), PhaseTimer())
    HOOK_CALLS.clear()
    samples = asyncio.run(loop._generate_batch(0, score_inline=True))
    assert HOOK_CALLS == [[1.0] * 4]  # one call, on the whole batch, after inline scoring
    assert [s.reward for s in samples] == [10.0] * 4 and [s.advantage for s in samples] == [0.5, -0.5] * 2
    deferred = asyncio.run(loop._generate_batch(0, score_inline=False))
    assert len(HOOK_CALLS) == 1 and all(s.advantage is None for s in deferred)


@pytest.mark.unit
def test_relay_sft_tokenizes_each_row_once_and_encodes_the_next_batch_on_its_own_thread(tmp_path):
    """relay sft's rows come back every epoch and every evaluation: each is tokenized once
    (by the one thread that tokenizes), and a batch's DP shards are what encoding its rows
    one by one gives."""
    import json
    import threading

    from launcher.config import build_config
    from launcher.sft import SFTJob

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n" for i in range(5)))
    cfg = build_config({"hf_checkpoint": str(tmp_path), "prompt_data": str(data), "apply_chat_template": False})
    job = SFTJob(cfg, plan=None, workers=[], out=None)
    calls, threads = [], set()

    class Tokenizer:  # characters as ids
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=True):
            calls.append(text)
            threads.add(threading.current_thread().name)
            return {"input_ids": [ord(c) for c in text]}

        def encode(self, text, add_special_tokens=True):
            return self(text, add_special_tokens)["input_ids"]

    job.tokenizer, job.trainer = Tokenizer(), SimpleNamespace(dp=2)

    async def main():
        first = await job._encode_ahead(job.rows[:4])
        again = await job._encode_ahead(job.rows)  # rows 0-3 again, and row 4
        return first, again

    first, again = asyncio.run(main())
    job._encoder.shutdown()
    assert sorted(calls) == sorted([f"q{i}" for i in range(5)] + [f"a{i}" for i in range(5)])  # once each
    assert threads == {n for n in threads if n.startswith("sft-encode")}
    ids = {i: [ord(c) for c in f"q{i}a{i}"] + [0] for i in range(5)}
    assert first == [([ids[0], ids[2]], [[0, 1, 1, 1]] * 2), ([ids[1], ids[3]], [[0, 1, 1, 1]] * 2)]
    assert again[0][0] == [ids[0], ids[2], ids[4]] and again[1][0] == [ids[1], ids[3]]
