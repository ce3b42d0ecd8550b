"""One request's state as it moves through the engine: waiting, running (holding KV blocks
and a row of the host block table), finished."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engines.interface import SamplingParams


@dataclass(eq=False, slots=True)  # identity: requests are compared in list scans every step; slots: read every step
class Sequence:
    request_id: int  # in arrival order: "abort all before N" relies on it
    prompt: list
    sampling: SamplingParams
    future: asyncio.Future | None  # resolved on the caller's event loop
    loop: asyncio.AbstractEventLoop | None
    generator: torch.Generator | None  # the seeded requests' generator (top-k / top-p rows)
    output: list = field(default_factory=list)  # generated token ids
    logprobs: list = field(default_factory=list)  # one per generated token
    blocks: list = field(default_factory=list)  # KV blocks held, in token order
    table_row: int = -1  # this request's row in the host block table while it holds blocks
    cached_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    text_before_stop: str | None = None  # the text, set when a stop (trimmed off it) ended the request
    penalty: object | None = None  # a PenaltyState (engines/builtin/penalties.py) when penalties are asked
    weight_version: int = 0  # the engine's weights when the request arrived (the oldest that generated it)
    cohort: int = 0  # the requests it runs with: 0 (all), or a quarantine group after a failed step (scheduler.py)
    step_failures: int = 0  # failed steps it was in

    @property
    def tokens(self) -> list:
        return self.prompt + self.output

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]
