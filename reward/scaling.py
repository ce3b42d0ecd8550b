"""Elastic judges: engines added to and removed from a judge instance while it serves.

The service decides and counts; the process that owns the engines (``relay judge``:
launcher/serve_judge.py) starts and stops them. That owner attaches once
(:meth:`Scaling.attach`, with the GPUs of its node) and then takes orders in a loop
(:meth:`Scaling.next_order`), answering each (:meth:`Scaling.done`). Without an owner
attached (a training job's judge, whose GPUs its plan gave to training too) scaling is
refused (:class:`ScalingRefused`, HTTP 409) saying so.

- ``scale_out`` ``{"route_key": K, "num_engines": N}``: N engines for instance K on free
  GPUs (``num_gpus_per_engine`` each, the lowest free ids; refused at once with why when
  there are not enough); each serves as soon as it has loaded.
- ``scale_in`` (same body): the N newest engines of K leave dispatch at once (their queues go
  to the others), finish what they run (at most ``DRAIN_SECONDS``; what is left then is
  retried on the others), then stop. At least one engine stays.
- Each gets a request id; :meth:`Scaling.state` tells ``pending`` / ``running`` /
  ``succeeded`` / ``failed`` (with ``error``) and the engine indices.
- ``reconcile``: the engines that run = the engines the service counts (an engine left
  down for good is dropped from the count; an engine that runs and is not counted is
  added).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass, field

import relay
from engines.interface import short_repr

log = logging.getLogger("relay.judge")

DRAIN_SECONDS = 60.0  # a scaled-in engine's requests in flight have this long to finish
KEEP_REQUESTS = 256  # finished scale requests remembered (oldest forgotten first)
MAX_ENGINES_PER_REQUEST = 64


@relay.register(name="reward.ScalingRefused")
class ScalingRefused(RuntimeError):
    """This scale request cannot be carried out as asked (no free GPU, the last engine, a
    judge whose engines are fixed): HTTP 409 with why."""


@dataclass
class ScaleRequest:
    id: str
    action: str  # "scale_out" | "scale_in"
    route_key: str
    num_engines: int
    status: str = "pending"  # -> "running" -> "succeeded" | "failed"
    engines: list = field(default_factory=list)  # the indices added or removed
    gpus: list = field(default_factory=list)  # scale_out: the GPU ids of each new engine
    error: str | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None

    def view(self) -> dict:
        out = {k: getattr(self, k) for k in ("action", "route_key", "num_engines", "status", "engines", "created")}
        out["request_id"] = self.id
        if self.error is not None:
            out["error"] = self.error
        if self.finished is not None:
            out["finished"] = self.finished
        return out


class Scaling:
    """Scale requests of one judge service (see the module docstring): ``instances`` (name ->
    reward.instance.Instance) and ``resolve`` (route key -> Instance, or UnknownRouteKey)."""

    _ids = itertools.count(1)  # scale request numbers: out-1, in-2, ...
    _order_ids = itertools.count(1)

    def __init__(self, instances: dict, resolve):
        self.instances = instances
        self.resolve = resolve
        self.total_gpus: int | None = None  # the owner's node, once attached
        self.requests: collections.OrderedDict[str, ScaleRequest] = collections.OrderedDict()
        self.orders: asyncio.Queue = asyncio.Queue()
        self._answers: dict[str, asyncio.Future] = {}  # order id -> the owner's answer
        self._running: set[asyncio.Task] = set()  # requests being carried out (held: the loop keeps only weak refs)

    # ------------------------------------------------------------------ the owner's side

    def attach(self, total_gpus: int) -> None:
        self.total_gpus = int(total_gpus)

    async def next_order(self, wait: float) -> dict | None:
        """The next order for the owner (``{"id", "op": "start" | "stop" | "list", ...}``), or
        None when none came within ``wait`` seconds (the owner asks again)."""
        try:
            return await asyncio.wait_for(self.orders.get(), wait)
        except TimeoutError:
            return None

    def done(self, order_id: str, result) -> None:
        """The owner's answer to an order: its result, or an error string."""
        answer = self._answers.pop(order_id, None)
        if answer is not None and not answer.done():
            answer.set_result(result)

    async def _order(self, op: str, timeout: float, **fields):
        self._check_attached()
        order_id = f"o{next(self._order_ids)}"
        answer = asyncio.get_running_loop().create_future()
        self._answers[order_id] = answer
        self.orders.put_nowait({"id": order_id, "op": op, **fields})
        try:
            result = await asyncio.wait_for(answer, timeout)
        finally:
            self._answers.pop(order_id, None)
        if isinstance(result, str):
            raise RuntimeError(result)
        return result

    def _check_attached(self) -> None:
        if self.total_gpus is None:
            raise ScalingRefused(
                "this judge's engines are fixed: a training job's judge runs on GPUs its plan shares with training; "
                "`relay judge` scales out and in")

    # ------------------------------------------------------------------ requests

    def submit(self, action: str, body) -> ScaleRequest:
        """Check a ``scale_out`` / ``scale_in`` body and start carrying it out (ValueError:
        a bad body, 400; ScalingRefused: cannot be done, 409); returns the request, pending."""
        if action not in ("scale_out", "scale_in"):
            raise ValueError(f"unknown scaling action {action!r}")
        if not isinstance(body, dict) or set(body) - {"route_key", "num_engines"}:
            raise ValueError('the body must be {"route_key": <instance>, "num_engines": <engines>}')
        n = body.get("num_engines", 1)
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_ENGINES_PER_REQUEST:
            raise ValueError(f"num_engines must be an integer from 1 to {MAX_ENGINES_PER_REQUEST}")
        route_key = body.get("route_key")
        if route_key is not None and not isinstance(route_key, str):
            raise ValueError("route_key must be a string")
        inst = self.resolve(route_key)  # UnknownRouteKey: 400
        self._check_attached()
        request = ScaleRequest(f"{action[6:]}-{next(self._ids)}", action, inst.name, n)
        if action == "scale_out":
            request.gpus = self._free_gpus(inst, n)
            task = self._scale_out(inst, request)
        else:
            working = inst.pool.working
            if n >= len(working):
                raise ScalingRefused(f"instance {inst.name!r} has {len(working)} working engine(s): scaling in {n} "
                                     "would leave none (at least one stays)")
            request.engines = working[-n:]
            for i in request.engines:  # out of dispatch now: no new request goes there
                inst.pool.retire(i)
            task = self._scale_in(inst, request)
        self.requests[request.id] = request
        while len(self.requests) > KEEP_REQUESTS:
            self.requests.popitem(last=False)
        running = asyncio.ensure_future(task)
        self._running.add(running)
        running.add_done_callback(self._running.discard)
        return request

    def state(self, request_id: str) -> dict | None:
        request = self.requests.get(request_id)
        return None if request is None else request.view()

    def _free_gpus(self, inst, n: int) -> list[list[int]]:
        """GPU ids for ``n`` new engines of ``inst`` (its GPUs per engine each), or ScalingRefused."""
        per = max(1, int(inst.gpus_per_engine))
        used = {g for other in self.instances.values() for i in other.pool.counted
                for g in (other.placement[i].get("gpus", []) if i < len(other.placement) else [])}
        used |= {g for r in self.requests.values() if r.status in ("pending", "running") for gpus in r.gpus
                 for g in gpus}
        free = [g for g in range(self.total_gpus) if g not in used]
        if len(free) < per * n:
            raise ScalingRefused(
                f"no free GPU for {n} engine(s) of {inst.name!r} ({per} GPU(s) each): {len(free)} of this node's "
                f"{self.total_gpus} GPUs are free ({sorted(used)} in use); scale in another instance first")
        return [free[k * per:(k + 1) * per] for k in range(n)]

    async def _scale_out(self, inst, request: ScaleRequest) -> None:
        request.status = "running"
        try:
            started = await asyncio.gather(*(
                self._order("start", 900.0, route_key=inst.name, gpus=gpus) for gpus in request.gpus),
                return_exceptions=True)
            for result in started:
                if isinstance(result, BaseException):
                    continue
                index = inst.pool.add(result["engine"], result["index"])
                while len(inst.placement) < index:
                    inst.placement.append({})
                inst.placement.append(result["placement"])
                request.engines.append(index)
                log.warning("GenRM instance %r: engine %d added (scale_out %s)", inst.name, index, request.id)
            errors = [f"{type(e).__name__}: {e}" for e in started if isinstance(e, BaseException)]
            if errors:
                raise RuntimeError(f"{len(errors)} of {request.num_engines} engine(s) did not start: {errors[0]}")
            request.status = "succeeded"
        except Exception as e:  # noqa: BLE001 - the request's state says why
            request.status, request.error = "failed", str(e)[:500]
        request.finished = time.time()
        request.gpus = []

    async def _scale_in(self, inst, request: ScaleRequest) -> None:
        request.status = "running"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_SECONDS
        slots = [inst.pool.slots[i] for i in request.engines]
        while any(slot.in_flight for slot in slots) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        try:
            await self._order("stop", 120.0, route_key=inst.name, engines=request.engines)
            request.status = "succeeded"
        except Exception as e:  # noqa: BLE001 - reported; the engines stay out of dispatch
            request.status, request.error = "failed", str(e)[:500]
        for i in request.engines:
            inst.pool.remove(i)  # stopped, or (failed) out of dispatch for good: not counted either way
        log.warning("GenRM instance %r: engines %s removed (scale_in %s)", inst.name, request.engines, request.id)
        request.finished = time.time()

    async def reconcile(self) -> dict:
        """Make the counted engines those that run (per instance: ``before``, ``after``,
        ``dropped`` and ``added`` indices)."""
        live = await self._order("list", 60.0)  # {route_key: {index: engine mesh}}
        out = {}
        for name, inst in self.instances.items():
            running = {int(i): mesh for i, mesh in (live.get(name) or {}).items()}
            before = len(inst.pool.counted)
            dropped = [i for i in inst.pool.counted if i not in running and not inst.pool.slots[i].retiring]
            for i in dropped:
                inst.pool.remove(i)
            added = []
            for i, mesh in sorted(running.items()):
                if i >= len(inst.pool.slots):
                    inst.pool.add(mesh, i)
                    added.append(i)
            out[name] = {"before": before, "after": len(inst.pool.counted), "dropped": dropped, "added": added}
        return out


