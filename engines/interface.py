"""The inference-engine contract shared by the built-in torch engine and the SGLang adapter.

Log-probabilities (one definition, used by engines and the trainer): the log-probability of
each chosen token under ``softmax(logits / T)`` where ``T`` is the request's temperature
(``T = 1`` for greedy, temperature 0), *before* top-k / top-p truncation.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import relay

TAGS = ("weights", "kv_cache", "cuda_graph")


@relay.register(name="engines.SamplingParams")
@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop: list = field(default_factory=list)  # strings
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def validate(self) -> SamplingParams:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        return self

    @classmethod
    def from_dict(cls, d: dict | None) -> SamplingParams:
        d = dict(d or {})
        if "max_response_len" in d and "max_new_tokens" not in d:
            d["max_new_tokens"] = d.pop("max_response_len")
        d.pop("max_response_len", None)
        d.pop("chat_template_kwargs", None)
        unknown = set(d) - {f for f in cls.__dataclass_fields__}
        if unknown:
            raise ValueError(f"unknown sampling parameters {sorted(unknown)}")
        return cls(**d).validate()


@relay.register(name="engines.GenerateResult")
@dataclass
class GenerateResult:
    token_ids: list
    text: str
    logprobs: list  # one per generated token (see the module docstring)
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    weight_version: int


class Engine(abc.ABC):
    """Async inference engine. ``sleep``/``wake`` are idempotent; sleeping with requests in
    flight first drains them (``drain="abort"`` aborts them, ``"finish"`` lets them end)."""

    @abc.abstractmethod
    async def generate(self, prompt, sampling: SamplingParams | dict | None = None, chat_template_kwargs: dict | None = None) -> GenerateResult: ...

    @abc.abstractmethod
    async def sleep(self, tags=TAGS, drain: str = "abort") -> None: ...

    @abc.abstractmethod
    async def wake(self, tags=TAGS) -> None: ...

    @abc.abstractmethod
    async def update_weights(self, buckets, version: int) -> None: ...

    @abc.abstractmethod
    async def pause(self) -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def abort(self, request_ids=None) -> int: ...

    @abc.abstractmethod
    async def health(self) -> dict: ...

    @abc.abstractmethod
    async def stats(self) -> dict: ...

    async def close(self) -> None:  # noqa: B027 (optional)
        """Release everything (processes, memory)."""


def check_tags(tags) -> tuple[str, ...]:
    tags = (tags,) if isinstance(tags, str) else tuple(tags)
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; tags are {', '.join(TAGS)}")
    return tags


def encode_rendered(tokenizer, texts: list) -> list[list[int]]:
    """Token ids of chats already rendered by their chat template, as
    ``apply_chat_template(tokenize=True)`` gives them (no special tokens added: the template
    wrote them). A fast tokenizer encodes the whole batch at once, without offsets."""
    if not all(isinstance(t, str) for t in texts):
        raise TypeError("rendered prompts must be strings")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    if len(texts) == 1:
        return [backend.encode(texts[0], add_special_tokens=False).ids]
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
