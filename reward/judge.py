"""The judge (GenRM) service: a relay actor in front of each judge instance's engines,
in a process of its own (:func:`start_judge_service`).

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
- Rendering here, tokenizing in the engines: the service applies each instance's chat
  template and sends the text; each engine tokenizes its own requests
  (``EngineActor.generate_rendered``), so that work grows with the engines, not in this
  one process.
- Batching: the requests bound for one engine in one event-loop turn travel as one
  ``generate_rendered`` relay call (at most ``MAX_ENGINE_BATCH``); ``generate_batch`` takes many
  requests from a caller at once and renders their chat templates together. Results keep
  their request's position, and one request's failure (bad input, an engine refusal) never
  fails the others; a transport failure fails only the requests of that engine call, which
  are retried once on another engine as above.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import collections
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field

import relay
from engines.interface import GenerateResult, SamplingParams
from relay import Actor, ActorError, CallTimeout, SupervisionError, endpoint

log = logging.getLogger("relay.judge")

DEFAULT_ROUTE = "__default__"
SAMPLING_DEFAULTS = {"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 4096}
MAX_ENGINE_BATCH = 128  # requests per relay message to one engine


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
    in_flight: list = field(default_factory=list)  # per engine: requests sent, not yet answered
    awake: bool = True
    waiting: list = field(default_factory=list)  # per engine: _Jobs for its next call (cap permitting)
    flushing: list = field(default_factory=list)  # per engine: a flush is scheduled this loop turn
    defaults: tuple | None = None  # what _admit gives a request without sampling_params (computed once)
    template: tuple | None = None  # (compiled chat template, its variables) for chat_template_kwargs: see _render


@dataclass(eq=False)
class _Job:
    """One admitted, rendered request on its way to an engine; ``future`` gets its text or error."""

    prompt: str  # the rendered chat; the engine tokenizes it
    sampling: dict  # as the engine takes it
    future: asyncio.Future
    key: tuple | None  # judgment-cache key, None when not cached
    t0: float
    tried: set = field(default_factory=set)  # engines that failed it in transport


LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # seconds


class Metrics:
    """Counters per instance, for /genrm/metrics; the latency histogram is cumulative since
    start (counts per bucket upper bound, +Inf last, and the sum), in constant memory."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.latency: dict[str, list] = {}  # instance -> [bucket counts..., +Inf count, sum]

    def inc(self, instance: str, key: str, n: float = 1) -> None:
        self.counts[(instance, key)] += n

    def observe(self, instance: str, seconds: float) -> None:
        h = self.latency.get(instance)
        if h is None:
            h = self.latency[instance] = [0] * (len(LATENCY_BUCKETS) + 1) + [0.0]
        h[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        h[-1] += seconds

    def snapshot(self) -> dict:
        out: dict[str, dict] = collections.defaultdict(dict)
        for (inst, key), v in self.counts.items():
            out[inst][key] = v
        for inst, h in self.latency.items():
            cumulative = list(itertools.accumulate(h[:-1]))
            out[inst]["latency_s"] = {"buckets": [[b, c] for b, c in zip([*LATENCY_BUCKETS, "+Inf"], cumulative)], "sum": h[-1], "count": cumulative[-1]}
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
        self._http = None  # the gateway's runner once serve_http ran

    async def setup(self) -> None:
        from transformers import AutoTokenizer

        for name, spec in self.spec.items():
            sampling = {**SAMPLING_DEFAULTS, **(spec.get("sampling_config") or {})}
            ctk = sampling.pop("chat_template_kwargs", None) or {}
            engines = list(spec["engines"])
            if not engines:
                raise ValueError(f"GenRM instance {name!r} has no engines")
            tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, spec["model_path"])
            n = len(engines)
            self.instances[name] = _Instance(
                name, spec["model_path"], spec.get("num_gpus", n), engines, sampling, ctk, tok,
                [0] * n, True, [collections.deque() for _ in range(n)], [False] * n, template=_compiled_template(tok, ctk),
            )
        freeze_startup_objects()

    def _resolve(self, route_key: str | None) -> _Instance:
        if route_key is None and len(self.instances) == 1:
            return next(iter(self.instances.values()))
        key = route_key or DEFAULT_ROUTE
        inst = self.instances.get(key)
        if inst is None:
            raise UnknownRouteKey(f"No GenRM instance registered for route_key={key!r}; available={sorted(self.instances)}")
        return inst

    def _sampling(self, inst: _Instance, overrides: dict | None) -> tuple[dict, dict]:
        """Merged sampling and chat_template_kwargs; the instance's own kwargs dict itself
        when the request does not override them (requests sharing it render together)."""
        merged = dict(inst.sampling)
        ctk = inst.chat_template_kwargs
        for k, v in (overrides or {}).items():
            if k == "chat_template_kwargs":
                ctk = {**ctk, **(v or {})}
            elif k == "max_new_tokens":
                merged["max_response_len"] = v
            else:
                merged[k] = v
        return merged, ctk

    def _admit(self, sampling_params: dict | None, route_key: str | None) -> tuple:
        """(instance, merged sampling, SamplingParams, chat_template_kwargs, engine sampling
        dict) or the request's error. Shared between requests: never mutate them."""
        inst = self._resolve(route_key)
        if not inst.awake:
            self.metrics.inc(inst.name, "rejected_asleep")
            raise JudgeAsleep(f"GenRM instance {inst.name!r} is asleep; retry after it wakes")
        if not sampling_params and inst.defaults is not None:
            return inst.defaults
        sampling, ctk = self._sampling(inst, sampling_params)
        sp = SamplingParams.from_dict(sampling)  # unknown keys / bad values: ValueError
        admitted = (inst, sampling, sp, ctk, _as_dict(sp))
        if not sampling_params:
            inst.defaults = admitted
        return admitted

    @endpoint(concurrent=True)
    async def generate(self, messages: list, sampling_params: dict | None = None, route_key: str | None = None) -> str:
        return await self.submit(messages, sampling_params, route_key)

    def submit(self, messages: list, sampling_params: dict | None = None, route_key: str | None = None) -> asyncio.Future:
        """In this process (the HTTP gateway): admit and render one request now (its errors
        raise here) and return the future of its response text."""
        inst, sampling, sp, ctk, engine_sp = self._admit(sampling_params, route_key)
        return self._judge(inst, sampling, sp, engine_sp, self._render(inst, [messages], ctk)[0])

    @endpoint(concurrent=True)
    async def generate_batch(self, requests: list) -> list:
        """``requests``: a list of ``[messages, sampling_params, route_key]``. Returns one item
        per request, in order: its response text, or the exception that request raised (the
        error :meth:`generate` would raise for it alone; the others are unaffected)."""
        out: list = [None] * len(requests)
        groups: dict[tuple, list] = {}  # (instance, chat_template_kwargs) -> requests rendered together
        for j, req in enumerate(requests):
            try:
                if not isinstance(req, (list, tuple)) or len(req) != 3:
                    raise TypeError("each request must be [messages, sampling_params, route_key]")
                inst, sampling, sp, ctk, engine_sp = self._admit(req[1], req[2])
            except Exception as e:  # noqa: BLE001 - this request's error, returned in its place
                out[j] = e
                continue
            groups.setdefault((inst.name, id(ctk)), []).append((j, req[0], inst, sampling, sp, ctk, engine_sp))
        futures, where = [], []
        for group in groups.values():
            inst, ctk = group[0][2], group[0][5]
            try:
                rendered = self._render(inst, [g[1] for g in group], ctk)
            except Exception:  # noqa: BLE001 - some request is malformed: render one by one to find it
                rendered = []
                for g in group:
                    try:
                        rendered.append(self._render(inst, [g[1]], ctk)[0])
                    except Exception as e:  # noqa: BLE001
                        rendered.append(e)
            for (j, _, inst, sampling, sp, _, engine_sp), text in zip(group, rendered):
                if isinstance(text, Exception):
                    out[j] = text
                else:
                    futures.append(self._judge(inst, sampling, sp, engine_sp, text))
                    where.append(j)
        # plain futures (no task per request): the engine calls settle them
        for j, r in zip(where, await asyncio.gather(*futures, return_exceptions=True)):
            out[j] = r
        return out

    @staticmethod
    def _render(inst: _Instance, conversations: list, ctk: dict) -> list[str]:
        return _render(inst.tokenizer, conversations, ctk, inst.template if ctk is inst.chat_template_kwargs else None)

    def _judge(self, inst: _Instance, sampling: dict, sp: SamplingParams, engine_sp: dict, text: str) -> asyncio.Future:
        """The future of one request's response text: from the judgment cache, or queued for
        the least-loaded engine of ``inst`` (see :meth:`_dispatch`)."""
        fut = asyncio.get_running_loop().create_future()
        key = None
        if self.cache_mode == "always" or (self.cache_mode == "deterministic" and sp.temperature == 0):
            key = (inst.name, text, tuple(sorted((k, str(v)) for k, v in sampling.items())))
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                self.metrics.inc(inst.name, "cache_hits")
                self.metrics.inc(inst.name, "requests")
                fut.set_result(hit)
                return fut
        self.metrics.inc(inst.name, "requests")
        self._dispatch(inst, _Job(text, engine_sp, fut, key, time.monotonic()))
        return fut

    def _dispatch(self, inst: _Instance, job: _Job) -> None:
        """Queue ``job`` for the least-loaded engine it has not failed on (any engine once
        all have failed it); the engine's queue goes out at the end of this loop turn, as
        far as the concurrency cap allows."""
        n = len(inst.engines)
        candidates = [i for i in range(n) if i not in job.tried] or range(n)
        i = min(candidates, key=lambda j: inst.in_flight[j] + len(inst.waiting[j]))
        inst.waiting[i].append(job)
        if not inst.flushing[i]:
            inst.flushing[i] = True
            asyncio.get_running_loop().call_soon(self._flush, inst, i)

    def _flush(self, inst: _Instance, i: int) -> None:
        """Send engine ``i`` its waiting jobs, at most ``cap`` in flight, in calls of at most
        ``MAX_ENGINE_BATCH``; the rest go when answers come back."""
        inst.flushing[i] = False
        waiting = inst.waiting[i]
        room = self.cap - inst.in_flight[i]
        loop = asyncio.get_running_loop()
        while waiting and room > 0:
            k = min(room, MAX_ENGINE_BATCH, len(waiting))
            batch = [waiting.popleft() for _ in range(k)]
            room -= k
            inst.in_flight[i] += k
            loop.create_task(self._call_engine(inst, i, batch))

    async def _call_engine(self, inst: _Instance, i: int, batch: list) -> None:
        """One ``generate_rendered`` call to engine ``i``; settles each job's future. A transport
        failure (dead engine, timeout) sends each job once more to another engine, then
        reports JudgeUnavailable; an engine's refusal of a request is that request's error."""
        try:
            results = await inst.engines[i].generate_rendered.call_one([[job.prompt, job.sampling] for job in batch]).result()
            if len(results) != len(batch):
                raise ValueError(f"the engine answered {len(results)} results for {len(batch)} requests")
        except (SupervisionError, CallTimeout, ConnectionError) as e:
            self.metrics.inc(inst.name, "errors_transport")
            for job in batch:
                job.tried.add(i)
                if len(job.tried) < 2:
                    self._dispatch(inst, job)
                elif not job.future.done():
                    job.future.set_exception(JudgeUnavailable(f"GenRM instance {inst.name!r}: engines failed ({e})"))
            return
        except ActorError as e:  # the engine raised for the whole call: each request's refusal
            results = [e.exception] * len(batch)
        except asyncio.CancelledError:
            for job in batch:
                job.future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - not the engine's answer: every request of the call gets it
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(e)
            return
        finally:
            inst.in_flight[i] -= len(batch)
            if inst.waiting[i] and not inst.flushing[i]:
                self._flush(inst, i)
        now = time.monotonic()
        for job, r in zip(batch, results):
            if job.future.done():
                continue
            if isinstance(r, GenerateResult):
                self.metrics.inc(inst.name, "tokens_in", r.prompt_tokens)
                self.metrics.inc(inst.name, "tokens_out", len(r.token_ids))
                self.metrics.observe(inst.name, now - job.t0)
                text = r.text.strip()
                if job.key is not None:
                    self.cache[job.key] = text
                    if len(self.cache) > self.cache_size:
                        self.cache.popitem(last=False)
                job.future.set_result(text)
            else:
                self.metrics.inc(inst.name, "errors_engine")
                job.future.set_exception(ValueError(f"the judge engine refused the request: {r}"))

    @endpoint(concurrent=True)
    async def serve_http(self, host: str = "127.0.0.1", port: int = 8000, token: str | None = None) -> int:
        """Serve the HTTP gateway (:mod:`reward.gateway`) from this process; returns the port
        it listens on (``port=0``: any free port). Once per service."""
        from .gateway import serve

        if self._http is not None:
            raise RuntimeError("the judge's HTTP gateway is already served")
        try:
            self._http = await serve(self, host, port, token)
        except OSError as e:
            raise OSError(f"the judge gateway cannot listen on {host}:{port} ({e.strerror or e}); choose another port") from None
        return self._http.addresses[0][1]

    async def __cleanup__(self, exc) -> None:
        if self._http is not None:
            await self._http.cleanup()
            self._http = None

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


