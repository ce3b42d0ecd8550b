"""The HTTP judge gateway: ``POST /genrm/generate``, ``GET /genrm/health``,
``GET /genrm/metrics``. Binds 127.0.0.1:8000 by default; an optional bearer token.

It is served by the judge service's own process and event loop
(:meth:`reward.judge.JudgeService.serve_http`) on :mod:`reward.httpd`, a strict HTTP/1.1
server with header, body and idle timeouts and a connection cap (:class:`HttpLimits`).

Bad input never crashes it and never yields a 5xx: invalid JSON (also nested past the
parser's depth, or integers too long to read), wrong types, empty or malformed messages,
unknown ``route_key``, bad sampling parameters and bodies over the size limit get a 4xx
whose message says what is wrong, echoing at most a short prefix of what was sent. A
sleeping judge gives 503 with ``Retry-After: 1`` (and ``"sleeping": true`` in its health);
an engine that failed a request gives 502; an instance with no working engine gives 503,
as does its health.

Auth: with a token, every route needs ``Authorization: Bearer <token>`` (the scheme in any
case; compared in constant time); otherwise 401 with ``WWW-Authenticate: Bearer``. Without a
token, browsers are kept out: ``POST`` needs ``Content-Type: application/json`` (a browser
cannot send that cross-site without a preflight this server never grants), the ``Host``
header must be an IP address, ``localhost`` or this machine's name (DNS rebinding), and an
``Origin`` header, if any, must name such a host.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
import time

import relay
from engines.interface import short_repr

from .errors import BadMessages, JudgeAsleep, JudgeEngineError, JudgeUnavailable, UnknownRouteKey
from .http_messages import HttpLimits, Request, Response
from .httpd import HttpServer
from .metrics import prometheus_text
from .protocol import check_request

log = logging.getLogger("relay.judge.gateway")

# Counters of the serving process's relay runtime shown in /genrm/metrics: what reached the
# judge's ZeroMQ inbox without the job's secret, and the answers to such handshakes.
RELAY_STATS = (
    "dropped_unauthenticated",
    "dropped_malformed",
    "auth_handshakes",
    "auth_rejections_sent",
    "auth_rejections_suppressed",
)
LOG_EVERY = 10.0  # seconds between two log lines about the same kind of failure


def validate_request(body) -> tuple[list, dict | None, str | None]:
    """Return (messages, sampling_params, route_key) of a JSON body or raise ValueError with
    the reason (:class:`~reward.errors.BadMessages` for malformed messages)."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with 'messages'")
    unknown = set(body) - {"messages", "sampling_params", "route_key"}
    if unknown:
        raise ValueError(
            f"unknown fields {short_repr(sorted(unknown), 80)}; allowed: messages, sampling_params, route_key"
        )
    return check_request(body.get("messages"), body.get("sampling_params"), body.get("route_key"))


def _error(message: str, status: int = 400, headers: dict | None = None) -> Response:
    return Response.json({"error": message}, status, headers)


