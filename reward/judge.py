"""The judge (GenRM) service: a relay actor in front of each judge instance's engines,
in a process of its own (:func:`start_judge_service`).

- ``route_key``: omitted -> the only instance, or ``"__default__"``; unknown -> the error
  ``No GenRM instance registered for route_key='x'; available=[...]``.
- Per instance: its tokenizer and chat template, ``chat_template_kwargs``, and sampling
  defaults (temperature 0.1, top_p 1.0, top_k -1, max_response_len) merged with the
  request's ``sampling_params``.
- Dispatch to each instance's engines: :mod:`reward.dispatch` (least-loaded, at most
  ``max_concurrency_per_engine`` each, failed engines out of dispatch, callers that leave
  cancelled in their engine).
- Admission is closed while the instance sleeps: callers get :class:`JudgeAsleep` at once
  (the HTTP gateway answers 503 with ``Retry-After: 1``); nothing waits on a sleeping judge.
- A cache keyed by (instance, rendered prompt, sampling) answers identical requests once,
  only for deterministic sampling (temperature 0) unless ``cache="always"``.
- Rendering here (:mod:`reward.templates`), tokenizing in the engines
  (``EngineActor.generate_rendered``), so that work grows with the engines, not in this
  one process.
- ``generate_batch`` takes many requests from a caller at once and renders their chat
  templates together. Results keep their request's position, and one request's failure
  (bad input, an engine refusal) never fails the others.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import errno
import gc
import logging

import relay
from engines.interface import RequestCancelled, SamplingParams, short_repr
from relay import Actor, endpoint

from .dispatch import EnginePool, Job
from .errors import JudgeAsleep, JudgeUnavailable, UnknownRouteKey
from .instance import Admitted, Instance, engine_sampling, render_chat, render_group
from .metrics import Metrics
from .protocol import DEFAULT_ROUTE, SAMPLING_DEFAULTS, check_request
from .scaling import Scaling
from .templates import INLINE_RENDER_CHARS, ChatTemplate, message_chars

log = logging.getLogger("relay.judge")


class JudgeService(Actor):
    """``instances``: {route_key: {model_path, num_gpus, sampling_config, engines: [mesh, ...]}}."""

    def __init__(
        self,
        instances: dict,
        max_concurrency_per_engine: int = 64,
        cache: str = "deterministic",
        cache_size: int = 16384,
    ):
        if cache not in ("deterministic", "always", "off"):
            raise ValueError("cache must be 'deterministic', 'always' or 'off'")
        self.spec = instances
        self.cap = max_concurrency_per_engine
        self.cache_mode = cache
        self.cache: collections.OrderedDict = collections.OrderedDict()
        self.cache_size = cache_size
        self.metrics = Metrics()
        self.instances: dict[str, Instance] = {}
        self._http = None  # the gateway's server once serve_http ran
        self._by_client_id: dict[str, asyncio.Future] = {}  # generate_batch request id -> its future, while pending
        self._draining = False  # drain() ran: no new request is admitted
        self.scaling = Scaling(self.instances, self._resolve)  # engines added and removed while serving

    async def setup(self) -> None:
        from transformers import AutoTokenizer

        for name, spec in self.spec.items():
            sampling = {**SAMPLING_DEFAULTS, **(spec.get("sampling_config") or {})}
            template_kwargs = sampling.pop("chat_template_kwargs", None) or {}
            engines = list(spec["engines"])
            if not engines:
                raise ValueError(f"GenRM instance {name!r} has no engines")
            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, spec["model_path"])
            self.instances[name] = Instance(
                name,
                spec["model_path"],
                spec.get("num_gpus", len(engines)),
                EnginePool(name, engines, self.cap, self.metrics),
                ChatTemplate.of(tokenizer, template_kwargs),
                sampling,
                placement=list(spec.get("placement") or []),
                max_context=spec.get("max_context_len"),
                longest_token=max(1, max(map(len, tokenizer.get_vocab()), default=1)),
                gpus_per_engine=spec.get("num_gpus_per_engine") or max(1, spec.get("num_gpus", 1) // len(engines)),
            )
        # Reach every engine now: relay learns that a process this one does not own has died
        # when their connection drops, so connect before the first request; an engine whose
        # process is already gone is out of dispatch from the start.
        await self.health()
        freeze_startup_objects()

    def _resolve(self, route_key: str | None) -> Instance:
        if route_key is None and len(self.instances) == 1:
            return next(iter(self.instances.values()))
        key = route_key or DEFAULT_ROUTE
        inst = self.instances.get(key)
        if inst is None:
            raise UnknownRouteKey(
                f"No GenRM instance registered for route_key={short_repr(key)}; available={sorted(self.instances)}"
            )
        return inst

    def _admit(self, sampling_params: dict | None, route_key: str | None) -> Admitted:
        """The request's admission to its instance, or its error (unknown route key, asleep,
        bad sampling or template kwargs)."""
        inst = self._resolve(route_key)
        if self._draining:
            raise JudgeUnavailable("the judge is stopping: it finishes the requests in flight and takes no new ones")
        if not inst.awake:
            self.metrics.inc(inst.name, "rejected_asleep")
            raise JudgeAsleep(f"GenRM instance {inst.name!r} is asleep; retry after it wakes")
        if not sampling_params and inst.defaults is not None:
            return inst.defaults
        merged = dict(inst.sampling)
        template_kwargs = inst.template.kwargs
        for key, value in (sampling_params or {}).items():
            if key == "chat_template_kwargs":
                template_kwargs = inst.template.request_kwargs(value)
            else:
                merged["max_response_len" if key == "max_new_tokens" else key] = value
        params = SamplingParams.from_dict(merged)  # unknown keys / bad values: ValueError
        if params.n != 1:  # an engine answers one sample per request: refused here, not at the engine
            raise ValueError(f"sampling_params.n must be 1 (one judge request, one answer), got {params.n}: send n "
                             "requests, or use /genrm/v1/chat/completions with 'n'")
        admitted = Admitted(inst, merged, params, template_kwargs, engine_sampling(params))
        if not sampling_params:
            inst.defaults = admitted
        return admitted

    @endpoint(concurrent=True)
    async def generate(self, messages: list, sampling_params: dict | None = None, route_key: str | None = None) -> str:
        return await self.submit(messages, sampling_params, route_key)

    def submit(
        self,
        messages: list,
        sampling_params: dict | None = None,
        route_key: str | None = None,
        *,
        checked: bool = False,
        detail: bool = False,
    ) -> asyncio.Future:
        """In this process (the HTTP gateway): admit one request now (its errors raise here)
        and return the future of its response text. Rendering happens here too, or off the
        event loop for a request with much text (its errors then come with the future).
        Cancelling the future cancels the request, in its engine too. ``checked``: the caller
        already ran :func:`reward.protocol.check_request` on it (the HTTP gateway). ``detail``:
        the future gets ``{text, prompt_tokens, completion_tokens, finish_reason}`` (not cached)."""
        if not checked:
            messages = check_request(messages, sampling_params, route_key)[0]
        admitted = self._admit(sampling_params, route_key)
        chars = message_chars([messages])
        admitted.instance.check_length(chars, admitted.params.max_new_tokens)
        if chars <= INLINE_RENDER_CHARS:
            text = render_chat(admitted, messages)
            return self._judge(admitted, text, detail=detail)
        return asyncio.ensure_future(self._render_then_judge(admitted, messages, detail))

    async def _render_then_judge(self, admitted: Admitted, messages: list, detail: bool) -> str:
        text = await asyncio.to_thread(render_chat, admitted, messages)
        return await self._judge(admitted, text, detail=detail)

    def submit_native(self, prompt, sampling_params: dict | None = None, route_key: str | None = None):
        """An SGLang-native payload (``prompt``: text, no chat template, or token ids), checked
        by :func:`reward.protocol.check_native`: the future of its response text. Token ids
        must be in the instance's vocabulary (ValueError)."""
        admitted = self._admit(sampling_params, route_key)
        if isinstance(prompt, str):
            admitted.instance.check_length(len(prompt), admitted.params.max_new_tokens)
        else:
            admitted.instance.check_length(0, admitted.params.max_new_tokens, tokens=len(prompt))
        if isinstance(prompt, list):
            vocab = len(admitted.instance.template.tokenizer)
            bad = next((t for t in prompt if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"input_ids: token id {bad} is not in the judge's vocabulary (ids 0 to {vocab - 1})")
        return self._judge(admitted, prompt, native=True)

    @endpoint(concurrent=True)
    async def generate_batch(self, requests: list) -> list:
        """``requests``: a list of ``[messages, sampling_params, route_key]`` or ``[...,
        request id]`` (a string, for :meth:`cancel`). Returns one item per request, in order:
        its response text, or the exception that request raised (the error :meth:`generate`
        would raise for it alone; the others are unaffected)."""
        out: list = [None] * len(requests)
        groups: dict[tuple, list] = {}  # (instance, template kwargs) -> [(position, messages, admitted, id)]
        for j, request in enumerate(requests):
            try:
                if (
                    not isinstance(request, (list, tuple))
                    or len(request) not in (3, 4)
                    or (len(request) == 4 and not isinstance(request[3], str))
                ):
                    raise TypeError(
                        "each request must be [messages, sampling_params, route_key] or [..., request id (a string)]"
                    )
                messages = check_request(*request[:3])[0]
                admitted = self._admit(request[1], request[2])
                admitted.instance.check_length(message_chars([messages]), admitted.params.max_new_tokens)
            except Exception as e:  # noqa: BLE001 - this request's error, returned in its place
                out[j] = e
                continue
            key = (admitted.instance.name, id(admitted.template_kwargs))
            groups.setdefault(key, []).append((j, messages, admitted, request[3] if len(request) == 4 else None))
        futures, where = [], []
        for group in groups.values():
            for (j, _, admitted, request_id), text in zip(group, await render_group(group)):
                if isinstance(text, Exception):
                    out[j] = text
                    continue
                future = self._judge(admitted, text)
                futures.append(future)
                where.append(j)
                if request_id is not None and not future.done():  # cancellable by its caller (cancel)
                    self._by_client_id[request_id] = future
                    future.add_done_callback(lambda _f, rid=request_id: self._by_client_id.pop(rid, None))
        # plain futures (no task per request): the engine calls settle them
        for j, result in zip(where, await asyncio.gather(*futures, return_exceptions=True)):
            out[j] = (
                RequestCancelled("cancelled by its caller") if isinstance(result, asyncio.CancelledError) else result
            )
        return out

    @endpoint(concurrent=True)
    async def cancel(self, request_ids: list) -> None:
        """Cancel requests of :meth:`generate_batch` by the ids their caller gave them (the
        caller gave up on them): those still queued are dropped, those running are aborted
        in their engine."""
        for request_id in request_ids if isinstance(request_ids, list) else ():
            future = self._by_client_id.pop(request_id, None) if isinstance(request_id, str) else None
            if future is not None:
                future.cancel()

    def _judge(self, admitted: Admitted, text, native: bool = False, detail: bool = False) -> asyncio.Future:
        """The future of one request's response text: from the judgment cache (chat requests
        only), or from the instance's engines (:class:`reward.dispatch.EnginePool`)."""
        inst = admitted.instance
        future = asyncio.get_running_loop().create_future()
        self.metrics.inc(inst.name, "requests")
        key = None
        cacheable = self.cache_mode == "always" or (
            self.cache_mode == "deterministic" and admitted.params.temperature == 0)
        if cacheable and not (native or detail):  # native prompts and usage counts always go to an engine
            key = (inst.name, text, admitted.cacheable_key)
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                self.metrics.inc(inst.name, "cache_hits")
                future.set_result(hit)
                return future
        inst.pool.submit(
            Job(text, admitted.engine_sampling, future, lambda answer: self._remember(key, answer), native, detail)
        )
        return future

    def _remember(self, key: tuple | None, text: str) -> None:
        if key is not None:
            self.cache[key] = text
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)

    @endpoint(concurrent=True)
    async def serve_http(
        self, host: str = "127.0.0.1", port: int = 8000, token: str | None = None, limits: dict | None = None,
        unhealthy_status: int = 200,
    ) -> int:
        """Serve the HTTP gateway (:mod:`reward.gateway`) from this process; returns the port
        it listens on (``port=0``: any free port). ``limits``: :class:`reward.httpd.HttpLimits`
        fields (timeouts, connection cap, body size); ``unhealthy_status``: ``GET
        /genrm/health``'s status when an instance cannot serve (200 with the body saying so, as
        the original; 503 for a watchdog that reads the status). Once per service."""
        from .gateway import serve, within_fd_limit
        from .httpd import HttpLimits

        if self._http is not None:
            raise RuntimeError("the judge's HTTP gateway is already served")
        http_limits = HttpLimits(**(limits or {}))
        try:
            self._http, bound = await serve(self, host, port, token, within_fd_limit(http_limits), unhealthy_status)
        except OSError as e:
            # a port taken or reserved: another port; a name that does not resolve, an address
            # not on this machine: another host
            fix = "choose another port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "check the host"
            raise OSError(f"the judge gateway cannot listen on {host}:{port} ({e.strerror or e}); {fix}") from None
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
                "chat_template_kwargs.enable_thinking=false or use parse=loose",
                inst.name,
                bad,
                n,
            )

    @endpoint(concurrent=True)
    async def set_awake(self, route_key: str | None, awake: bool) -> None:
        """Open or close admission (the controller calls this around sleep and wake)."""
        self._resolve(route_key).awake = awake

    @endpoint(concurrent=True)
    async def drain(self, timeout: float) -> dict:
        """Stop admitting (new requests get 503: the judge is stopping) and wait, at most
        ``timeout`` seconds, until the requests in flight or queued are answered. Returns
        ``{"in_flight": at the start, "left": still unanswered}``."""
        self._draining = True

        def load() -> int:
            return sum(slot.load for inst in self.instances.values() for slot in inst.pool.slots)

        start, deadline = load(), asyncio.get_running_loop().time() + timeout
        while load() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        return {"in_flight": start, "left": load()}

    @endpoint(concurrent=True)
    async def replace_engine(self, route_key: str | None, index: int, engine) -> None:
        """A new engine (an ``EngineActor`` mesh, initialized) takes the place of the
        instance's engine ``index``, whose process died; it serves at once."""
        pool = self._resolve(route_key).pool
        if not 0 <= index < len(pool.slots):
            raise ValueError(f"engine index {index} is out of range: the instance has {len(pool.slots)} engines")
        pool.replace(index, engine)

    @endpoint(concurrent=True)
    async def attach_scaler(self, total_gpus: int) -> None:
        """The process that owns the engines can start and stop them on a node of
        ``total_gpus`` GPUs: scale requests are carried out (reward/scaling.py), it takes
        them from :meth:`scale_orders`."""
        self.scaling.attach(total_gpus)

    @endpoint(concurrent=True)
    async def scale_orders(self, wait: float = 30.0) -> dict | None:
        """The engines' owner asks for its next order (start, stop, list; None after ``wait`` s)."""
        return await self.scaling.next_order(wait)

    @endpoint(concurrent=True)
    async def scale_done(self, order_id: str, result) -> None:
        """The owner's answer to an order: its result, or an error string."""
        self.scaling.done(order_id, result)

    @endpoint(concurrent=True)
    async def health(self) -> dict:
        """Per instance: ``status`` healthy when every engine is, ``error`` naming what is
        down, ``"degraded": true`` with ``engines_working`` / ``engines`` while some engine
        is down and another still serves, ``"sleeping": true`` while asleep,
        ``"available": false`` when no engine works (the gateway answers that with 503). An
        engine reporting unhealthy leaves dispatch."""
        names = list(self.instances)
        return dict(zip(names, await asyncio.gather(*(self.instances[n].health_entry() for n in names))))

    @endpoint(concurrent=True)
    async def engines_report(self) -> dict:
        """``GET /genrm/engines``: per instance, each engine's place (what the launcher gave:
        node, GPUs, ``tp`` and ``dp`` sizes), ``state`` (awake, asleep, failed, or unknown
        when it did not answer within 5 s) and load (``in_flight`` at the service, ``running``
        and ``waiting`` in the engine); and whether the instance admits requests."""
        return {name: {"model_path": inst.model_path, "admitting": inst.awake, "engines": await inst.engine_rows()}
                for name, inst in self.instances.items()}

    @endpoint(concurrent=True)
    async def metrics_snapshot(self, engines: bool = False) -> dict:
        """Per instance: its static facts and counters; with ``engines``, also each engine's
        own counters (``requests_finished``, ``step_failures``, ...; an error string for an
        engine that did not answer within 5 s or left dispatch)."""
        snap = self.metrics.snapshot()
        info = {
            name: {
                "model_path": inst.model_path,
                "num_gpus": inst.num_gpus,
                "num_engines": len(inst.pool.counted),
                **snap.get(name, {}),
            }
            for name, inst in self.instances.items()
        }
        if engines:
            for name, inst in self.instances.items():
                info[name]["engines"] = await inst.engine_stats()
        return info


