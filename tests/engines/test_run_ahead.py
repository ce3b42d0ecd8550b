"""Decode steps launched before the last step's tokens are read (TorchEngine ``run_ahead``,
the default on CUDA; forced on here, on CPU) give what step-by-step decoding gives: the same
tokens, finish reasons and texts, log-probs to float32 rounding (a CPU matmul's rounding
depends on the batch a row is in), for requests that end at different steps
(length, stop token, stop string), seeded sampling, min_p, block boundaries crossed while
running ahead, KV pressure that makes the run ahead give way and preemption happen,
penalized requests (never run ahead) and a hybrid model (whose recurrent state a void row
must not corrupt)."""

from __future__ import annotations

import asyncio

import pytest

from engines.builtin import TorchEngine
from engines.models.model_builder import make_model
from tests.engines.test_qwen35 import hybrid_model
from tests.helpers import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _prompts():
    return [[5 + (i * 7 + n) % 90 for i in range(n)] for n in (3, 5, 9, 12, 17, 23, 30, 41)]


async def _generate(path: str, requests: list, run_ahead: bool, **engine) -> tuple[list, dict]:
    eng = TorchEngine(path, run_ahead=run_ahead, **engine)
    try:
        res = await asyncio.gather(*(eng.generate(p, s) for p, s in requests))
        stats = await eng.stats()
    finally:
        await eng.close()
    return [(r.token_ids, r.logprobs, r.finish_reason, r.text) for r in res], stats


def _both(path: str, requests: list, **engine) -> tuple[list, dict, list, dict]:
    async def main():
        return (*await _generate(path, requests, True, **engine), *await _generate(path, requests, False, **engine))

    return run(main(), 240)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("m") / "llama"), seed=1)


def _mixed_requests(path: str) -> list:
    """Requests that end at different steps, found from a step-by-step run of seeded ones."""
    seeded = [{"temperature": 0.9, "seed": 100 + i, "max_new_tokens": 24, "ignore_eos": True} for i in range(8)]
    probe, _ = run(_generate(path, list(zip(_prompts(), seeded)), False, kv_cache_tokens=4096), 120)
    stop_tok = probe[1][0][6]  # the 7th token of request 1: it stops there (or at an earlier copy)
    stop_text = probe[2][3][-3:] if len(probe[2][3]) >= 3 else probe[2][3]
    sampling = [
        {"temperature": 0, "max_new_tokens": 1, "ignore_eos": True},
        {**seeded[1], "stop_token_ids": [stop_tok]},
        {**seeded[2], "stop": [stop_text]} if stop_text else seeded[2],
        {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True},
        {**seeded[4], "min_p": 0.2},
        {"temperature": 0.7, "max_new_tokens": 19, "ignore_eos": True, "seed": 7},
        {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True},
        seeded[7],
    ]
    return list(zip(_prompts(), sampling))


def _same_up_to_rounding(ahead: list, plain: list) -> None:
    """Tokens, finish reasons and texts equal; log-probs equal to float32 rounding. A request
    decodes beside other rows when running ahead (those of requests that ended, void for a few
    steps) than step by step, and on CPU a matmul's rounding depends on its batch: on an
    AVX-512 Xeon, ``F.linear`` gives one row different last bits at 1, 2 and 3+ rows."""
    assert [(r[0], r[2], r[3]) for r in ahead] == [(r[0], r[2], r[3]) for r in plain]
    assert [len(r[1]) for r in ahead] == [len(r[1]) for r in plain]
    assert max(abs(x - y) for a, b in zip(ahead, plain) for x, y in zip(a[1], b[1])) < 1e-5