async def start_judge_service(specs: dict, timeout: float = 300.0, **kwargs) -> tuple:
    """Start the JudgeService in a process of its own on this host; returns ``(judge,
    procs)``: the one-actor mesh and its process mesh (``await procs.stop()`` at the end).
    Reward code reaches it at ``procs.procs[0].addr`` (actor name "genrm").

    Own process: its chat templating and tokenizing run beside the process that hosts the
    HTTP gateway and the caller's loop (the controller's GRPO loop, the reward functions),
    not on its event loop. If the process dies, the failure goes to the spawner's
    supervision (at the root: the unhandled fault hook), like any owned process."""
    procs = relay.this_host().spawn_procs(per_host={"procs": 1}, name="genrm")
    judge = procs.spawn("genrm", JudgeService, specs, **kwargs)
    await judge.initialized(timeout)
    return judge, procs


_frozen: list = []


def freeze_startup_objects() -> None:
    """Move the objects alive now (torch, transformers, tokenizers: ~400k in a controller)
    out of the collector's view: a full collection over them stalls the event loop of the
    process serving judge requests for ~0.3 s. They are handed back at exit, so that the
    interpreter's teardown still collects them."""
    gc.freeze()
    if not _frozen:
        _frozen.append(True)
        atexit.register(gc.unfreeze)