async def start_judge_service(specs: dict, timeout: float = 300.0, procs=None, **kwargs) -> tuple:
    """Start the JudgeService in a process of its own on this host (``procs``: one started
    earlier, e.g. launcher/rl/judge.py's ``judge_process``, else a new one); returns
    ``(judge, procs)``: the one-actor mesh and its process mesh (``await procs.stop()`` at
    the end). Reward code reaches it at ``procs.procs[0].addr`` (actor name "genrm").

    Own process: its chat templating and tokenizing run beside the process that hosts the
    caller's loop (the controller's GRPO loop, the reward functions), not on its event
    loop. If the process dies, the failure goes to the spawner's supervision (at the root:
    the unhandled fault hook), like any owned process."""
    procs = procs or relay.this_host().spawn_procs(per_host={"procs": 1}, name="genrm")
    judge = procs.spawn("genrm", JudgeService, specs, **kwargs)
    await judge.initialized(timeout)
    return judge, procs


def freeze_startup_objects() -> None:
    """Move the objects alive now (torch, transformers, tokenizers) out of the collector's
    view: a full collection over them stalls the event loop of the process serving judge
    requests. They are handed back at exit, so that the interpreter's teardown still
    collects them. Calling it again freezes what is alive then; the hand-back stays one."""
    gc.freeze()
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
