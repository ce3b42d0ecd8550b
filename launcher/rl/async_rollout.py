"""Fully-async rollout: a producer generates (and scores) groups in data order without
waiting for the trainer, within a bound on the groups in flight.

Bound (invariant): a group holds one of :func:`slot_bound` slots from the moment its
generation starts until it has been trained on and the weights synced (or it was dropped),
so a group starts at most ``max_staleness`` weight versions before the step that trains it,
and stale drops are rare.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from .sample import Sample


def slot_bound(rollout_batch_size: int, max_staleness: int) -> int:
    """Groups in flight at most: one step's groups for the version being trained and for
    each of the ``max_staleness`` versions a group may lag."""
    return rollout_batch_size * (max_staleness + 1)


def is_stale(group: list[Sample], trainer_version: int, max_staleness: int) -> bool:
    """Whether the group's oldest sample lags the trainer by more than ``max_staleness``."""
    return min(s.weight_version for s in group) < trainer_version - max_staleness


class GroupProducer:
    """Runs ``make_group(k)`` for k = ``first_group``, ``first_group + 1``, ... while a slot
    is free; the trainer takes the groups with :meth:`next_group` (in completion order) and
    gives their slots back with :meth:`release` (or :meth:`drop` for a stale group).

    Counters: ``generated`` (groups finished), ``dropped`` (stale groups), ``in_flight``
    (slots held now) and ``in_flight_max`` (the most held since the last release)."""

    def __init__(self, make_group: Callable[[int], Awaitable[list[Sample]]], first_group: int, bound: int):
        self.make_group = make_group
        self.bound = bound
        self.generated = 0
        self.dropped = 0
        self.in_flight = 0
        self.in_flight_max = 0
        self._next = first_group
        self._slots = asyncio.Semaphore(bound)
        self._finished: asyncio.Queue = asyncio.Queue()  # groups, or the error that ended one
        self._stopping = asyncio.Event()
        self._groups_in_flight: set[asyncio.Task] = set()
        self._producer: asyncio.Task | None = None

    def start(self) -> None:
        self._producer = asyncio.ensure_future(self._produce())

    async def _produce(self) -> None:
        while not self._stopping.is_set():
            await self._slots.acquire()
            if self._stopping.is_set():
                break
            self.in_flight += 1
            self.in_flight_max = max(self.in_flight_max, self.in_flight)
            task = asyncio.ensure_future(self._one_group(self._next))
            self._groups_in_flight.add(task)
            task.add_done_callback(self._groups_in_flight.discard)
            self._next += 1

    async def _one_group(self, k: int) -> None:
        try:
            item = await self.make_group(k)
            self.generated += 1
        except Exception as e:  # noqa: BLE001 (handed to the trainer loop, which stops the job)
            item = e
        self._finished.put_nowait(item)

    async def next_group(self) -> list[Sample]:
        """The next finished group; raises the error of a group that failed, or of the
        producer itself."""
        get = asyncio.ensure_future(self._finished.get())
        done, _ = await asyncio.wait({get, self._producer}, return_when=asyncio.FIRST_COMPLETED)
        if get not in done:
            get.cancel()
            self._producer.result()  # the producer failed: raise its error
            raise RuntimeError("fully-async: the group producer stopped")
        item = get.result()
        if isinstance(item, BaseException):
            raise item
        return item

    def drop(self) -> None:
        """A stale group was not trained on: count it and free its slot."""
        self.dropped += 1
        self._free(1)

    def release(self, groups: int) -> int:
        """The trainer trained on ``groups`` groups and synced the weights: free their slots.
        Returns the most slots held since the previous release (then counted afresh from
        the slots still held)."""
        most = self.in_flight_max
        self._free(groups)
        self.in_flight_max = self.in_flight
        return most

    def _free(self, groups: int) -> None:
        self.in_flight -= groups
        for _ in range(groups):
            self._slots.release()

    async def cancel(self) -> None:
        """Stop at once: the producer and every group in flight are cancelled."""
        self._stopping.set()
        self._producer.cancel()
        for task in list(self._groups_in_flight):
            task.cancel()
        await asyncio.gather(self._producer, *self._groups_in_flight, return_exceptions=True)

    async def finish(self, abort: Callable[[], Awaitable[None]], timeout: float) -> int:
        """Start no more groups, ``abort()`` the generations in flight (they end at once and
        are still scored) and wait up to ``timeout`` s for them; returns the finished groups
        never taken."""
        self._stopping.set()
        self._slots.release()  # wake a producer waiting for a slot, so it sees the stop
        await self._producer
        await abort()
        await asyncio.wait_for(asyncio.gather(*self._groups_in_flight, return_exceptions=True), timeout)
        return self._finished.qsize()
