"""The judge (GenRM) service: a relay actor in front of each judge instance's engines.

- ``route_key``: omitted -> the only instance, or ``"__default__"``; unknown -> the error
  ``No GenRM instance registered for route_key='x'; available=[...]``.
- Per instance: its tokenizer and chat template, ``chat_template_kwargs``, and sampling
  defaults (temperature 0.1, top_p 1.0, top_k -1, max_response_len) merged with the
  request's ``sampling_params``.
- Least-loaded choice among the instance's engines, at most ``max_concurrency_per_engine``
  requests each; a dead engine or transport failure is retried once on another engine.
- Admission is closed while the instance sleeps: callers get :class:`JudgeAsleep` at once
  (the HTTP gateway answers 503 with ``Retry-After: 1``); nothing waits on a sleeping judge.
- A cache keyed by (instance, rendered prompt, sampling) answers identical requests once,
  only for deterministic sampling (temperature 0) unless ``cache="always"``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import relay
from relay import Actor, ActorError, CallTimeout, SupervisionError, endpoint

log = logging.getLogger("relay.judge")

DEFAULT_ROUTE = "__default__"
SAMPLING_DEFAULTS = {"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 4096}


@relay.register(name="reward.JudgeAsleep")
class JudgeAsleep(RuntimeError):
    """The judge instance is asleep (its GPUs are lent to training); retry later."""


@relay.register(name="reward.UnknownRouteKey")
class UnknownRouteKey(ValueError):
    pass


@relay.register(name="reward.JudgeUnavailable")
class JudgeUnavailable(RuntimeError):
    """Every engine of the instance failed (after one retry on another engine)."""


@dataclass
class _Instance:
    name: str
    model_path: str
    num_gpus: int
    engines: list  # one single-actor EngineActor mesh per engine
    sampling: dict
    chat_template_kwargs: dict
    tokenizer: object = None
    in_flight: list = field(default_factory=list)
    awake: bool = True
    sem: list = field(default_factory=list)


class Metrics:
    """Counters per instance, for /genrm/metrics."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.latency: dict[str, list[float]] = collections.defaultdict(list)

    def inc(self, instance: str, key: str, n: float = 1) -> None:
        self.counts[(instance, key)] += n

    def snapshot(self) -> dict:
        out: dict[str, dict] = collections.defaultdict(dict)
        for (inst, key), v in self.counts.items():
            out[inst][key] = v
        for inst, lat in self.latency.items():
            out[inst]["latency_s"] = list(lat[-2048:])
        return dict(out)


