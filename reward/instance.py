"""A judge instance as the service holds it (its engines, template, sampling defaults and
length bound), a request admitted to one, and rendering its chat."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engines.interface import SamplingParams, short_repr

from .dispatch import EnginePool
from .errors import BadMessages
from .metrics import ENGINE_STATS
from .templates import ChatTemplate


@dataclass(eq=False)
class Instance:
    """One judge deployment (a route key): its engines, template, sampling defaults."""

    name: str
    model_path: str
    num_gpus: int
    pool: EnginePool
    template: ChatTemplate
    sampling: dict  # defaults merged with each request's sampling_params
    awake: bool = True
    defaults: Admitted | None = None  # what a request without sampling_params gets (computed once)
    placement: list = field(default_factory=list)  # per engine: where it runs (GET /genrm/engines)
    max_context: int | None = None  # the engines' max_context_len (prompt + response tokens), if known
    longest_token: int = 1  # characters of the tokenizer's longest token: a prompt has >= chars / this tokens

    async def engine_stats(self) -> list:
        """Each engine's own counters (``metrics.ENGINE_STATS``), or an error string for one
        that did not answer within 5 s or left dispatch."""
        slots = self.pool.slots
        stats = await asyncio.gather(*(slot.mesh.stats.call_one().result(5) for slot in slots),
                                     return_exceptions=True)
        return [{"error": slot.down} if slot.down is not None
                else {"error": f"{type(s).__name__}: {s}"} if isinstance(s, Exception)
                else {k: s[k] for k in ENGINE_STATS if k in s}
                for slot, s in zip(slots, stats)]

    def check_length(self, chars: int, max_new_tokens: int, tokens: int | None = None) -> None:
        """Refuse, before any tokenizing or engine work, a prompt of ``chars`` characters (or of
        ``tokens`` token ids) that cannot fit ``max_context`` whatever its tokens: each token
        covers at most ``longest_token`` characters. ValueError (400) with the arithmetic."""
        if self.max_context is None:
            return
        at_least = tokens if tokens is not None else -(-chars // self.longest_token)
        if at_least + max_new_tokens > self.max_context:
            raise ValueError(
                f"the prompt has {chars} characters: at least {at_least} tokens (this judge's longest token has "
                f"{self.longest_token} characters) + max_new_tokens {max_new_tokens} is past the engines' "
                f"max_context_len {self.max_context}; shorten it")


@dataclass(frozen=True, eq=False)
class Admitted:
    """A request admitted to ``instance``: its merged sampling (as the engines take it) and
    its template kwargs. Shared between requests: never mutated."""

    instance: Instance
    sampling: dict  # merged, by the names of the config (max_response_len)
    params: SamplingParams
    template_kwargs: dict
    engine_sampling: dict

    @property
    def cacheable_key(self) -> tuple:
        return tuple(sorted((k, str(v)) for k, v in self.sampling.items()))


def render_chat(admitted: Admitted, messages: list) -> str:
    """The prompt text of one conversation; a chat template that refuses it (a role it does
    not know, ...) is the request's error (BadMessages, HTTP 422)."""
    try:
        return admitted.instance.template.render([messages], admitted.template_kwargs)[0]
    except (ValueError, TypeError):
        raise
    except Exception as e:  # noqa: BLE001 - jinja2's TemplateError and kin: the messages are at fault
        raise BadMessages(f"the judge's chat template refused the messages: {short_repr(str(e), 200)}") from None


def engine_sampling(params: SamplingParams) -> dict:
    """Every field of ``params`` as the engine takes it (fields SamplingParams gains pass
    through untouched)."""
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in vars(params).items()}
