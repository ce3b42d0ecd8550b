"""The HTTP judge gateway (aiohttp): ``POST /genrm/generate``, ``GET /genrm/health``,
``GET /genrm/metrics``. Binds 127.0.0.1:8000 by default; an optional bearer token.

It is served by the judge service's own process and event loop
(:meth:`reward.judge.JudgeService.serve_http`): an HTTP request reaches the service without a
relay hop, and HTTP traffic never loads the process that started the judge (the
controller, or ``relay judge``).

Bad input never crashes it and never yields a 5xx: invalid JSON, wrong types, empty or
malformed messages, unknown ``route_key``, bad sampling parameters and bodies over the size
limit get a 4xx whose message says what is wrong. A sleeping judge gives 503 with
``Retry-After: 1`` (and ``"sleeping": true`` in its health); failed engines give 502.
"""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

import relay

from .judge import JudgeAsleep, JudgeUnavailable, UnknownRouteKey

MAX_BODY = 1 << 20  # bytes
MAX_MESSAGES = 256
# Counters of the serving process's relay runtime shown in /genrm/metrics: what reached the
# judge's ZeroMQ inbox without the job's secret, and the answers to such handshakes.
RELAY_STATS = ("dropped_unauthenticated", "dropped_malformed", "auth_handshakes", "auth_rejections_sent", "auth_rejections_suppressed")


def _bad(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)


class BadMessages(ValueError):
    """The 'messages' value is malformed (422, as in the seed); other bad bodies are 400."""


def validate_request(body) -> tuple[list, dict | None, str | None]:
    """Return (messages, sampling_params, route_key) or raise ValueError with the reason."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with 'messages'")
    unknown = set(body) - {"messages", "sampling_params", "route_key"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; allowed: messages, sampling_params, route_key")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadMessages("'messages' must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise BadMessages(f"at most {MAX_MESSAGES} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadMessages(f"messages[{i}] must be an object with string 'role' and 'content' (and nothing else)")
        if m["role"] not in ("system", "user", "assistant"):
            raise BadMessages(f"messages[{i}].role must be system, user or assistant, got {m['role']!r}")
    sp = body.get("sampling_params")
    if sp is not None and not isinstance(sp, dict):
        raise ValueError("'sampling_params' must be an object")
    rk = body.get("route_key")
    if rk is not None and not isinstance(rk, str):
        raise ValueError("'route_key' must be a string")
    return messages, sp, rk


class Gateway:
    """HTTP in front of a :class:`~reward.judge.JudgeService` of the same process (its
    methods are called directly). A request still unanswered after ``timeout`` seconds gets
    503."""

    def __init__(self, service, token: str | None = None, timeout: float = 600.0):
        self.service = service
        self.token = token
        self.timeout = timeout
        self.errors: dict[str, int] = {}
        self.started = time.time()

    def _count(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    @web.middleware
    async def auth(self, request: web.Request, handler):
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _bad("missing or wrong bearer token", 401)
        return await handler(request)

    async def generate(self, request: web.Request) -> web.Response:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._count("too_large")
            return _bad(f"body over {MAX_BODY} bytes", 413)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self._count("invalid_json")
            return _bad(f"Invalid request body: not JSON ({e})")
        try:
            messages, sp, rk = validate_request(body)
        except ValueError as e:
            self._count("invalid_request")
            return _bad(f"Invalid request body: {e}", 422 if isinstance(e, BadMessages) else 400)
        try:
            text = await asyncio.wait_for(self.service.submit(messages, sp, rk), self.timeout)
        except JudgeAsleep as e:
            self._count("asleep")
            return web.json_response({"error": str(e)}, status=503, headers={"Retry-After": "1"})
        except (UnknownRouteKey, ValueError, TypeError) as e:
            self._count("invalid_request")
            return _bad(str(e))
        except JudgeUnavailable as e:
            self._count("engine")
            return _bad(str(e), 502)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            self._count("unavailable")
            return _bad(f"the judge did not answer within {self.timeout:g} s", 503)
        except Exception as e:  # noqa: BLE001 - never a crash, never a 500
            self._count("internal")
            return _bad(f"judge error: {type(e).__name__}: {e}", 502)
        return web.json_response({"response": text})

    async def health(self, request: web.Request) -> web.Response:
        try:
            inst = await self.service.health()
        except Exception as e:  # noqa: BLE001
            return web.json_response({"status": "unhealthy", "service": "genrm", "error": str(e)})
        healthy = all(v["status"] == "healthy" for v in inst.values())
        out = {"status": "healthy" if healthy else "unhealthy", "service": "genrm"}
        if len(inst) > 1:
            out["instances"] = inst  # each asleep one has "sleeping": true
        elif any(v.get("sleeping") for v in inst.values()):
            out["sleeping"] = True  # the legacy single-instance shape: why generate answers 503
        if not healthy:
            out["error"] = "; ".join(f"{k}: {v.get('error', v['status'])}" for k, v in inst.items() if v["status"] != "healthy")
        return web.json_response(out)

    async def metrics(self, request: web.Request) -> web.Response:
        snap = await self.service.metrics_snapshot()
        transport = relay.transport_stats()
        rstats = {k: transport.get(k, 0) for k in RELAY_STATS}
        if request.query.get("format") == "json":
            return web.json_response({"service": "genrm", "instances": snap, "gateway_errors": self.errors, "relay": rstats})
        return web.Response(text=prometheus_text(snap, self.errors, rstats), content_type="text/plain")

    def app(self) -> web.Application:
        # Without a token no middleware runs at all (each one costs every request a wrapper).
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self.auth] if self.token else [])
        app.router.add_post("/genrm/generate", self.generate)
        app.router.add_get("/genrm/health", self.health)
        app.router.add_get("/genrm/metrics", self.metrics)
        return app


def prometheus_text(snap: dict, gateway_errors: dict, relay_stats: dict | None = None) -> str:
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.core import HistogramMetricFamily

    reg = CollectorRegistry()
    counters = {
        k: Counter(f"genrm_{k}", f"GenRM {k.replace('_', ' ')}", ["instance"], registry=reg)
        for k in ("requests", "tokens_in", "tokens_out", "cache_hits", "rejected_asleep", "errors_transport", "errors_engine", "verdicts", "parse_failures")
    }
    errs = Counter("genrm_gateway_errors", "gateway errors by kind", ["kind"], registry=reg)
    for inst, vals in snap.items():
        for k, c in counters.items():
            c.labels(inst).inc(float(vals.get(k, 0)))
    for kind, n in gateway_errors.items():
        errs.labels(kind).inc(n)
    for k, n in (relay_stats or {}).items():
        Counter(f"genrm_relay_{k}", f"judge process relay runtime: {k.replace('_', ' ')}", registry=reg).inc(n)

    class _Latency:  # the service's cumulative histogram, as it is
        def collect(self):
            fam = HistogramMetricFamily("genrm_latency_seconds", "judge call latency", labels=["instance"])
            for inst, vals in snap.items():
                h = vals.get("latency_s")
                if h:
                    fam.add_metric([inst], [(str(b), c) for b, c in h["buckets"]], h["sum"])
            yield fam

    reg.register(_Latency())
    return generate_latest(reg).decode()


async def serve(service, host: str = "127.0.0.1", port: int = 8000, token: str | None = None) -> web.AppRunner:
    """Serve ``service`` (a JudgeService of this process) on the running loop; returns the
    runner (``await runner.cleanup()``). Use :meth:`JudgeService.serve_http` from outside."""
    runner = web.AppRunner(Gateway(service, token).app(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