def _compiled_template(tokenizer, ctk: dict) -> tuple | None:
    """The tokenizer's chat template compiled by transformers, with the variables
    ``apply_chat_template`` would give it (special tokens, then ``ctk``); None when this
    transformers does not offer them or the template cannot be had (then _render always
    goes through apply_chat_template)."""
    try:
        from transformers.utils.chat_template_utils import (
            _compile_jinja_template,
            _plain_template_data,
        )

        return _compile_jinja_template(tokenizer.get_chat_template()), _plain_template_data({**tokenizer.special_tokens_map, **ctk})
    except Exception:  # noqa: BLE001 - no fast path; the general one reports real errors
        return None


def _plain_chat(messages) -> bool:
    """Messages that transformers' normalization leaves as they are: dicts of str role/content."""
    return type(messages) is list and all(
        type(m) is dict and m.keys() <= {"role", "content"} and all(type(v) is str for v in m.values()) for m in messages
    )


def _render(tokenizer, conversations: list, ctk: dict, template: tuple | None = None) -> list[str]:
    """Chat template -> prompt text for several conversations at once (the engines tokenize
    it: :meth:`engines.actor.EngineActor.generate_rendered`). ``template`` (from
    :func:`_compiled_template` for these ``ctk``): plain {role, content} messages are rendered
    with it directly, exactly as ``apply_chat_template`` renders them (it normalizes messages
    to these plain dicts, then calls the same compiled template with the same variables),
    without its per-call wrapper; anything else goes through ``apply_chat_template``."""
    if template is not None and all(_plain_chat(c) for c in conversations):
        compiled, variables = template
        texts = [compiled.render(messages=c, tools=None, documents=None, add_generation_prompt=True, **variables) for c in conversations]
    else:
        texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False, **ctk)
    if not isinstance(texts, list) or len(texts) != len(conversations):  # a conversation was not a list
        raise TypeError("messages must be a list of {role, content} objects")
    return texts


def _as_dict(sp) -> dict:
    return {
        "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "max_new_tokens": sp.max_new_tokens,
        "stop": list(sp.stop), "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos, "seed": sp.seed,
    }