def test_run_ahead_equals_step_by_step_decoding(llama):
    requests = _mixed_requests(llama)
    ahead, stats, plain, plain_stats = _both(llama, requests, kv_cache_tokens=4096, block_size=4)
    _same_up_to_rounding(ahead, plain)
    assert [r[2] for r in ahead][:4] == ["length", "stop", "stop", "length"]
    assert len(ahead[0][0]) == 1 and len(ahead[1][0]) < 24
    assert stats["steps_run_ahead"] > 10 and plain_stats["steps_run_ahead"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["running"] == 0


def test_run_ahead_gives_way_under_kv_pressure(llama):
    """A cache of 40 blocks of 4 tokens for 8 requests of up to 71 tokens: running ahead
    stops when no block is free for the next slots, requests are preempted and recomputed,
    and the tokens still equal step-by-step decoding's (log-probs to rounding)."""
    greedy = [(p, {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}) for p in _prompts()]
    ahead, stats, plain, _ = _both(llama, greedy, kv_cache_tokens=160, block_size=4)
    # a preempted request is readmitted a few steps later when running ahead: other batches too
    _same_up_to_rounding(ahead, plain)
    assert stats["steps_run_ahead"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["prefill_tokens"] > sum(len(p) for p in _prompts())  # preempted requests were prefilled again


def test_penalized_requests_never_run_ahead(llama):
    """A penalty counts the tokens the host has appended, so a batch with one never runs ahead."""
    reqs = [(p, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True, "repetition_penalty": 1.3})
            for p in _prompts()[:4]]
    ahead, stats, plain, _ = _both(llama, reqs, kv_cache_tokens=4096)
    assert ahead == plain and stats["steps_run_ahead"] == 0


def test_a_hybrid_model_runs_ahead_with_its_recurrent_state_intact(tmp_path):
    """qwen3_5_moe: rows of requests that ended are void but still advance their state row;
    the live rows' states (and so their tokens) are those of step-by-step decoding."""
    path = hybrid_model(str(tmp_path / "h"), 3)
    reqs = [(p, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
            for p, n in zip(_prompts()[:5], (1, 3, 8, 14, 20))]
    reqs += [(_prompts()[5], {"temperature": 0.8, "seed": 3, "max_new_tokens": 16, "ignore_eos": True})]
    ahead, stats, plain, _ = _both(path, reqs, kv_cache_tokens=2048, block_size=8)
    assert ahead == plain and stats["steps_run_ahead"] > 0


def test_a_steps_tokens_reach_the_host_through_a_contiguous_view_of_the_pinned_buffer(monkeypatch):
    """A batch smaller than the host buffer reads back into a contiguous view of it: a copy into
    a strided host view would go through a pageable temporary, and a device->pageable copy
    waits for every queued step (it had made running ahead wait each step below 256 rows)."""
    import types

    import torch

    from engines.builtin.sampler import Sampled, Sampler

    # no CUDA here: the copy's completion event is a stand-in (the copy itself is synchronous on CPU)
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda: None,
                                                                           synchronize=lambda: None))
    sampler = Sampler(None, set())
    buffers = [torch.empty(2 * 256, dtype=torch.float64) for _ in range(2)]
    sampler._pinned = buffers  # what _pinned_buffer allocates (pinned on CUDA)
    for rows in (1, 3, 256):
        buf = sampler._pinned[sampler._turn ^ 1]
        tok, lp = torch.arange(rows), -torch.rand(rows)
        s = Sampled(torch.stack((tok.double(), lp.double()), dim=1), buf, tok)
        assert s.host.is_contiguous() and s.host.data_ptr() == buf.data_ptr()
        toks, lps = s.read()
        assert toks == list(range(rows)) and lps == lp.double().tolist()
        sampler._turn ^= 1


def test_long_chains_run_ahead_and_a_finished_request_is_reported_within_a_few_steps(llama):
    """While nothing finishes, one scheduled step runs up to RUN_AHEAD decode steps ahead (the
    pipeline drains only between scheduled steps); once a request finished, the chain stops
    within REPORT_WITHIN steps, so its caller hears soon."""
    from engines.builtin import stepper as stepper_module

    seen = {"calls": 0, "long_at_report": None}

    async def main():
        eng = TorchEngine(llama, run_ahead=True, kv_cache_tokens=4096)
        step = eng.stepper.step

        def counted():
            done = step()
            seen["calls"] += 1
            if any(len(s.output) == 3 for s in done) and seen["long_at_report"] is None:
                seen["long_at_report"] = max(len(s.output) for s in eng.stepper.scheduler.running)
            return done

        eng.stepper.step = counted
        try:
            return await asyncio.gather(
                eng.generate(_prompts()[0], {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}),
                eng.generate(_prompts()[0], {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}))
        finally:
            await eng.close()

    short, long = run(main(), 120)
    assert len(short.token_ids) == 3 and len(long.token_ids) == 200
    assert seen["long_at_report"] is not None
    assert seen["long_at_report"] <= 3 + stepper_module.REPORT_WITHIN + 1, seen
    assert seen["calls"] <= 8, seen  # chains of 8 took one scheduled step per 9 tokens (24 here)


def test_requests_left_waiting_by_the_prefill_budget_are_admitted_before_running_ahead(llama):
    """Prompts that a step's prefill budget (``max_prefill_tokens``) admits one at a time all
    run together: a chain of decode steps run ahead gives way to a waiting request that could
    be admitted (before, each request's whole generation ran ahead before the next one's
    prefill, so long prompts decoded a few rows at a time, one group after another)."""
    prompts = [[5 + (i * 3 + r) % 90 for i in range(40)] for r in range(4)]
    seen = {"most_running": 0, "first_output_then": None}

    async def main():
        eng = TorchEngine(llama, run_ahead=True, kv_cache_tokens=4096, max_prefill_tokens=64)
        decode = eng.runner.decode

        def watched(seqs, *args, **kwargs):  # every decode step, scheduled or run ahead
            if len(seqs) > seen["most_running"]:
                seen["most_running"] = len(seqs)
                seen["first_output_then"] = max(len(s.output) for s in seqs)
            return decode(seqs, *args, **kwargs)

        eng.runner.decode = watched
        try:
            res = await asyncio.gather(*(eng.generate(p, {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
                                         for p in prompts))
            return res, await eng.stats()
        finally:
            await eng.close()

    res, stats = run(main(), 120)
    assert [len(r.token_ids) for r in res] == [40] * 4
    assert seen["most_running"] == 4, seen  # the four decode together
    assert seen["first_output_then"] <= 4, seen  # admitted a step apart, not a generation apart
    assert stats["steps_run_ahead"] > 20, stats  # and the four still ran ahead together
