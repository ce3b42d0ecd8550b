"""Which requests run in the next step, and in which part of it. The scheduler decides; it
does not run the model (:mod:`.model_runner` does, from the :class:`StepPlan`).

Every step, in order:

1. Arrivals join the waiting queue; aborted requests (waiting or running) finish with
   reason "abort" and let go of their blocks.
2. Running requests first: each feeds its last token this step and needs a slot for it.
   When no block is free, the newest running request is preempted: its blocks are freed and
   it goes back to the front of the waiting queue, to be recomputed later from its prompt
   and output so far. So exhaustion queues instead of failing.
3. Then waiting requests are admitted in arrival order while their tokens fit in the free
   blocks (the head of the queue blocks the rest), ``max_running`` is not reached, and the
   padded prefill (prompts x longest) stays within ``max_prefill_tokens`` (a single prompt
   is always admitted). With ``share_prefix``, a request whose tokens equal those of one
   admitted in this step (the n samples of one prompt) follows it: no prefill of its own,
   it shares the leader's full blocks (reference-counted) and gets its own copy of the
   last, partial block, which its samples then write.

Quarantine: a step that raises is first put down to its requests. Its requests (one cohort:
at first every running one) are split into two new cohorts, and a step runs the requests of
one cohort only, cohorts taking turns; a cohort whose step fails again is split again, so an
innocent request runs on (recomputed from its prompt and output so far, like a preempted
one) and a request that fails a step alone, having failed one before, is the culprit
(:meth:`Scheduler.reset_after_failure`). Arrivals join cohort 0; a cohort ends when its
requests do.

Threading: the methods under "any thread" (arrivals, abort requests, sizes) put on
thread-safe queues or read sizes; every other method runs on the engine thread.
"""

from __future__ import annotations

import collections
import queue
from collections.abc import Callable
from dataclasses import dataclass, field

from engines.builtin.block_manager import BlockManager
from engines.builtin.sequence import Sequence