class _Throttled:
    """Logs one line per kind of failure at most every ``LOG_EVERY`` seconds, with how many
    were not logged since (a flood of bad requests cannot flood the log)."""

    def __init__(self):
        self.last: dict[str, float] = {}
        self.skipped: dict[str, int] = {}

    def __call__(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self.last.get(kind, -LOG_EVERY) < LOG_EVERY:
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            return
        skipped = self.skipped.pop(kind, 0)
        self.last[kind] = now
        log.warning("judge gateway: %s%s", message, f" ({skipped} more like it not logged)" if skipped else "")


def _host_of(value: str) -> str:
    """The host part of a Host header or an Origin's authority (no port, no brackets)."""
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    host, _, port = value.rpartition(":")
    return host if host and port.isdigit() else value


def _local_name(host: str, names: frozenset) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host.lower() in names


class Gateway:
    """HTTP in front of a :class:`~reward.judge.JudgeService` of the same process (its
    methods are called directly). A request still unanswered after ``timeout`` seconds gets
    503."""

    def __init__(self, service, token: str | None = None, timeout: float = 600.0, limits: HttpLimits | None = None):
        self.service = service
        self.token = token.encode() if token else None
        self.timeout = timeout
        self.limits = limits or HttpLimits()
        self.errors: dict[str, int] = {}
        self.started = time.time()
        self.server = HttpServer(self.handle, self.limits, on_error=self._internal_error)
        self._log = _Throttled()
        self._names = frozenset(n.lower() for n in ("localhost", socket.gethostname(), socket.getfqdn()))
        self._routes = {
            "/genrm/generate": ("POST", self.generate),
            "/genrm/health": ("GET", self.health),
            "/genrm/metrics": ("GET", self.metrics),
        }

    def _count(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def _internal_error(self, request: Request | None, exc: BaseException) -> None:
        self._count("internal")
        where = f"{request.method} {short_repr(request.path)}" if request is not None else "a connection"
        self._log("internal", f"internal error on {where}: {type(exc).__name__}: {short_repr(str(exc), 200)}")

    async def handle(self, request: Request) -> Response:
        route = self._routes.get(request.path)
        if route is None:
            self._count("not_found")
            return _error(f"no route {short_repr(request.path)}; routes: {', '.join(self._routes)}", 404)
        method, handler = route
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            self._count("method_not_allowed")
            return _error(
                f"{short_repr(request.method)} is not allowed on {request.path}; use {method}", 405, {"Allow": method}
            )
        refused = self._authorize(request) if self.token else self._same_host(request)
        if refused is not None:
            return refused
        return await handler(request)

    def _authorize(self, request: Request) -> Response | None:
        scheme, _, credentials = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), self.token):
            return None
        self._count("unauthorized")
        return _error(
            "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
            401,
            {"WWW-Authenticate": 'Bearer realm="genrm"'},
        )

    def _same_host(self, request: Request) -> Response | None:
        """Without a token: refuse what only a browser on another site would send."""
        host = request.headers.get("host")
        if host is None and request.version == "HTTP/1.1":
            self._count("bad_host")
            return _error("an HTTP/1.1 request needs a Host header")
        if host is not None and not _local_name(_host_of(host.strip()), self._names):
            self._count("bad_host")
            return _error(
                f"Host {short_repr(host)} is not served here: use this machine's address or name (or set a token)", 403
            )
        origin = request.headers.get("origin")
        if origin is not None and origin != "null":
            authority = origin.partition("://")[2] or origin
            if not _local_name(_host_of(authority), self._names):
                self._count("bad_origin")
                return _error(
                    f"requests from the web origin {short_repr(origin)} are refused (set a token to serve other hosts)",
                    403,
                )
        return None

    async def generate(self, request: Request) -> Response:
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if content_type != "application/json":
            self._count("unsupported_media_type")
            return _error("send the body as JSON with 'Content-Type: application/json'", 415)
        try:
            body = json.loads(request.body)
        except (
            ValueError,
            RecursionError,
        ) as e:  # JSONDecodeError, UnicodeDecodeError, over-long integers; nesting too deep
            self._count("invalid_json")
            reason = "nested too deeply" if isinstance(e, RecursionError) else short_repr(str(e), 160)
            return _error(f"Invalid request body: not JSON ({reason})")
        try:
            messages, sampling_params, route_key = validate_request(body)
        except ValueError as e:
            self._count("invalid_request")
            return _error(f"Invalid request body: {e}", 422 if isinstance(e, BadMessages) else 400)
        try:
            answer = self.service.submit(messages, sampling_params, route_key, checked=True)  # checked above
            text = await asyncio.wait_for(answer, self.timeout)
        except JudgeAsleep as e:
            self._count("asleep")
            return _error(str(e), 503, {"Retry-After": "1"})
        except (UnknownRouteKey, ValueError, TypeError) as e:
            self._count("invalid_request")
            return _error(str(e))
        except JudgeUnavailable as e:
            self._count("unavailable")
            return _error(str(e), 503, {"Retry-After": "5"})
        except JudgeEngineError as e:
            self._count("engine")
            return _error(str(e), 502)
        except TimeoutError:
            self._count("timeout")
            return _error(f"the judge did not answer within {self.timeout:g} s", 503)
        return Response.json({"response": text})

    async def health(self, request: Request) -> Response:
        try:
            inst = await self.service.health()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            return Response.json({"status": "unhealthy", "service": "genrm", "error": short_repr(str(e), 200)}, 503)
        healthy = all(v["status"] == "healthy" for v in inst.values())
        out = {"status": "healthy" if healthy else "unhealthy", "service": "genrm"}
        if len(inst) > 1:
            out["instances"] = inst  # each asleep one has "sleeping": true
        else:
            (only,) = inst.values()
            if only.get("sleeping"):
                out["sleeping"] = True  # the legacy single-instance shape: why generate answers 503
            if only.get("degraded"):  # serving on fewer engines while a dead one is rebuilt
                out.update(degraded=True, engines_working=only["engines_working"], engines=only["engines"])
        if not healthy:
            out["error"] = "; ".join(
                f"{k}: {v.get('error', v['status'])}" for k, v in inst.items() if v["status"] != "healthy"
            )
        # 503 only when some instance cannot answer at all; asleep is healthy (it wakes)
        return Response.json(out, 503 if any(v.get("available") is False for v in inst.values()) else 200)

    async def metrics(self, request: Request) -> Response:
        snap = await self.service.metrics_snapshot(engines=request.query.get("engines") == "1")
        transport = relay.transport_stats()
        rstats = {k: transport.get(k, 0) for k in RELAY_STATS}
        http = dict(self.server.stats)
        if request.query.get("format") == "json":
            return Response.json(
                {"service": "genrm", "instances": snap, "gateway_errors": self.errors, "http": http, "relay": rstats}
            )
        return Response(
            200, prometheus_text(snap, self.errors, rstats, http).encode(), "text/plain; version=0.0.4; charset=utf-8"
        )


async def serve(
    service, host: str = "127.0.0.1", port: int = 8000, token: str | None = None, limits: HttpLimits | None = None
) -> tuple[HttpServer, int]:
    """Serve ``service`` (a JudgeService of this process) on the running loop; returns the
    server (``await server.close()``) and its port. Use :meth:`JudgeService.serve_http`
    from outside."""
    gateway = Gateway(service, token, limits=limits)
    return gateway.server, await gateway.server.start(host, port)
