"""The engine thread's steps (engines/builtin/engine.py hands each hop of work to
:meth:`Stepper.steps`): the scheduler plans a step, the model runner runs it, the sampler
picks the tokens and the scheduler appends them; with ``run_ahead``, decode steps are
launched before the tokens of the one before are read (:meth:`Stepper._run_ahead`), except
while the requests of a failed step run apart (the scheduler's quarantine) and while a waiting
request could be admitted (a chain never holds back a prefill)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engines.builtin.model_runner import ModelRunner
from engines.builtin.sampler import Sampler
from engines.builtin.scheduler import Scheduler
from engines.builtin.sequence import Sequence
from engines.builtin.transfer import to_device

#: decode steps launched ahead (each before the last one's tokens are read) per scheduled step,
#: at most; once a request finished, at most ``REPORT_WITHIN`` more (so that it is reported soon)
RUN_AHEAD = 64
REPORT_WITHIN = 8


class Stepper:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, *, run_ahead: bool,
                 paused: Callable[[], bool]):
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.run_ahead = run_ahead
        self.paused = paused  # whether the engine is paused (read between steps)
        self.tokens_out = 0  # tokens appended to requests
        self.steps_ahead = 0  # decode steps launched before the last one's tokens were read

    def steps(self, most: int = 8) -> list[Sequence]:
        """Up to ``most`` steps in one hop to the engine thread: it returns as soon as a
        request finishes (so its caller hears at once) or anything arrives to admit or abort,
        or the engine is paused."""
        for _ in range(most):
            done = self.step()
            if done or self.paused() or not self.scheduler.running or self.scheduler.has_input():
                return done
        return done

    def step(self) -> list[Sequence]:
        """A scheduled step, then up to ``RUN_AHEAD`` decode steps each launched before the
        tokens of the one before are read (see :meth:`_run_ahead`): the host appends tokens,
        ends requests and prepares the next step while the device computes; the chain stops
        ``REPORT_WITHIN`` steps after a request finished. Every step launched here is read
        here (nothing is in flight when this returns: the device idles while the next
        scheduled step is prepared, hence long chains)."""
        plan = self.scheduler.schedule()
        if not plan.batch:
            return plan.finished
        greedy = self.sampler.all_greedy(plan.batch)
        logits = self.runner.run(plan, greedy=greedy)
        step = (plan.batch, self.sampler.sample_batch(logits, plan.batch, picked=self.runner.picked), greedy)
        done = list(plan.finished)
        since_done = 0
        for chained in range(RUN_AHEAD):
            ahead = self._run_ahead(step, done, checked=chained > 0)
            done += self._land(step)
            if ahead is None:
                return done
            step = ahead
            since_done += bool(done)
            if since_done >= REPORT_WITHIN:
                break
        return done + self._land(step)

    def _land(self, step: tuple) -> list[Sequence]:
        """Read a launched step's tokens and append them; the requests it finished."""
        seqs, sampled, _ = step
        token_ids, logprobs = sampled.read()
        self.tokens_out += sum(s.finish_reason is None for s in seqs)
        return self.scheduler.postprocess(seqs, token_ids, logprobs, self.sampler.is_finished)

    def _run_ahead(self, step: tuple, done: list[Sequence], checked: bool) -> tuple | None:
        """Launch the decode step after ``step`` before ``step``'s tokens are read: its
        requests (those not finished, nor ending by length with ``step``'s token) feed those
        tokens from the device. Only when nothing arrived, no waiting request could be admitted
        now (:meth:`Scheduler.can_admit`: one the last step's prefill budget left waiting, or
        one that finished requests made room for), nothing waits to be aborted, the
        engine runs on one GPU, every request samples on the device (:meth:`Sampler.on_device`)
        and free blocks hold the next slots. A request that ``step`` ends has a void row (its
        KV write lands in its own, not yet reused, block); every other row is as a regular
        step would compute it. ``checked``: ``step`` was itself launched ahead (its requests,
        and so any of them, all sample on the device: not asked again, row by row)."""
        seqs, sampled, greedy = step
        if (not self.run_ahead or self.paused() or self.runner.tp is not None or self.scheduler.has_input()
                or self.scheduler.quarantined() or self.scheduler.can_admit()):
            return None
        live = [s for s in seqs if s.finish_reason is None and len(s.output) + 1 < s.sampling.max_new_tokens]
        if (not live or not (checked or all(self.sampler.on_device(s.sampling) for s in live))
                or not self.scheduler.reserve_ahead(live)):
            return None
        if len(live) == len(seqs):
            ids = sampled.tok
        else:
            index = {id(s): i for i, s in enumerate(seqs)}
            ids = sampled.tok[to_device([index[id(s)] for s in live], sampled.tok.device, torch.int64)]
            greedy = greedy or self.sampler.all_greedy(live)  # (rows of an all-greedy step are all greedy)
        self.steps_ahead += 1
        logits = self.runner.decode(live, ids, greedy=greedy)
        return live, self.sampler.sample_batch(logits, live, 1, picked=self.runner.picked), greedy