class ScalingRoutes:
    """The gateway's scaling routes (reward/gateway.py): ``POST /genrm/scale_out`` and
    ``/genrm/scale_in`` (202 with the request's state), ``GET /genrm/scale_out/{id}`` and
    ``/genrm/scale_in/{id}``, ``POST /genrm/reconcile``."""

    def __init__(self, gateway):
        self.gateway = gateway
        self.scaling: Scaling = gateway.service.scaling

    def routes(self) -> dict:
        return {"/genrm/scale_out": ("POST", self.scale_out), "/genrm/scale_in": ("POST", self.scale_in),
                "/genrm/reconcile": ("POST", self.reconcile)}

    def prefixes(self) -> dict:
        return {"/genrm/scale_out/": ("GET", self.state), "/genrm/scale_in/": ("GET", self.state)}

    async def scale_out(self, request):
        return self._submit("scale_out", request)

    async def scale_in(self, request):
        return self._submit("scale_in", request)

    def _submit(self, action: str, request):
        from .http_messages import Response

        body, refused = self.gateway.read_json(request) if request.body else ({}, None)
        if refused is not None:
            return Response.json({"error": refused[1]}, refused[0])
        try:
            accepted = self.scaling.submit(action, body)
        except ScalingRefused as e:
            return Response.json({"error": str(e)}, 409)
        except (ValueError, TypeError) as e:
            return Response.json({"error": str(e)}, 400)
        return Response.json(accepted.view(), 202, {"Location": f"/genrm/{action}/{accepted.id}"})

    async def state(self, request):
        from .http_messages import Response

        action, _, request_id = request.path[len("/genrm/"):].partition("/")
        state = self.scaling.state(request_id)
        if state is None or state["action"] != action:
            return Response.json({"error": f"no {action} request {short_repr(request_id)} (the last "
                                           f"{KEEP_REQUESTS} are kept)"}, 404)
        return Response.json(state)

    async def reconcile(self, request):
        from .http_messages import Response

        try:
            return Response.json({"instances": await self.scaling.reconcile()})
        except ScalingRefused as e:
            return Response.json({"error": str(e)}, 409)
        except (RuntimeError, TimeoutError) as e:
            return Response.json({"error": f"reconcile failed: {e}"}, 503)
