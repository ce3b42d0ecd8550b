"""One phase timer for a training step: named phases become ``time/<phase>`` metrics.

Two kinds of time are measured:

* phases (:meth:`PhaseTimer.phase`): sequential parts of the step (``rollout``, ``swap``,
  ``reward``, ``train``, ``sync``); a phase entered several times in one step adds up. The
  step's time not spent in any phase is ``time/orchestration``.
* spans (:meth:`PhaseTimer.span`): work that runs concurrently with other work, e.g. reward
  calls that overlap the rollout. Their metric is the seconds during which at least one
  span ran (the union of the spans), and it is not a phase: it does not count against
  ``time/orchestration``. A phase of the same name wins over the spans.

The clock is injectable so that the arithmetic can be tested without sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def union_seconds(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by at least one of the ``(start, end)`` spans."""
    total, covered_until = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > covered_until:
            total += end - max(start, covered_until)
            covered_until = end
    return total


class PhaseTimer:
    """Phases and spans of one step at a time (see the module docstring).

    Contract: :meth:`begin_step` starts a step (phases from before are dropped; spans are
    dropped too unless ``keep_spans``), :meth:`end_step` fixes its total, :meth:`metrics`
    returns the ``time/*`` metrics of the step and forgets its phases and spans."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, span_names: tuple[str, ...] = ()):
        """``span_names``: span metrics reported every step, as 0 when no such span ran."""
        self.clock = clock
        self.span_names = span_names
        self._seconds: dict[str, float] = {}
        self._spans: dict[str, list[tuple[float, float]]] = {}
        self._step_start = clock()
        self._step_seconds: float | None = None

    def begin_step(self, keep_spans: bool = False) -> None:
        self._seconds.clear()
        if not keep_spans:
            self._spans.clear()
        self._step_start = self.clock()
        self._step_seconds = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as (part of) phase ``name``; counted even when the block raises."""
        self._seconds.setdefault(name, 0.0)
        start = self.clock()
        try:
            yield
        finally:
            self._seconds[name] += self.clock() - start

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Record the block as one span of concurrent work ``name``."""
        start = self.clock()
        try:
            yield
        finally:
            self._spans.setdefault(name, []).append((start, self.clock()))

    def seconds(self, name: str) -> float:
        """Seconds in phase ``name`` so far this step (0 when never entered)."""
        return self._seconds.get(name, 0.0)

    def end_step(self) -> float:
        """Fix the step's total (seconds since :meth:`begin_step`) and return it."""
        self._step_seconds = self.clock() - self._step_start
        return self._step_seconds

    def metrics(self) -> dict:
        """``time/<phase>`` for every phase entered, ``time/<name>`` (union) for span names
        without a phase of that name, ``time/step`` and ``time/orchestration`` (the step's
        seconds outside every phase, at least 0). Forgets this step's phases and spans."""
        total = self._step_seconds if self._step_seconds is not None else self.end_step()
        out = {f"time/{name}": seconds for name, seconds in self._seconds.items()}
        for name in dict.fromkeys((*self.span_names, *self._spans)):
            out.setdefault(f"time/{name}", union_seconds(self._spans.get(name, [])))
        out["time/step"] = total
        out["time/orchestration"] = max(0.0, total - sum(self._seconds.values()))
        self._seconds.clear()
        self._spans.clear()
        return out
