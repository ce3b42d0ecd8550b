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
import math
import time
from dataclasses import dataclass, field

import relay
from engines.interface import (
    MAX_INT64,
    EngineFailed,
    GenerateResult,
    RequestCancelled,
    SamplingParams,
    short_repr,
)
from relay import Actor, ActorError, CallTimeout, SupervisionError, endpoint

log = logging.getLogger("relay.judge")

DEFAULT_ROUTE = "__default__"
SAMPLING_DEFAULTS = {"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 4096}
MAX_ENGINE_BATCH = 128  # requests per relay message to one engine
ENGINE_STATS = ("requests_finished", "tokens_generated", "step_failures", "running", "waiting")  # in metrics ?engines=1
INLINE_RENDER_CHARS = 1 << 16  # requests with more message text are rendered off the event loop
MAX_RENDERED_CHARS = 4 << 20  # a rendered prompt longer than this is refused
MAX_TEMPLATE_KWARGS = 16  # chat_template_kwargs entries a request may give
MAX_TEMPLATE_KWARG_CHARS = 256  # length of a string value (or a key) in them
#: apply_chat_template's own parameters and the variables it sets: never from a request
#: (``chat_template`` would run the caller's template source in the service).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "chat_template", "tools", "documents", "messages", "conversation", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now",
})


MAX_MESSAGES = 256
MAX_ROUTE_KEY_CHARS = 256


@relay.register(name="reward.BadMessages")
class BadMessages(ValueError):
    """The 'messages' value is malformed (HTTP 422, as in the original); other bad requests are 400."""