@dataclass
class StepPlan:
    """One step: ``decode`` (running requests, one token each), then ``admitted`` (new
    requests, in admission order); the logits of the step have one row per request of
    :attr:`batch`. ``prefill`` are the admitted requests run through prefill; the others
    follow a leader: ``followers`` maps a follower's request id to its leader's index in
    ``prefill``. ``finished``: requests aborted in this step."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    followers: dict[int, int] = field(default_factory=dict)
    finished: list[Sequence] = field(default_factory=list)

    @property
    def batch(self) -> list[Sequence]:
        return self.decode + self.admitted


def aborted(request_id: int, aborts: set) -> bool:
    """Whether ``request_id`` is named by the abort markers (ids, or ("before", n): every
    request that arrived before request n)."""
    return request_id in aborts or any(isinstance(a, tuple) and request_id < a[1] for a in aborts)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_running: int, max_prefill_tokens: int, share_prefix: bool):
        self.blocks = blocks
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.share_prefix = share_prefix
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order: the last is the newest
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()
        self._abort_ids: queue.SimpleQueue = queue.SimpleQueue()
        self.cohort = 0  # the cohort of the last scheduled step
        self._cohorts_made = 0  # quarantine cohorts made so far (their ids: 1, 2, ...)
        self._quarantine = False  # cohorts other than 0 may have requests

    # ------------------------------------------------------------------ any thread

    def add(self, seq: Sequence) -> None:
        """A new request; it joins the waiting queue at the next step."""
        self._incoming.put(seq)

    def request_abort(self, request_id: int | None = None, *, before: int | None = None) -> None:
        """Abort request ``request_id``, or every request whose id is below ``before``
        (those that exist now, not later arrivals), at the next step."""
        self._abort_ids.put(("before", before) if request_id is None else request_id)

    def has_input(self) -> bool:
        """Arrivals or aborts not yet taken by a step."""
        return not self._incoming.empty() or not self._abort_ids.empty()

    def can_admit(self) -> bool:
        """Engine thread: whether the next step would admit the head of the waiting queue (it
        is not quarantined, ``max_running`` has room and the free blocks hold its tokens): a
        request the last step's prefill budget left waiting, or one that finished requests
        made room for."""
        if not self.waiting or len(self.running) >= self.max_running or self.quarantined():
            return False
        return self._blocks_to_admit(self.waiting[0]) <= len(self.blocks.free_blocks)

    def _blocks_to_admit(self, seq: Sequence) -> int:
        """The free blocks ``seq``'s admission takes (as a prefill of its own)."""
        return self.blocks.blocks_for(seq.n_tokens) - len(seq.blocks)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.has_input())

    def pending_count(self) -> int:
        """Requests not finished: running, waiting, arrived."""
        return len(self.running) + len(self.waiting) + self._incoming.qsize()

    def waiting_count(self) -> int:
        return len(self.waiting) + self._incoming.qsize()

    # ------------------------------------------------------------------ engine thread

    def apply_aborts(self) -> list[Sequence]:
        """Take arrivals and aborts; the aborted requests, finished (also while paused)."""
        while not self._incoming.empty():
            self.waiting.append(self._incoming.get())
        aborts = set()
        while not self._abort_ids.empty():
            aborts.add(self._abort_ids.get())
        finished = []
        if aborts:
            for seq in [s for s in list(self.waiting) + self.running if aborted(s.request_id, aborts)]:
                seq.finish_reason = "abort"
                finished.append(self.finish(seq))
        return finished

    def schedule(self) -> StepPlan:
        """The next step (see the module docstring). Admitted requests join ``running``
        now, before the model runs: a failing step still finds them."""
        plan = StepPlan(finished=self.apply_aborts())
        apart = self.quarantined()
        self.cohort = cohort = self._next_cohort() if apart else 0
        self._reserve_decode_slots(cohort)
        self._admit(plan, cohort, apart)
        plan.decode = [s for s in self.running if s.cohort == cohort] if apart else list(self.running)
        self.running.extend(plan.admitted)
        return plan

    def quarantined(self) -> bool:
        """Whether requests of a failed step run apart (cohorts other than 0 have requests)."""
        if self._quarantine:
            self._quarantine = any(s.cohort for s in (*self.running, *self.waiting))
        return self._quarantine

    def _next_cohort(self) -> int:
        """While quarantined: the cohort after the last one that has requests (each in turn)."""
        live = sorted({s.cohort for s in (*self.running, *self.waiting)})
        return next((c for c in live if c > self.cohort), live[0])

    def _reserve_decode_slots(self, cohort: int) -> None:
        """A slot for each running request of ``cohort`` for its next token, preempting the
        newest running request when no block is free."""
        bs = self.blocks.block_size
        preempted: set[int] = set()
        for seq in list(self.running):
            if seq.cohort != cohort or seq.request_id in preempted or seq.n_tokens <= len(seq.blocks) * bs:
                continue
            while not self.blocks.free_blocks:
                victim = self.running.pop()
                self.blocks.free(victim)
                victim.cached_tokens = 0
                self.waiting.appendleft(victim)
                preempted.add(victim.request_id)
                if victim is seq:
                    break
            if seq.request_id not in preempted:
                self.blocks.append_block(seq)

    def _admit(self, plan: StepPlan, cohort: int, apart: bool) -> None:
        bs = self.blocks.block_size
        leaders: dict[tuple, int] = {}  # tokens of a leader -> its index in plan.prefill
        longest = 0
        # while quarantined, a step admits from its cohort's part of the queue only
        queue_ = collections.deque(s for s in self.waiting if s.cohort == cohort) if apart else self.waiting
        while queue_ and len(self.running) + len(plan.admitted) < self.max_running:
            seq = queue_[0]
            key = tuple(seq.tokens) if self.share_prefix and not seq.blocks else None
            lead = leaders.get(key) if key is not None else None
            if lead is not None:
                partial = seq.n_tokens % bs
                if partial and not self.blocks.free_blocks:
                    break
                self._take(queue_)
                seq.blocks = [self.blocks.share(b) for b in plan.prefill[lead].blocks[: seq.n_tokens // bs]]
                if partial:
                    seq.blocks.append(self.blocks.take())
                plan.followers[seq.request_id] = lead
            else:
                need = self._blocks_to_admit(seq)
                if need > len(self.blocks.free_blocks):
                    break
                if plan.prefill and (len(plan.prefill) + 1) * max(longest, seq.n_tokens) > self.max_prefill_tokens:
                    break
                longest = max(longest, seq.n_tokens)
                self._take(queue_)
                seq.blocks += [self.blocks.take() for _ in range(need)]
                if key is not None:
                    leaders[key] = len(plan.prefill)
                plan.prefill.append(seq)
            self.blocks.assign_row(seq)
            plan.admitted.append(seq)

    def _take(self, queue_: collections.deque) -> None:
        """The head of ``queue_`` (the waiting queue, or a cohort's part of it) leaves the waiting queue."""
        seq = queue_.popleft()
        if queue_ is not self.waiting:
            self.waiting.remove(seq)

    def reserve_ahead(self, seqs: list[Sequence]) -> bool:
        """A slot for one more token of each of ``seqs`` beyond the one in flight (a decode
        step launched before the last step's tokens are appended), taking blocks but never
        preempting: False, taking nothing, when the free blocks do not cover them (the step
        is then not launched; a regular step follows)."""
        bs = self.blocks.block_size
        need = [s for s in seqs if len(s.prompt) + len(s.output) >= len(s.blocks) * bs]  # n_tokens + 1 > room
        if len(need) > len(self.blocks.free_blocks):
            return False
        for seq in need:
            self.blocks.append_block(seq)
        return True

    def postprocess(self, batch: list[Sequence], token_ids: list[int], logprobs: list[float],
                    is_finished: Callable[[Sequence, int], bool]) -> list[Sequence]:
        """Append to each request of a step's ``batch`` its sampled token; the requests that
        ``is_finished`` ends (it sets their finish reason), finished and holding no blocks. A
        request already finished (by an earlier step, while this one ran ahead) is skipped:
        its row is void."""
        finished = []
        for seq, token, logprob in zip(batch, token_ids, logprobs):
            if seq.finish_reason is not None:
                continue
            output = seq.output
            seq.cached_tokens = len(seq.prompt) + len(output)  # (n_tokens, inlined: every row, every step)
            output.append(token)
            seq.logprobs.append(logprob)
            if is_finished(seq, token):
                finished.append(self.finish(seq))
        return finished

    def finish(self, seq: Sequence) -> Sequence:
        """``seq`` leaves the queues and lets go of its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free(seq)
        return seq

    def reset_after_failure(self) -> list[Sequence]:
        """After a step raised: the bookkeeping starts from scratch (no request holds blocks;
        every running request goes back to the front of the waiting queue, to be recomputed
        like a preempted one). The step's requests (its cohort's running ones) are suspects:
        split into two new cohorts; a suspect alone is returned as the culprit when it has
        failed a step before this one (a first failure may have been another's or the
        engine's), and leaves."""
        suspects = [s for s in self.running if s.cohort == self.cohort]
        culprits = []
        for seq in suspects:
            seq.step_failures += 1
        if len(suspects) == 1 and suspects[0].step_failures >= 2:
            culprits = suspects
        else:
            half = (len(suspects) + 1) // 2
            for part in (suspects[:half], suspects[half:]):
                if not part:
                    continue
                self._cohorts_made += 1
                self._quarantine = True
                for seq in part:
                    seq.cohort = self._cohorts_made
        for seq in reversed(self.running):
            if seq not in culprits:
                self.waiting.appendleft(seq)
        self.running.clear()
        for seq in self.waiting:
            seq.blocks, seq.table_row, seq.cached_tokens = [], -1, 0
        self.blocks.reset()
        return culprits

    def drop_all(self) -> list[Sequence]:
        """Every request not finished (running, waiting, arrived) leaves, letting go of
        its blocks; returns them (the engine cannot go on)."""
        while not self._incoming.empty():
            self.waiting.append(self._incoming.get())
        dropped = list(self.running) + list(self.waiting)
        for seq in dropped:
            if seq.blocks:
                self.blocks.free(seq)
        self.running.clear()
        self.waiting.clear()
        return dropped