class JudgeService(Actor):
    """``instances``: {route_key: {model_path, num_gpus, sampling_config, engines: [mesh, ...]}}."""

    def __init__(self, instances: dict, max_concurrency_per_engine: int = 64, cache: str = "deterministic", cache_size: int = 16384):
        if cache not in ("deterministic", "always", "off"):
            raise ValueError("cache must be 'deterministic', 'always' or 'off'")
        self.spec = instances
        self.cap = max_concurrency_per_engine
        self.cache_mode = cache
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.cache_size = cache_size
        self.metrics = Metrics()
        self.instances: dict[str, _Instance] = {}

    async def setup(self) -> None:
        from transformers import AutoTokenizer

        for name, spec in self.spec.items():
            sampling = {**SAMPLING_DEFAULTS, **(spec.get("sampling_config") or {})}
            ctk = sampling.pop("chat_template_kwargs", None) or {}
            engines = list(spec["engines"])
            if not engines:
                raise ValueError(f"GenRM instance {name!r} has no engines")
            tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, spec["model_path"])
            self.instances[name] = _Instance(
                name, spec["model_path"], spec.get("num_gpus", len(engines)), engines, sampling, ctk, tok,
                [0] * len(engines), True, [asyncio.Semaphore(self.cap) for _ in engines],
            )

    def _resolve(self, route_key: str | None) -> _Instance:
        if route_key is None and len(self.instances) == 1:
            return next(iter(self.instances.values()))
        key = route_key or DEFAULT_ROUTE
        inst = self.instances.get(key)
        if inst is None:
            raise UnknownRouteKey(f"No GenRM instance registered for route_key={key!r}; available={sorted(self.instances)}")
        return inst

    def _sampling(self, inst: _Instance, overrides: dict | None) -> tuple[dict, dict]:
        merged = dict(inst.sampling)
        ctk = dict(inst.chat_template_kwargs)
        for k, v in (overrides or {}).items():
            if k == "chat_template_kwargs":
                ctk.update(v or {})
            elif k == "max_new_tokens":
                merged["max_response_len"] = v
            else:
                merged[k] = v
        return merged, ctk

    @endpoint(concurrent=True)
    async def generate(self, messages: list, sampling_params: dict | None = None, route_key: str | None = None) -> str:
        inst = self._resolve(route_key)
        if not inst.awake:
            self.metrics.inc(inst.name, "rejected_asleep")
            raise JudgeAsleep(f"GenRM instance {inst.name!r} is asleep; retry after it wakes")
        sampling, ctk = self._sampling(inst, sampling_params)
        from engines.interface import SamplingParams

        sp = SamplingParams.from_dict(sampling)  # unknown keys / bad values: ValueError
        ids = _render(inst.tokenizer, messages, ctk)
        key = None
        if self.cache_mode == "always" or (self.cache_mode == "deterministic" and sp.temperature == 0):
            key = (inst.name, tuple(ids), tuple(sorted((k, str(v)) for k, v in sampling.items())))
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                self.metrics.inc(inst.name, "cache_hits")
                self.metrics.inc(inst.name, "requests")
                return hit
        t0 = time.monotonic()
        self.metrics.inc(inst.name, "requests")
        self.metrics.inc(inst.name, "tokens_in", len(ids))
        text = await self._call_engine(inst, ids, sp)
        self.metrics.latency[inst.name].append(time.monotonic() - t0)
        if key is not None:
            self.cache[key] = text
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return text

    async def _call_engine(self, inst: _Instance, ids: list, sp) -> str:
        tried: set[int] = set()
        last: Exception | None = None
        for _ in range(2):  # the first engine, then once on another
            candidates = [i for i in range(len(inst.engines)) if i not in tried] or list(range(len(inst.engines)))
            i = min(candidates, key=lambda j: inst.in_flight[j])
            tried.add(i)
            inst.in_flight[i] += 1
            try:
                async with inst.sem[i]:
                    result = await inst.engines[i].generate.call_one(ids, _as_dict(sp)).result()
                self.metrics.inc(inst.name, "tokens_out", len(result.token_ids))
                return result.text.strip()
            except (SupervisionError, CallTimeout, ConnectionError) as e:
                last = e
                self.metrics.inc(inst.name, "errors_transport")
            except ActorError as e:
                self.metrics.inc(inst.name, "errors_engine")
                raise ValueError(f"the judge engine refused the request: {e.exception}") from None
            finally:
                inst.in_flight[i] -= 1
        raise JudgeUnavailable(f"GenRM instance {inst.name!r}: engines failed ({last})")

    @endpoint(concurrent=True)
    async def record_parse(self, route_key: str | None, ok: bool) -> None:
        """Reward code reports whether it could read a verdict; past 20% failures (after 20
        verdicts) the service warns once per instance."""
        inst = self._resolve(route_key)
        self.metrics.inc(inst.name, "verdicts")
        if not ok:
            self.metrics.inc(inst.name, "parse_failures")
        n = self.metrics.counts[(inst.name, "verdicts")]
        bad = self.metrics.counts[(inst.name, "parse_failures")]
        if n >= 20 and bad / n > 0.2 and not self.metrics.counts[(inst.name, "parse_warned")]:
            self.metrics.inc(inst.name, "parse_warned")
            log.warning(
                "GenRM instance %r: %d of %d judge outputs are not a bare 0/1: set "
                "chat_template_kwargs.enable_thinking=false or use parse=loose", inst.name, bad, n,
            )

    @endpoint(concurrent=True)
    async def set_awake(self, route_key: str | None, awake: bool) -> None:
        """Open or close admission (the controller calls this around sleep and wake)."""
        self._resolve(route_key).awake = awake

    @endpoint(concurrent=True)
    async def health(self) -> dict:
        out = {}
        for name, inst in self.instances.items():
            statuses = await asyncio.gather(*(e.health.call_one().result(10) for e in inst.engines), return_exceptions=True)
            bad = [s for s in statuses if isinstance(s, Exception) or s.get("status") != "healthy"]
            entry = {"status": "healthy" if not bad else "unhealthy"}
            if bad:
                entry["error"] = f"{len(bad)} of {len(inst.engines)} engines down: {bad[0]}"
            if not inst.awake:
                entry["sleeping"] = True
            out[name] = entry
        return out

    @endpoint(concurrent=True)
    async def metrics_snapshot(self) -> dict:
        snap = self.metrics.snapshot()
        info = {
            name: {"model_path": inst.model_path, "num_gpus": inst.num_gpus, "num_engines": len(inst.engines), **snap.get(name, {})}
            for name, inst in self.instances.items()
        }
        return info


def _render(tokenizer, messages: list, ctk: dict) -> list[int]:
    """Chat template -> token ids; the fast tokenizer's own encoder skips transformers'
    per-call wrapper (about half the cost of a judge request on the service)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **ctk)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _as_dict(sp) -> dict:
    return {
        "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "max_new_tokens": sp.max_new_tokens,
        "stop": list(sp.stop), "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos, "seed": sp.seed,
    }