def check_request(messages, sampling_params, route_key) -> tuple[list, dict | None, str | None]:
    """The one shape check of a judge request at every edge (HTTP, the ZeroMQ client, the
    service's endpoints): ``messages`` a non-empty list of at most ``MAX_MESSAGES``
    ``{role, content}`` objects of strings (role system, user or assistant),
    ``sampling_params`` an object or null, ``route_key`` a short string or null. Returns
    them; raises :class:`BadMessages` or ValueError naming what is wrong. Values inside
    ``sampling_params`` are checked on admission (SamplingParams.validate)."""
    if not isinstance(messages, list) or not messages:
        raise BadMessages("'messages' must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise BadMessages(f"at most {MAX_MESSAGES} messages")
    for i, m in enumerate(messages):
        if type(m) is not dict or m.keys() - {"role", "content"} or type(m.get("role")) is not str or type(m.get("content")) is not str:
            raise BadMessages(f"messages[{i}] must be an object with string 'role' and 'content' (and nothing else)")
        if m["role"] not in ("system", "user", "assistant"):
            raise BadMessages(f"messages[{i}].role must be system, user or assistant, got {short_repr(m['role'])}")
    if sampling_params is not None and not isinstance(sampling_params, dict):
        raise ValueError("'sampling_params' must be an object")
    if sampling_params:
        check_template_kwargs(sampling_params.get("chat_template_kwargs"))
    if route_key is not None and (not isinstance(route_key, str) or len(route_key) > MAX_ROUTE_KEY_CHARS):
        raise ValueError(f"'route_key' must be a string of at most {MAX_ROUTE_KEY_CHARS} characters, got {short_repr(route_key)}")
    return messages, sampling_params, route_key


@relay.register(name="reward.JudgeAsleep")
class JudgeAsleep(RuntimeError):
    """The judge instance is asleep (its GPUs are lent to training); retry later."""


@relay.register(name="reward.UnknownRouteKey")
class UnknownRouteKey(ValueError):
    pass


@relay.register(name="reward.JudgeUnavailable")
class JudgeUnavailable(RuntimeError):
    """The instance has no working engine, or the request failed on two engines in transport."""


@relay.register(name="reward.JudgeEngineError")
class JudgeEngineError(RuntimeError):
    """The engine failed this request (a failed step, not the request's fault: the engine
    recovered). The HTTP gateway answers 502; it is not retried automatically."""


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
    template_reads: frozenset = frozenset()  # the variables the chat template reads
    down: list = field(default_factory=list)  # per engine: why it left dispatch, or None while it serves


@dataclass(eq=False)
class _Job:
    """One admitted, rendered request on its way to an engine; ``future`` gets its text or error."""

    prompt: str  # the rendered chat; the engine tokenizes it
    sampling: dict  # as the engine takes it
    future: asyncio.Future
    key: tuple | None  # judgment-cache key, None when not cached
    t0: float
    tag: str  # names it to its engine, to cancel it there when its caller leaves
    tried: set = field(default_factory=set)  # engines that failed it in transport
    engine: int = -1  # the engine it was sent to, while it runs there


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
        self._http = None  # the gateway's server once serve_http ran
        self._tags = itertools.count()
        self._cancels: dict[tuple, list] = {}  # (instance, engine) -> tags to cancel there this loop turn
        self._by_client_id: dict[str, asyncio.Future] = {}  # generate_batch request id -> its future, while pending

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
            template = _compiled_template(tok, ctk)
            self.instances[name] = _Instance(
                name, spec["model_path"], spec.get("num_gpus", n), engines, sampling, ctk, tok,
                [0] * n, True, [collections.deque() for _ in range(n)], [False] * n, template=template,
                template_reads=_template_reads(tok, template) - RESERVED_TEMPLATE_KWARGS - set(tok.special_tokens_map), down=[None] * n,
            )
        # Reach every engine now: relay learns that a process this one does not own has died
        # when their connection drops, so connect before the first request; an engine whose
        # process is already gone is out of dispatch from the start.
        await self.health()
        freeze_startup_objects()

    def _resolve(self, route_key: str | None) -> _Instance:
        if route_key is None and len(self.instances) == 1:
            return next(iter(self.instances.values()))
        key = route_key or DEFAULT_ROUTE
        inst = self.instances.get(key)
        if inst is None:
            raise UnknownRouteKey(f"No GenRM instance registered for route_key={short_repr(key)}; available={sorted(self.instances)}")
        return inst

    def _sampling(self, inst: _Instance, overrides: dict | None) -> tuple[dict, dict]:
        """Merged sampling and chat_template_kwargs; the instance's own kwargs dict itself
        when the request does not override them (requests sharing it render together)."""
        merged = dict(inst.sampling)
        ctk = inst.chat_template_kwargs
        for k, v in (overrides or {}).items():
            if k == "chat_template_kwargs":
                given = _request_template_kwargs(inst, v)
                if given:
                    ctk = {**ctk, **given}
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
        """In this process (the HTTP gateway): admit one request now (its errors raise here)
        and return the future of its response text. Rendering happens here too, or off the
        event loop for a request with much text (its errors then come with the future).
        Cancelling the future cancels the request, in its engine too."""
        check_request(messages, sampling_params, route_key)
        inst, sampling, sp, ctk, engine_sp = self._admit(sampling_params, route_key)
        if _chars([messages]) <= INLINE_RENDER_CHARS:
            return self._judge(inst, sampling, sp, engine_sp, self._render(inst, [messages], ctk)[0])
        return asyncio.ensure_future(self._render_then_judge(inst, sampling, sp, engine_sp, messages, ctk))

    async def _render_then_judge(self, inst, sampling, sp, engine_sp, messages, ctk) -> str:
        text = (await asyncio.to_thread(self._render, inst, [messages], ctk))[0]
        return await self._judge(inst, sampling, sp, engine_sp, text)

    @endpoint(concurrent=True)
    async def generate_batch(self, requests: list) -> list:
        """``requests``: a list of ``[messages, sampling_params, route_key]``. Returns one item
        per request, in order: its response text, or the exception that request raised (the
        error :meth:`generate` would raise for it alone; the others are unaffected)."""
        out: list = [None] * len(requests)
        groups: dict[tuple, list] = {}  # (instance, chat_template_kwargs) -> requests rendered together
        ids: list = [None] * len(requests)
        for j, req in enumerate(requests):
            try:
                if not isinstance(req, (list, tuple)) or len(req) not in (3, 4) or (len(req) == 4 and not isinstance(req[3], str)):
                    raise TypeError("each request must be [messages, sampling_params, route_key] or [..., request id (a string)]")
                if len(req) == 4:
                    ids[j] = req[3]
                check_request(*req[:3])
                inst, sampling, sp, ctk, engine_sp = self._admit(req[1], req[2])
            except Exception as e:  # noqa: BLE001 - this request's error, returned in its place
                out[j] = e
                continue
            groups.setdefault((inst.name, id(ctk)), []).append((j, req[0], inst, sampling, sp, ctk, engine_sp))
        futures, where = [], []
        for group in groups.values():
            inst, ctk = group[0][2], group[0][5]
            conversations = [g[1] for g in group]
            try:
                if _chars(conversations) > INLINE_RENDER_CHARS:
                    rendered = await asyncio.to_thread(self._render, inst, conversations, ctk)
                else:
                    rendered = self._render(inst, conversations, ctk)
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
                    continue
                fut = self._judge(inst, sampling, sp, engine_sp, text)
                futures.append(fut)
                where.append(j)
                if ids[j] is not None and not fut.done():  # cancellable by its caller (cancel)
                    self._by_client_id[ids[j]] = fut
                    fut.add_done_callback(lambda _f, rid=ids[j]: self._by_client_id.pop(rid, None))
        # plain futures (no task per request): the engine calls settle them
        for j, r in zip(where, await asyncio.gather(*futures, return_exceptions=True)):
            out[j] = RequestCancelled("cancelled by its caller") if isinstance(r, asyncio.CancelledError) else r
        return out

    @endpoint(concurrent=True)
    async def cancel(self, request_ids: list) -> None:
        """Cancel requests of :meth:`generate_batch` by the ids their caller gave them (the
        caller gave up on them): those still queued are dropped, those running are aborted
        in their engine."""
        for rid in request_ids if isinstance(request_ids, list) else ():
            fut = self._by_client_id.pop(rid, None) if isinstance(rid, str) else None
            if fut is not None:
                fut.cancel()

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
        job = _Job(text, engine_sp, fut, key, time.monotonic(), f"{next(self._tags):x}")
        fut.add_done_callback(lambda f: self._on_cancel(inst, job) if f.cancelled() else None)
        self._dispatch(inst, job)
        return fut

    def _on_cancel(self, inst: _Instance, job: _Job) -> None:
        """The caller gave up on ``job``: a queued one is skipped when its engine's queue goes
        out; a running one is cancelled in its engine (batched per engine and loop turn)."""
        self.metrics.inc(inst.name, "cancelled")
        if job.engine < 0:
            return
        tags = self._cancels.get((inst.name, job.engine))
        if tags is None:
            tags = self._cancels[(inst.name, job.engine)] = []
            if len(self._cancels) == 1:
                asyncio.get_running_loop().call_soon(self._send_cancels)
        tags.append(job.tag)

    def _send_cancels(self) -> None:
        cancels, self._cancels = self._cancels, {}
        for (name, i), tags in cancels.items():
            self.instances[name].engines[i].cancel.broadcast(tags)  # fire and forget

    def _dispatch(self, inst: _Instance, job: _Job) -> None:
        """Queue ``job`` for the least-loaded working engine it has not failed on (any working
        engine once all have failed it); the engine's queue goes out at the end of this loop
        turn, as far as the concurrency cap allows. An engine that left dispatch
        (:meth:`_engine_down`) is never chosen; with none left the job fails at once."""
        n = len(inst.engines)
        working = [i for i in range(n) if inst.down[i] is None]
        if not working:
            if not job.future.done():
                job.future.set_exception(JudgeUnavailable(f"GenRM instance {inst.name!r} has no working engine: {'; '.join(inst.down)}"))
            return
        candidates = [i for i in working if i not in job.tried] or working
        i = min(candidates, key=lambda j: inst.in_flight[j] + len(inst.waiting[j]))
        inst.waiting[i].append(job)
        if not inst.flushing[i]:
            inst.flushing[i] = True
            asyncio.get_running_loop().call_soon(self._flush, inst, i)

    def _engine_down(self, inst: _Instance, i: int, reason: str) -> None:
        """Engine ``i`` cannot serve (its process is gone, or it failed for good): it leaves
        dispatch at once, and what was queued for it goes to the others."""
        if inst.down[i] is not None:
            return
        inst.down[i] = f"engine {i}: {reason}"
        self.metrics.inc(inst.name, "engines_down")
        log.error("GenRM instance %r: engine %d left dispatch: %s", inst.name, i, reason)
        queued, inst.waiting[i] = inst.waiting[i], collections.deque()
        for job in queued:
            self._dispatch(inst, job)

    def _retry_elsewhere(self, inst: _Instance, i: int, job: _Job, error) -> None:
        """``job`` failed on engine ``i`` not by its own fault: once more on another engine."""
        job.tried.add(i)
        if len(job.tried) < 2:
            self._dispatch(inst, job)
        elif not job.future.done():
            job.future.set_exception(JudgeUnavailable(f"GenRM instance {inst.name!r}: engines failed ({error})"))

    def _flush(self, inst: _Instance, i: int) -> None:
        """Send engine ``i`` its waiting jobs (not those their callers gave up on), at most
        ``cap`` in flight, in calls of at most ``MAX_ENGINE_BATCH``; the rest go when answers
        come back."""
        inst.flushing[i] = False
        waiting = inst.waiting[i]
        room = self.cap - inst.in_flight[i]
        loop = asyncio.get_running_loop()
        while waiting and room > 0:
            batch = []
            while waiting and len(batch) < min(room, MAX_ENGINE_BATCH):
                job = waiting.popleft()
                if not job.future.done():
                    job.engine = i
                    batch.append(job)
            if not batch:
                break
            room -= len(batch)
            inst.in_flight[i] += len(batch)
            loop.create_task(self._call_engine(inst, i, batch))

    async def _call_engine(self, inst: _Instance, i: int, batch: list) -> None:
        """One ``generate_rendered`` call to engine ``i``; settles each job's future.

        - The engine's process is gone (or it reports :class:`EngineFailed`): it leaves
          dispatch and each job goes once more to another engine, then JudgeUnavailable; a
          call timeout retries likewise without removing the engine.
        - The engine refused a request (ValueError, TypeError: its sampling, its length):
          that request's error (the gateway's 400).
        - Any other error of a request (a failed step): :class:`JudgeEngineError` (502).
        """
        try:
            results = await inst.engines[i].generate_rendered.call_one([[job.prompt, job.sampling, job.tag] for job in batch]).result()
            if len(results) != len(batch):
                raise ValueError(f"the engine answered {len(results)} results for {len(batch)} requests")
        except (SupervisionError, CallTimeout, ConnectionError) as e:
            self.metrics.inc(inst.name, "errors_transport")
            if not isinstance(e, CallTimeout):
                self._engine_down(inst, i, f"its process is gone ({e})")
            for job in batch:
                job.engine = -1
                self._retry_elsewhere(inst, i, job, e)
            return
        except ActorError as e:  # the engine raised for the whole call: each request's error
            results = [e.exception] * len(batch)
        except asyncio.CancelledError:
            for job in batch:
                job.future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - not the engine's answer: every request of the call gets it
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(JudgeEngineError(f"GenRM instance {inst.name!r}: {type(e).__name__}: {e}"))
            return
        finally:
            inst.in_flight[i] -= len(batch)
            if inst.waiting[i] and not inst.flushing[i]:
                self._flush(inst, i)
        now = time.monotonic()
        for job, r in zip(batch, results):
            job.engine = -1
            if job.future.done():
                continue
            if isinstance(r, EngineFailed):
                self._engine_down(inst, i, str(r))
                self._retry_elsewhere(inst, i, job, r)
            elif isinstance(r, GenerateResult):
                self.metrics.inc(inst.name, "tokens_in", r.prompt_tokens)
                self.metrics.inc(inst.name, "tokens_out", len(r.token_ids))
                self.metrics.observe(inst.name, now - job.t0)
                text = r.text.strip()
                if job.key is not None:
                    self.cache[job.key] = text
                    if len(self.cache) > self.cache_size:
                        self.cache.popitem(last=False)
                job.future.set_result(text)
            elif isinstance(r, (ValueError, TypeError)):
                self.metrics.inc(inst.name, "refused")
                job.future.set_exception(ValueError(f"the judge engine refused the request: {r}"))
            else:
                self.metrics.inc(inst.name, "errors_engine")
                job.future.set_exception(JudgeEngineError(f"GenRM instance {inst.name!r}: the engine failed this request: {r}"))

    @endpoint(concurrent=True)
    async def serve_http(self, host: str = "127.0.0.1", port: int = 8000, token: str | None = None, limits: dict | None = None) -> int:
        """Serve the HTTP gateway (:mod:`reward.gateway`) from this process; returns the port
        it listens on (``port=0``: any free port). ``limits``: :class:`reward.httpd.HttpLimits`
        fields (timeouts, connection cap, body size). Once per service."""
        from .gateway import serve
        from .httpd import HttpLimits

        if self._http is not None:
            raise RuntimeError("the judge's HTTP gateway is already served")
        http_limits = HttpLimits(**(limits or {}))
        try:
            self._http, bound = await serve(self, host, port, token, _within_fd_limit(http_limits))
        except OSError as e:
            raise OSError(f"the judge gateway cannot listen on {host}:{port} ({e.strerror or e}); choose another port") from None
        return bound

    async def __cleanup__(self, exc) -> None:
        if self._http is not None:
            await self._http.close()
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
        """Per instance: ``status`` healthy when every engine is, ``error`` naming what is
        down, ``"sleeping": true`` while asleep, ``"available": false`` when no engine works
        (the gateway answers that with 503). An engine reporting unhealthy leaves dispatch."""
        out = {}
        for name, inst in self.instances.items():
            serving = [i for i, d in enumerate(inst.down) if d is None]
            statuses = await asyncio.gather(*(inst.engines[i].health.call_one().result(10) for i in serving), return_exceptions=True)
            slow = []
            for i, s in zip(serving, statuses):
                if isinstance(s, (SupervisionError, ConnectionError)):
                    self._engine_down(inst, i, f"its process is gone ({s})")
                elif isinstance(s, dict) and s.get("status") != "healthy":
                    self._engine_down(inst, i, str(s.get("error") or s))
                elif isinstance(s, Exception):  # no answer in time: reported, kept in dispatch
                    slow.append(f"engine {i}: {type(s).__name__}: {s}")
            bad = [d for d in inst.down if d is not None] + slow
            entry = {"status": "healthy" if not bad else "unhealthy"}
            if bad:
                entry["error"] = f"{len(bad)} of {len(inst.engines)} engines down: {bad[0]}"
            if all(d is not None for d in inst.down):
                entry["available"] = False
            if not inst.awake:
                entry["sleeping"] = True
            out[name] = entry
        return out

    @endpoint(concurrent=True)
    async def metrics_snapshot(self, engines: bool = False) -> dict:
        """Per instance: its static facts and counters; with ``engines``, also each engine's
        own counters (``requests_finished``, ``step_failures``, ...; an error string for an
        engine that did not answer within 5 s or left dispatch)."""
        snap = self.metrics.snapshot()
        info = {
            name: {"model_path": inst.model_path, "num_gpus": inst.num_gpus, "num_engines": len(inst.engines), **snap.get(name, {})}
            for name, inst in self.instances.items()
        }
        if engines:
            for name, inst in self.instances.items():
                stats = await asyncio.gather(*(e.stats.call_one().result(5) for e in inst.engines), return_exceptions=True)
                info[name]["engines"] = [
                    {"error": down} if down is not None else {"error": f"{type(s).__name__}: {s}"} if isinstance(s, Exception) else
                    {k: s[k] for k in ENGINE_STATS if k in s}
                    for down, s in zip(inst.down, stats)
                ]
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


def _within_fd_limit(limits):
    """``limits`` with a connection cap this process's open-file limit can hold (raising the
    soft limit toward the hard one first), keeping 256 descriptors for everything else: past
    the limit, accepting fails for every client instead of the cap answering 503."""
    import dataclasses
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = limits.max_connections + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < want:
        cap = max(1, soft - 256)
        log.warning("judge gateway: the open-file limit (%d) holds %d connections, not %d: capping there", soft, cap, limits.max_connections)
        return dataclasses.replace(limits, max_connections=cap)
    return limits


def _template_reads(tokenizer, template: tuple | None) -> frozenset:
    """The undeclared variables of the tokenizer's chat template (what it reads from its
    caller), parsed with the environment transformers compiles it in."""
    try:
        import jinja2
        from jinja2 import meta

        env = template[0].environment if template is not None else jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset(meta.find_undeclared_variables(env.parse(tokenizer.get_chat_template())))
    except Exception:  # noqa: BLE001 - no template or unparsable: a request may set none
        return frozenset()


def _scalar(value) -> bool:
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return -MAX_INT64 - 1 <= value <= MAX_INT64
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str) and len(value) <= MAX_TEMPLATE_KWARG_CHARS


