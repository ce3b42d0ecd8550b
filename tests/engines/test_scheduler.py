"""The built-in engine's scheduler and KV block bookkeeping, without a model: requests are
planned, fed made-up tokens and finished by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.builtin.block_manager import BlockManager
from engines.builtin.scheduler import Scheduler, StepPlan
from engines.builtin.sequence import Sequence
from engines.interface import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TOKEN = 7  # every made-up sampled token


def scheduler(*, block_size=4, num_blocks=16, max_running=8, max_prefill_tokens=10_000, share_prefix=True):
    blocks = BlockManager(block_size, max_running)
    blocks.resize(num_blocks, max_tokens=100_000)
    return Scheduler(blocks, max_running=max_running, max_prefill_tokens=max_prefill_tokens, share_prefix=share_prefix)


def request(rid: int, n: int, *, max_new: int = 1000, first: int | None = None) -> Sequence:
    """Request ``rid`` with an ``n``-token prompt (distinct per request unless ``first`` is
    given: requests with the same ``first`` and ``n`` have identical prompts)."""
    start = rid * 1000 if first is None else first
    return Sequence(
        rid, list(range(start, start + n)), SamplingParams(temperature=0, max_new_tokens=max_new), None, None, None
    )


def ends_at_max_new(seq: Sequence, token: int) -> bool:
    if len(seq.output) >= seq.sampling.max_new_tokens:
        seq.finish_reason = "length"
        return True
    return False


def step(s: Scheduler) -> tuple[StepPlan, list[Sequence]]:
    """One step with made-up tokens; the plan and every request finished in it."""
    plan = s.schedule()
    finished = s.postprocess(plan.batch, [TOKEN] * len(plan.batch), [-0.5] * len(plan.batch), ends_at_max_new)
    return plan, plan.finished + finished


def ids(seqs) -> list[int]:
    return [s.request_id for s in seqs]


def check_bookkeeping(s: Scheduler) -> None:
    """Each block is free exactly when no running request holds it, its count is its number
    of holders, and every running request holds a row of its own."""
    b = s.blocks
    held = [blk for seq in s.running for blk in seq.blocks]
    assert len(b.free_blocks) == len(set(b.free_blocks)), "a block was freed twice"
    assert all(r >= 0 for r in b.refs), "a negative reference count"
    for blk in range(b.num_blocks):
        assert b.refs[blk] == held.count(blk), blk
        assert (blk in b.free_blocks) == (b.refs[blk] == 0), blk
    rows = [seq.table_row for seq in s.running]
    assert -1 not in rows and len(set(rows)) == len(rows) and not set(rows) & set(b.free_rows)
    assert len(rows) + len(b.free_rows) == b.max_rows
    for seq in s.running:
        assert b.host_tables[seq.table_row, : len(seq.blocks)].tolist() == seq.blocks
        assert len(seq.blocks) * b.block_size >= seq.cached_tokens
    assert all(not seq.blocks and seq.table_row == -1 for seq in s.waiting)


def test_waiting_requests_are_admitted_in_arrival_order_and_prefilled_together():
    s = scheduler()
    for rid, n in enumerate((3, 9, 5)):
        s.add(request(rid, n))
    plan, _ = step(s)
    assert ids(plan.admitted) == ids(plan.prefill) == ids(s.running) == [0, 1, 2]
    assert plan.decode == [] and plan.followers == {}
    plan, _ = step(s)
    assert ids(plan.decode) == [0, 1, 2] and plan.admitted == []
    check_bookkeeping(s)


def test_a_request_that_does_not_fit_holds_back_the_ones_behind_it():
    s = scheduler(num_blocks=8)  # 32 tokens
    s.add(request(0, 20))  # 5 blocks
    s.add(request(1, 16))  # 4 blocks: only 3 left
    s.add(request(2, 4))  # 1 block would fit, but waits its turn
    plan, _ = step(s)
    assert ids(plan.admitted) == [0] and ids(s.waiting) == [1, 2]
    check_bookkeeping(s)


def test_the_prefill_budget_spreads_a_burst_over_steps_but_always_admits_one_prompt():
    s = scheduler(max_prefill_tokens=10)  # padded prefill: prompts x longest
    for rid in range(4):
        s.add(request(rid, 4))
    first, _ = step(s)
    second, _ = step(s)
    assert ids(first.prefill) == [0, 1] and ids(second.decode) == [0, 1] and ids(second.prefill) == [2, 3]
    s.add(request(4, 30))  # longer than the budget alone
    third, _ = step(s)
    assert ids(third.prefill) == [4]
    check_bookkeeping(s)


def test_no_more_than_max_running_requests_run_at_once():
    s = scheduler(max_running=2)
    for rid in range(3):
        s.add(request(rid, 3, max_new=2))
    plan, _ = step(s)
    assert ids(plan.admitted) == [0, 1] and ids(s.waiting) == [2]
    plan, done = step(s)  # 0 and 1 reach max_new and leave: 2 is admitted in the next step
    assert ids(done) == [0, 1] and plan.admitted == []
    plan, _ = step(s)
    assert ids(plan.admitted) == [2] and ids(s.running) == [2]
    check_bookkeeping(s)


def test_when_decode_runs_out_of_blocks_the_newest_request_is_preempted_to_the_front_and_recomputed():
    s = scheduler(num_blocks=4)
    s.add(request(0, 4, max_new=3))
    s.add(request(1, 4, max_new=3))
    s.add(request(2, 8))
    step(s)  # all four blocks taken; each request now needs a fifth slot
    s.add(request(3, 2))
    plan, _ = step(s)
    newest = s.waiting[0]
    assert ids(plan.decode) == [0, 1] and ids(s.waiting) == [2, 3]  # requeued ahead of later arrivals
    assert newest.blocks == [] and newest.table_row == -1 and newest.cached_tokens == 0
    assert newest.output == [TOKEN]  # kept: recomputed from prompt and output so far
    check_bookkeeping(s)
    plan, done = step(s)  # still no room for it; 0 and 1 finish, freeing their blocks
    assert ids(plan.decode) == [0, 1] and plan.admitted == [] and ids(done) == [0, 1]
    plan, _ = step(s)
    assert ids(plan.prefill) == [2, 3] and newest.cached_tokens == 9 and len(newest.blocks) == 3
    check_bookkeeping(s)


def test_the_newest_request_gives_way_even_when_it_is_the_one_that_needs_a_block():
    s = scheduler(num_blocks=3)
    s.add(request(0, 6))  # 2 blocks, room for 2 more tokens
    s.add(request(1, 4))  # 1 block, full
    step(s)
    plan, _ = step(s)
    assert ids(plan.decode) == [0] and ids(s.waiting) == [1]
    check_bookkeeping(s)


def test_identical_prompts_admitted_together_share_full_blocks_and_copy_the_partial_one():
    s = scheduler()
    for rid in range(3):
        s.add(request(rid, 10, first=500))  # 2 full blocks and 2 tokens
    s.add(request(3, 10))
    plan, _ = step(s)
    leader, *followers = plan.admitted[:3]
    assert ids(plan.prefill) == [0, 3] and plan.followers == {1: 0, 2: 0}
    for f in followers:
        assert f.blocks[:2] == leader.blocks[:2] and f.blocks[2] != leader.blocks[2]
    assert [s.blocks.refs[b] for b in leader.blocks] == [3, 3, 1]
    assert len({f.blocks[2] for f in followers}) == 2
    check_bookkeeping(s)


def test_followers_of_a_prompt_of_whole_blocks_take_their_own_block_at_the_first_decode():
    s = scheduler()
    for rid in range(2):
        s.add(request(rid, 8, first=500))
    plan, _ = step(s)
    a, b = plan.admitted
    assert a.blocks == b.blocks and [s.blocks.refs[x] for x in a.blocks] == [2, 2]
    step(s)
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    check_bookkeeping(s)


def test_without_prefix_sharing_or_across_steps_identical_prompts_are_prefilled_each():
    s = scheduler(share_prefix=False)
    s.add(request(0, 6, first=500))
    s.add(request(1, 6, first=500))
    plan, _ = step(s)
    assert ids(plan.prefill) == [0, 1] and plan.followers == {}
    s = scheduler()
    s.add(request(0, 6, first=500))
    step(s)
    s.add(request(1, 6, first=500))
    plan, _ = step(s)
    assert ids(plan.prefill) == [1] and not set(plan.prefill[0].blocks) & set(s.running[0].blocks)
    check_bookkeeping(s)


def test_a_shared_block_is_freed_only_by_its_last_holder():
    s = scheduler(num_blocks=8)
    for rid in range(3):
        s.add(request(rid, 8, first=500, max_new=1 + rid))
    plan, _ = step(s)  # request 0 finishes at once
    shared = plan.admitted[1].blocks[:2]
    assert [s.blocks.refs[b] for b in shared] == [2, 2] and not set(shared) & set(s.blocks.free_blocks)
    step(s)
    assert [s.blocks.refs[b] for b in shared] == [1, 1]
    step(s)
    assert s.running == [] and sorted(s.blocks.free_blocks) == list(range(8)) and set(s.blocks.refs) == {0}


def test_aborted_requests_finish_with_reason_abort_whether_waiting_or_running():
    s = scheduler(max_running=1)
    for rid in range(3):
        s.add(request(rid, 5))
    step(s)
    s.request_abort(0)
    s.request_abort(2)
    plan, done = step(s)
    assert ids(plan.finished) == [2, 0] and {q.finish_reason for q in plan.finished} == {"abort"}
    assert ids(plan.admitted) == [1] and ids(s.running) == [1] and not s.waiting
    assert all(q.blocks == [] and q.table_row == -1 for q in plan.finished)
    check_bookkeeping(s)


def test_abort_all_before_a_request_id_spares_later_arrivals():
    s = scheduler(max_running=2)
    for rid in range(3):
        s.add(request(rid, 5))
    step(s)
    s.request_abort(before=3)
    s.add(request(3, 5))
    aborted = s.apply_aborts()  # as while paused: no step runs
    assert ids(aborted) == [2, 0, 1] and ids(s.waiting) == [3] and s.running == []
    assert sorted(s.blocks.free_blocks) == list(range(16))


def test_a_reset_after_a_failed_step_returns_every_block_and_row_and_runs_its_requests_apart():
    s = scheduler(num_blocks=6, max_running=2)
    for rid in range(2):
        s.add(request(rid, 9, first=500, max_new=3))
    s.add(request(2, 3))
    step(s)
    assert s.reset_after_failure() == []  # a first failure blames no one
    assert s.running == [] and ids(s.waiting) == [0, 1, 2]  # recomputed like preempted requests, first in line
    b = s.blocks
    assert sorted(b.free_blocks) == list(range(6)) and b.refs == [0] * 6
    assert sorted(b.free_rows) == [0, 1] and set(b.host_tables.flatten().tolist()) == {b.scratch_block}
    assert s.waiting[0].cohort != s.waiting[1].cohort and 0 not in (s.waiting[0].cohort, s.waiting[1].cohort)
    batches = []
    for _ in range(8):  # each cohort in turn: the two suspects apart, the arrival in cohort 0 once a row is free
        plan, _ = step(s)
        batches.append(tuple(ids(plan.batch)))
        check_bookkeeping(s)
    assert batches[:2] == [(0,), (1,)] and (2,) in batches and set(batches) <= {(), (0,), (1,), (2,)}
    assert not s.quarantined() and [seq.finish_reason for seq in s.running] == [None]  # 0 and 1 finished


def test_a_request_that_fails_a_step_alone_after_failing_one_before_is_the_culprit():
    s = scheduler()
    s.add(request(0, 5))
    s.add(request(1, 6))
    step(s)
    assert s.reset_after_failure() == []  # cohorts {0}, {1}
    assert ids(step(s)[0].batch) == [0]
    culprits = s.reset_after_failure()  # alone, after failing a step before: its own fault
    assert ids(culprits) == [0] and ids(s.running) + ids(s.waiting) == [1]
    check_bookkeeping(s)
    assert ids(step(s)[0].batch) == [1]
    # a request alone from the start is given a second chance (the first failure may be the engine's)
    s = scheduler()
    s.add(request(7, 5))
    step(s)
    assert s.reset_after_failure() == [] and ids(step(s)[0].batch) == [7]
    assert ids(s.reset_after_failure()) == [7] and not s.has_work()


def test_cohorts_end_with_their_requests_and_steps_batch_together_again():
    s = scheduler(num_blocks=40, max_running=8)
    for rid in range(4):
        s.add(request(rid, 3, max_new=3))
    step(s)
    s.reset_after_failure()  # 4 suspects: cohorts {0, 1} and {2, 3}
    for rid in range(4, 6):
        s.add(request(rid, 3, max_new=50))
    seen = set()
    for _ in range(12):
        plan, _ = step(s)
        cohorts = {seq.cohort for seq in plan.batch}
        assert len(cohorts) <= 1, "a step mixes cohorts"
        seen |= {tuple(ids(plan.batch))}
    assert {(0, 1), (2, 3), (4, 5)} <= seen
    assert not s.quarantined()  # the suspects finished: the newcomers batch as before
    assert ids(step(s)[0].batch) == [4, 5]


def test_dropping_every_request_frees_what_they_held():
    s = scheduler(max_running=1)
    for rid in range(3):
        s.add(request(rid, 5))
    step(s)
    s.add(request(3, 2))
    assert ids(s.drop_all()) == [0, 1, 2, 3]
    assert not s.has_work() and sorted(s.blocks.free_blocks) == list(range(16))


def test_a_released_cache_hands_out_nothing_and_a_reset_does_not_bring_it_back():
    blocks = BlockManager(4, 2)
    blocks.resize(5, max_tokens=12)
    assert blocks.max_blocks_per_seq == 3 and blocks.host_tables.shape == (3, 3) and blocks.scratch_block == 5
    blocks.release()
    blocks.reset()
    assert blocks.free_blocks == []
    blocks.resize(7, max_tokens=100)
    assert sorted(blocks.free_blocks) == list(range(7)) and blocks.max_blocks_per_seq == 7


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 14), st.integers(0, 2), st.integers(1, 6)),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("abort_all")),
        st.tuples(st.just("fail")),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(OPS, st.booleans())
def test_blocks_are_never_lost_double_freed_or_negatively_counted(ops, share):
    """Random arrivals (a few prompts repeat, to share blocks), steps, aborts and failed
    steps (their requests quarantined) over a small cache: the bookkeeping stays exact, no
    request is lost, and once everything is aborted every block and row is free."""
    s = scheduler(num_blocks=10, max_running=4, max_prefill_tokens=24, share_prefix=share)
    rid, sent, culprits = 0, [], []
    for op in ops:
        if op[0] == "add":
            _, n, prompt, max_new = op
            sent.append(request(rid, n, first=100 * prompt, max_new=max_new))
            s.add(sent[-1])
            rid += 1
        elif op[0] == "step":
            step(s)
        elif op[0] == "abort":
            s.request_abort(op[1])
        elif op[0] == "abort_all":
            s.request_abort(before=rid)
        else:
            culprits += s.reset_after_failure()
        check_bookkeeping(s)
    s.request_abort(before=rid)
    step(s)
    assert not s.has_work()
    assert all(seq.finish_reason is not None or seq in culprits for seq in sent), "a request was lost"
    assert all(seq.step_failures >= 2 for seq in culprits)
    assert sorted(s.blocks.free_blocks) == list(range(10)) and set(s.blocks.refs) == {0}
    assert sorted(s.blocks.free_rows) == list(range(4))
