"""A judge instance as the service holds it (its engines, template, sampling defaults and
length bound), a request admitted to one, and rendering its chat."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engines.interface import SamplingParams, short_repr
from relay import SupervisionError

from .dispatch import EnginePool
from .errors import BadMessages
from .metrics import ENGINE_STATS
from .templates import INLINE_RENDER_CHARS, ChatTemplate, message_chars


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
    gpus_per_engine: int = 1  # GPUs of one engine (what a scale-out takes per engine)

    async def _engine_stats(self) -> list[tuple[int, object, object]]:
        """(index, slot, its stats or the exception) of each counted engine (5 s each at most)."""
        counted = self.pool.counted
        slots = [self.pool.slots[i] for i in counted]
        stats = await asyncio.gather(*(slot.mesh.stats.call_one().result(5) for slot in slots),
                                     return_exceptions=True)
        return list(zip(counted, slots, stats))

    async def engine_stats(self) -> list:
        """Each counted engine's own counters (``metrics.ENGINE_STATS``), or an error string
        for one that did not answer within 5 s or left dispatch."""
        return [{"error": slot.down} if slot.down is not None
                else {"error": f"{type(s).__name__}: {s}"} if isinstance(s, Exception)
                else {k: s[k] for k in ENGINE_STATS if k in s}
                for _, slot, s in await self._engine_stats()]

    async def engine_rows(self) -> list:
        """``GET /genrm/engines``'s rows: each counted engine's place, state and load."""
        rows = []
        for i, slot, st in await self._engine_stats():
            row = {"index": i, **(self.placement[i] if i < len(self.placement) else {}), "in_flight": slot.load}
            if slot.down is not None:
                row.update(state="failed", error=slot.down)
            elif slot.retiring:
                row.update(state="draining")
            elif isinstance(st, Exception):
                row.update(state="unknown", error=f"{type(st).__name__}: {st}")
            else:
                row.update(state="asleep" if st.get("asleep") else "awake", running=st.get("running", 0),
                           waiting=st.get("waiting", 0))
            rows.append(row)
        return rows

    async def health_entry(self) -> dict:
        """This instance's part of the health answer (``JudgeService.health``); an engine
        whose process is gone or that reports unhealthy leaves dispatch."""
        pool = self.pool
        serving = pool.working
        statuses = await asyncio.gather(
            *(pool.slots[i].mesh.health.call_one().result(10) for i in serving), return_exceptions=True
        )
        slow = []
        for i, status in zip(serving, statuses):
            if isinstance(status, (SupervisionError, ConnectionError)):
                pool.engine_down(i, f"its process is gone ({status})")
            elif isinstance(status, dict) and status.get("status") != "healthy":
                pool.engine_down(i, str(status.get("error") or status))
            elif isinstance(status, Exception):  # no answer in time: reported, kept in dispatch
                slow.append(f"engine {i}: {type(status).__name__}: {status}")
        serve = [i for i in pool.counted if not pool.slots[i].retiring]  # those meant to serve (not scaled in)
        bad = [pool.slots[i].down for i in serve if pool.slots[i].down is not None] + slow
        entry: dict = {"status": "healthy" if not bad else "unhealthy"}
        if bad:
            entry["error"] = f"{len(bad)} of {len(serve)} engines down: {bad[0]}"
        if not pool.working:
            entry["available"] = False
        elif len(pool.working) < len(serve):
            entry.update(degraded=True, engines_working=len(pool.working), engines=len(serve))
        if not self.awake:
            entry["sleeping"] = True
        return entry

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


async def render_group(group: list) -> list:
    """The prompt texts of requests sharing an instance and template kwargs (``group``: their
    ``(position, messages, admitted, id)``), rendered together (off the event loop when
    long); each malformed one is its own error."""
    admitted = group[0][2]
    template, kwargs = admitted.instance.template, admitted.template_kwargs
    conversations = [messages for _, messages, _, _ in group]
    try:
        if message_chars(conversations) > INLINE_RENDER_CHARS:
            return await asyncio.to_thread(template.render, conversations, kwargs)
        return template.render(conversations, kwargs)
    except Exception:  # noqa: BLE001 - some request is malformed: render one by one to find it
        texts: list = []
        for messages in conversations:
            try:
                texts.append(render_chat(admitted, messages))
            except Exception as e:  # noqa: BLE001
                texts.append(e)
        return texts