def check_template_kwargs(value) -> None:
    """A request's ``chat_template_kwargs``: null or at most ``MAX_TEMPLATE_KWARGS`` entries
    of scalar values (null, booleans, 64-bit integers, finite numbers, short strings); never
    template source or ``apply_chat_template``'s own parameters. Raises ValueError."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"chat_template_kwargs must be an object of scalar values, got {short_repr(value)}")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise ValueError(f"chat_template_kwargs: at most {MAX_TEMPLATE_KWARGS} entries, got {len(value)}")
    for k, v in value.items():
        if not isinstance(k, str) or len(k) > MAX_TEMPLATE_KWARG_CHARS:
            raise ValueError(f"chat_template_kwargs: keys must be short strings, got {short_repr(k)}")
        if k in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs.{short_repr(k)} is not allowed: the judge's chat template and its inputs are set by its configuration")
        if not _scalar(v):
            raise ValueError(f"chat_template_kwargs.{short_repr(k)} must be null, a boolean, a finite number or a string of at most "
                             f"{MAX_TEMPLATE_KWARG_CHARS} characters, got {short_repr(v)}")


def _request_template_kwargs(inst: _Instance, value) -> dict:
    """The entries of a request's ``chat_template_kwargs`` (:func:`check_template_kwargs`)
    that the instance's template reads; the others are dropped (the template would ignore
    them). The tokenizer's special tokens cannot be overridden."""
    check_template_kwargs(value)
    if not value:
        return {}
    special = [k for k in value if k in inst.tokenizer.special_tokens_map]
    if special:
        raise ValueError(f"chat_template_kwargs.{short_repr(special[0])} is not allowed: the tokenizer sets it")
    return {k: v for k, v in value.items() if k in inst.template_reads}


def _chars(conversations: list) -> int:
    """Characters of message content in ``conversations`` (malformed parts count 0)."""
    return sum(
        len(m["content"]) for c in conversations if isinstance(c, list)
        for m in c if isinstance(m, dict) and isinstance(m.get("content"), str)
    )


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
    for t in texts:
        if len(t) > MAX_RENDERED_CHARS:
            raise ValueError(f"the rendered prompt has {len(t)} characters; at most {MAX_RENDERED_CHARS}")
    return texts


def _as_dict(sp) -> dict:
    return {
        "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "max_new_tokens": sp.max_new_tokens,
        "stop": list(sp.stop), "stop_token_ids": list(sp.stop_token_ids), "ignore_eos": sp.ignore_eos, "seed": sp.seed,
    }
