"""The engines of one judge instance, as the service dispatches to them.

Least-loaded choice among the working engines, at most ``cap`` requests in flight each (the
rest wait in the engine's queue and go as answers come back); the requests bound for one
engine in one event-loop turn travel as one ``generate_rendered`` relay call (at most
``MAX_ENGINE_BATCH``). A request that fails not by its own fault (a transport failure, an
engine whose process is gone or that cannot go on, a failed engine step) is tried again, at
most ``ATTEMPTS`` times in all, ``RETRY_BACKOFF * attempt`` seconds later, on an engine it has
not failed on when there is one (the original system's policy: 3 attempts, 0.3 s steps); a
request the engine refuses (its sampling, its length) is never retried. An engine whose
process is gone or that failed for good leaves dispatch at once (it would answer fastest,
so least-loaded choice would prefer it) until :meth:`EnginePool.replace` puts a new one in
its place. A caller that gives up has its request dropped from the queue or cancelled in
its engine.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field

from engines.interface import EngineFailed, EngineStepError, GenerateResult
from relay import ActorError, CallTimeout, SupervisionError

from .errors import JudgeEngineError, JudgeUnavailable
from .metrics import Metrics

log = logging.getLogger("relay.judge")

MAX_ENGINE_BATCH = 128  # requests per relay message to one engine
ENGINE_CALL_TIMEOUT = 1800.0  # seconds: an engine call still unanswered then is retried on another engine
ATTEMPTS = 3  # tries of one request, the first included
RETRY_BACKOFF = 0.3  # seconds times the attempt number before a request is tried again


@dataclass(eq=False)
class Job:
    """One admitted, rendered request on its way to an engine; ``future`` gets its text or error."""

    prompt: str | list  # the rendered chat (the engine tokenizes it), or a native prompt: text or token ids
    sampling: dict  # as the engine takes it
    future: asyncio.Future
    on_text: object  # called with the text before the future is settled (the judgment cache)
    native: bool = False  # a native payload: the engine takes the prompt as SGLang's /generate would
    detail: bool = False  # the future gets {text, prompt_tokens, completion_tokens, finish_reason}
    started: float = field(default_factory=time.monotonic)
    tag: str = ""  # names it to its engine, to cancel it there when its caller leaves
    tried: set = field(default_factory=set)  # engines that failed it not by its own fault
    attempts: int = 0  # tries that failed not by its own fault
    engine: int = -1  # the engine it runs on, while it runs there


@dataclass(eq=False)
class EngineSlot:
    """One engine as dispatch sees it."""

    mesh: object  # a single-actor EngineActor mesh
    in_flight: int = 0  # requests sent, not yet answered
    waiting: collections.deque = field(default_factory=collections.deque)  # Jobs for its next call
    flushing: bool = False  # a flush is scheduled this loop turn
    down: str | None = None  # why it left dispatch, or None while it serves
    retiring: bool = False  # scaled in: out of dispatch, finishing what it holds, then stopped
    removed: bool = False  # stopped (scaled in, or reconciled away): not counted, its index not reused
    cancels: list = field(default_factory=list)  # tags to cancel there at the end of this loop turn

    @property
    def load(self) -> int:
        return self.in_flight + len(self.waiting)


class EnginePool:
    """Dispatch to the engines of the judge instance ``name`` (see the module docstring)."""

    _tags = itertools.count()  # job tags, unique in this process

    def __init__(self, name: str, meshes: list, cap: int, metrics: Metrics):
        self.name = name
        self.slots = [EngineSlot(mesh) for mesh in meshes]
        self.cap = cap
        self.metrics = metrics

    @property
    def working(self) -> list[int]:
        return [i for i, slot in enumerate(self.slots) if slot.down is None and not slot.retiring]

    @property
    def counted(self) -> list[int]:
        """The engines this instance counts: every slot not removed (working, down or retiring)."""
        return [i for i, slot in enumerate(self.slots) if not slot.removed]

    def add(self, mesh, index: int | None = None) -> int:
        """A new engine (scaled out) joins dispatch at once, at ``index`` (its owner's number
        for it; indices skipped are slots never counted) or the next; returns its index."""
        index = len(self.slots) if index is None else index
        if index < len(self.slots):
            raise ValueError(f"engine index {index} is taken (the instance has {len(self.slots)} slots)")
        while len(self.slots) < index:
            self.slots.append(EngineSlot(None, down="never started", retiring=True, removed=True))
        self.slots.append(EngineSlot(mesh))
        return index

    def retire(self, i: int) -> None:
        """Engine ``i`` is scaled in: it takes no new request (its queue goes to the others)
        and finishes those it runs; :meth:`remove` once it holds none."""
        slot = self.slots[i]
        slot.retiring = True
        queued, slot.waiting = slot.waiting, collections.deque()
        for job in queued:
            self._dispatch(job)

    def remove(self, i: int) -> None:
        """Engine ``i`` is stopped: no longer counted (its index stays taken)."""
        slot = self.slots[i]
        slot.removed, slot.retiring = True, True
        if slot.down is None:
            slot.down = f"engine {i}: removed"

    def submit(self, job: Job) -> None:
        """Queue ``job``; its future is settled by an engine's answer or error. Cancelling
        the future cancels the request (queued: skipped; running: aborted in its engine)."""
        job.tag = f"{next(self._tags):x}"
        job.future.add_done_callback(lambda f: self._cancelled(job) if f.cancelled() else None)
        self._dispatch(job)

    def replace(self, i: int, mesh) -> None:
        """A new engine takes slot ``i`` (its predecessor died): it joins dispatch at once."""
        self.slots[i] = EngineSlot(mesh)
        self.metrics.inc(self.name, "engines_replaced")
        log.warning("GenRM instance %r: engine %d is back in dispatch (a new engine)", self.name, i)

    def engine_down(self, i: int, reason: str) -> None:
        """Engine ``i`` cannot serve: it leaves dispatch at once, and its queue goes to the others."""
        slot = self.slots[i]
        if slot.down is not None:
            return
        slot.down = f"engine {i}: {reason}"
        self.metrics.inc(self.name, "engines_down")
        log.error("GenRM instance %r: engine %d left dispatch: %s", self.name, i, reason)
        queued, slot.waiting = slot.waiting, collections.deque()
        for job in queued:
            self._dispatch(job)

    def _dispatch(self, job: Job) -> None:
        """Queue ``job`` for the least-loaded working engine it has not failed on (any working
        engine once all have failed it); with none working, it fails at once."""
        working = self.working
        if not working:
            reasons = "; ".join(slot.down or "scaled in" for slot in self.slots if not slot.removed)
            _settle(job, JudgeUnavailable(f"GenRM instance {self.name!r} has no working engine: {reasons}"))
            return
        candidates = [i for i in working if i not in job.tried] or working
        i = min(candidates, key=lambda k: self.slots[k].load)
        slot = self.slots[i]
        slot.waiting.append(job)
        if not slot.flushing:
            slot.flushing = True
            asyncio.get_running_loop().call_soon(self._flush, i)

    def _cancelled(self, job: Job) -> None:
        self.metrics.inc(self.name, "cancelled")
        if job.engine < 0:
            return  # still queued: _flush skips it
        slot = self.slots[job.engine]
        if not slot.cancels:
            asyncio.get_running_loop().call_soon(self._send_cancels, slot)
        slot.cancels.append(job.tag)

    @staticmethod
    def _send_cancels(slot: EngineSlot) -> None:
        tags, slot.cancels = slot.cancels, []
        slot.mesh.cancel.broadcast(tags)  # fire and forget

    def _flush(self, i: int) -> None:
        """Send engine ``i`` its waiting jobs (not those their callers gave up on), at most
        ``cap`` in flight, in calls of at most ``MAX_ENGINE_BATCH``; the rest go when answers
        come back."""
        slot = self.slots[i]
        slot.flushing = False
        room = self.cap - slot.in_flight
        loop = asyncio.get_running_loop()
        while slot.waiting and room > 0:
            batch = []
            while slot.waiting and len(batch) < min(room, MAX_ENGINE_BATCH):
                job = slot.waiting.popleft()
                if not job.future.done():
                    job.engine = i
                    batch.append(job)
            if not batch:
                break
            room -= len(batch)
            slot.in_flight += len(batch)
            native = [job for job in batch if job.native]
            chats = [job for job in batch if not job.native] if native else batch
            for jobs in (chats, native):
                if jobs:
                    loop.create_task(self._call(i, jobs))

    def _retry(self, i: int, job: Job, error) -> None:
        """``job`` failed on engine ``i`` not by its own fault: again after a backoff,
        preferring another engine, or its final error after ``ATTEMPTS`` tries (a failed
        step: JudgeEngineError, 502; anything else: JudgeUnavailable, 503)."""
        job.engine = -1
        job.tried.add(i)
        job.attempts += 1
        if job.attempts < ATTEMPTS:
            self.metrics.inc(self.name, "retries")
            asyncio.get_running_loop().call_later(RETRY_BACKOFF * job.attempts, self._redispatch, job)
        elif isinstance(error, EngineStepError):
            _settle(job, JudgeEngineError(
                f"GenRM instance {self.name!r}: the engine failed this request {ATTEMPTS} times: {error}"))
        else:
            _settle(job, JudgeUnavailable(f"GenRM instance {self.name!r}: {ATTEMPTS} attempts failed ({error})"))

    def _redispatch(self, job: Job) -> None:
        if not job.future.done():  # its caller may have left during the backoff
            self._dispatch(job)

    async def _call(self, i: int, batch: list) -> None:
        """One ``generate_rendered`` call to engine ``i``; settles each job's future.

        - The engine's process is gone (or it reports EngineFailed): it leaves dispatch and
          each job is retried (:meth:`_retry`); a call timeout retries likewise without
          removing the engine.
        - The engine refused a request (ValueError, TypeError: its sampling, its length):
          that request's error (the gateway's 400), never retried.
        - Any other error of a request (a failed step): retried, then JudgeEngineError (502).
        - The engine raised for the whole call: each request gets that error (retried).
        - The call could not be sent (a value the wire cannot carry, past the edge checks):
          each request goes again in a call of its own, so the one at fault gets its own error
          (400) and the others their answers.
        """
        slot = self.slots[i]
        try:
            if batch[0].native:  # native prompts (a batch is all native or all rendered chats): not cancellable
                call = slot.mesh.generate_batch.call_one([[job.prompt, job.sampling] for job in batch])
            else:
                call = slot.mesh.generate_rendered.call_one([[job.prompt, job.sampling, job.tag] for job in batch])
            results = await call.result(ENGINE_CALL_TIMEOUT)
            if len(results) != len(batch):
                raise ValueError(f"the engine answered {len(results)} results for {len(batch)} requests")
        except (SupervisionError, CallTimeout, ConnectionError) as e:
            self.metrics.inc(self.name, "errors_transport")
            if not isinstance(e, CallTimeout):
                self.engine_down(i, f"its process is gone ({e})")
            for job in batch:
                self._retry(i, job, e)
            return
        except asyncio.CancelledError:
            for job in batch:
                job.future.cancel()
            raise
        except ActorError as e:  # the engine raised for the whole call: each request's error (retried)
            results = [e.exception] * len(batch)
        except Exception as e:  # noqa: BLE001 - the call could not be sent: some request's value, not the engine
            if len(batch) > 1:  # a request's fault is its own: each goes again alone
                self.metrics.inc(self.name, "calls_split")
                slot.in_flight += len(batch)  # given back by the single calls (the finally below takes them)
                loop = asyncio.get_running_loop()
                for job in batch:
                    loop.create_task(self._call(i, [job]))
                return
            results = [ValueError(f"the request cannot be sent to the engine: {type(e).__name__}: {e}")]
        finally:
            slot.in_flight -= len(batch)
            if slot.waiting and not slot.flushing:
                self._flush(i)
        for job, result in zip(batch, results):
            self._answer(i, job, result)

    def _answer(self, i: int, job: Job, result) -> None:
        job.engine = -1
        if job.future.done():
            return
        if isinstance(result, EngineFailed):
            self.engine_down(i, str(result))
            self._retry(i, job, result)
        elif isinstance(result, GenerateResult):
            self.metrics.inc(self.name, "tokens_in", result.prompt_tokens)
            self.metrics.inc(self.name, "tokens_out", len(result.token_ids))
            self.metrics.observe(self.name, time.monotonic() - job.started)
            text = result.text.strip()
            job.on_text(text)
            if job.detail:
                job.future.set_result(
                    {
                        "text": text,
                        "prompt_tokens": result.prompt_tokens,
                        "completion_tokens": len(result.token_ids),
                        "finish_reason": result.finish_reason,
                    }
                )
            else:
                job.future.set_result(text)
        elif isinstance(result, (ValueError, TypeError)):
            self.metrics.inc(self.name, "refused")
            job.future.set_exception(ValueError(f"the judge engine refused the request: {result}"))
        else:
            self.metrics.inc(self.name, "errors_engine")
            self._retry(i, job, result if isinstance(result, EngineStepError) else EngineStepError(str(result)))


def _settle(job: Job, error: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(error)
