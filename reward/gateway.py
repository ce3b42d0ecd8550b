"""The HTTP judge gateway: ``POST /genrm/generate`` (chat messages, or an SGLang-native
``text`` / ``input_ids`` payload), ``GET /genrm/health``, ``GET /genrm/metrics`` (the
original's JSON; Prometheus text for ``Accept: text/plain``), ``GET /metrics`` (Prometheus
text), and the OpenAI-compatible ``GET /genrm/v1/models`` and ``POST
/genrm/v1/chat/completions`` (:mod:`reward.openai_api`). Binds 127.0.0.1:8000 by default;
an optional bearer token.

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
from .openai_api import OpenAIRoutes
from .protocol import check_native, check_request, health_body, metrics_body
from .scaling import ScalingRoutes

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
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NATIVE_FIELDS = ("text", "input_ids")


def validate_request(body) -> tuple[list | str, dict | None, str | None]:
    """Return (messages, sampling_params, route_key) of a JSON body, or for an SGLang-native
    body (no ``messages``, a ``text`` prompt string or ``input_ids``) (prompt text or token
    ids, sampling_params, route_key); or raise ValueError with the reason
    (:class:`~reward.errors.BadMessages` for malformed messages)."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object with 'messages' (or a native 'text' or 'input_ids')")
    if body.get("stream") not in (None, False):
        raise ValueError("stream=true is not supported: the judge answers with one JSON body")
    # other top-level fields are ignored, as the original ignores them; a chat and a native
    # prompt together are ambiguous
    native = [k for k in NATIVE_FIELDS if k in body]
    if "messages" in body and native:
        raise ValueError(f"give 'messages' or a native {' / '.join(native)}, not both")
    if "messages" not in body and native:
        return check_native(body.get("text"), body.get("input_ids"), body.get("sampling_params"), body.get("route_key"))
    return check_request(body.get("messages"), body.get("sampling_params"), body.get("route_key"))


def wants_prometheus(accept: str) -> bool:
    """Whether an ``Accept`` header asks for Prometheus text (``text/plain`` or OpenMetrics,
    as Prometheus sends) over JSON."""
    best: dict[str, float] = {}
    for item in accept.split(","):
        media, *params = (x.strip() for x in item.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        media = media.lower()
        best[media] = max(best.get(media, 0.0), q)
    text = max(best.get("text/plain", 0.0), best.get("application/openmetrics-text", 0.0))
    return text > 0 and text >= best.get("application/json", 0.0)


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

    def __init__(self, service, token: str | None = None, timeout: float = 600.0, limits: HttpLimits | None = None,
                 unhealthy_status: int = 200):
        self.service = service
        self.unhealthy_status = unhealthy_status  # GET /genrm/health when an instance cannot serve
        self.token = token.encode() if token else None
        self.timeout = timeout
        self.limits = limits or HttpLimits()
        self.errors: dict[str, int] = {}
        self.started = time.time()
        self.server = HttpServer(self.handle, self.limits, on_error=self._internal_error)
        self._log = _Throttled()
        self._names = frozenset(n.lower() for n in ("localhost", socket.gethostname(), socket.getfqdn()))
        openai = OpenAIRoutes(self)
        self._routes = {
            "/genrm/generate": ("POST", self.generate),
            "/genrm/health": ("GET", self.health),
            "/genrm/metrics": ("GET", self.metrics),
            "/genrm/engines": ("GET", self.engines),
            "/metrics": ("GET", self.prometheus),
            "/genrm/v1/models": ("GET", openai.models),
            "/genrm/v1/chat/completions": ("POST", openai.chat_completions),
            "/genrm/chat/completions": ("POST", openai.chat_completions),
        }
        scaling = ScalingRoutes(self)
        self._routes.update(scaling.routes())
        self._prefixes = scaling.prefixes()  # path prefix -> route: /genrm/scale_out/{request_id}, ...

    def _count(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def _internal_error(self, request: Request | None, exc: BaseException) -> None:
        self._count("internal")
        where = f"{request.method} {short_repr(request.path)}" if request is not None else "a connection"
        self._log("internal", f"internal error on {where}: {type(exc).__name__}: {short_repr(str(exc), 200)}")

    async def handle(self, request: Request) -> Response:
        if self.token:  # with a token, nothing (not even the route list) before authentication
            refused = self._authorize(request)
            if refused is not None:
                return refused
        route = self._routes.get(request.path) or next(
            (r for prefix, r in self._prefixes.items() if request.path.startswith(prefix)), None)
        if route is None:
            self._count("not_found")
            return _error(f"no route {short_repr(request.path)}; routes: {', '.join(self._routes)}", 404)
        method, handler = route
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            self._count("method_not_allowed")
            return _error(
                f"{short_repr(request.method)} is not allowed on {request.path}; use {method}", 405, {"Allow": method}
            )
        refused = None if self.token else self._same_host(request)
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

    def read_json(self, request: Request) -> tuple[object, Response | None]:
        """The JSON body of a POST, or the 415/400 answer (the error shape is the caller's:
        ``make_error(message, status)``)."""
        content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if content_type != "application/json":
            self._count("unsupported_media_type")
            return None, (415, "send the body as JSON with 'Content-Type: application/json'")
        try:
            return json.loads(request.body), None
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, long integers; deep nesting
            self._count("invalid_json")
            reason = "nested too deeply" if isinstance(e, RecursionError) else short_repr(str(e), 160)
            return None, (400, f"Invalid request body: not JSON ({reason})")

    async def outcome(self, submit) -> tuple[object, tuple | None]:
        """Run ``submit()`` (the service's submit of one request, returning a future) and wait
        for it: (result, None), or (None, (status, message, headers)) for its error."""
        try:
            return await asyncio.wait_for(submit(), self.timeout), None
        except JudgeAsleep as e:
            self._count("asleep")
            return None, (503, str(e), {"Retry-After": "1"})
        except BadMessages as e:  # the chat template refused the messages
            self._count("invalid_request")
            return None, (422, f"Invalid request body: {e}", None)
        except (UnknownRouteKey, ValueError, TypeError) as e:
            self._count("invalid_request")
            return None, (400, str(e), None)
        except JudgeUnavailable as e:
            self._count("unavailable")
            return None, (503, str(e), {"Retry-After": "5"})
        except JudgeEngineError as e:
            self._count("engine")
            return None, (502, str(e), None)
        except TimeoutError:
            self._count("timeout")
            return None, (503, f"the judge did not answer within {self.timeout:g} s", None)

    async def generate(self, request: Request) -> Response:
        body, refused = self.read_json(request)
        if refused is not None:
            return _error(refused[1], refused[0])
        try:
            prompt, sampling_params, route_key = validate_request(body)
        except ValueError as e:
            self._count("invalid_request")
            return _error(f"Invalid request body: {e}", 422 if isinstance(e, BadMessages) else 400)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):  # chat messages (checked above)
            text, failed = await self.outcome(
                lambda: self.service.submit(prompt, sampling_params, route_key, checked=True)
            )
        else:  # a native payload: prompt text or token ids
            text, failed = await self.outcome(lambda: self.service.submit_native(prompt, sampling_params, route_key))
        if failed is not None:
            return _error(failed[1], failed[0], failed[2])
        return Response.json({"response": text})

    async def health(self, request: Request) -> Response:
        try:
            inst = await self.service.health()
        except Exception as e:  # noqa: BLE001 - reported, not raised
            return Response.json({"status": "unhealthy", "service": "genrm", "error": short_repr(str(e), 200)},
                                 self.unhealthy_status)
        # unhealthy only when some instance cannot answer at all; asleep is healthy (it wakes).
        # The original answers 200 with the body; a watchdog that reads the status asks for 503
        unhealthy = any(v.get("available") is False for v in inst.values())
        return Response.json(health_body(inst), self.unhealthy_status if unhealthy else 200)

    async def engines(self, request: Request) -> Response:
        """Each instance's engines: place, state and load (``JudgeService.engines_report``)."""
        return Response.json({"service": "genrm", "instances": await self.service.engines_report()})

    async def metrics(self, request: Request) -> Response:
        """The original's JSON (:func:`reward.protocol.metrics_body`) with our counters, the
        gateway's errors, its HTTP server's and the relay runtime's counters; Prometheus text
        when the request's ``Accept`` asks for it (or ``?format=prometheus``)."""
        if request.query.get("format") == "prometheus" or (
            request.query.get("format") != "json" and wants_prometheus(request.headers.get("accept", ""))
        ):
            return await self.prometheus(request)
        snap = await self.service.metrics_snapshot(engines=request.query.get("engines") == "1")
        transport = relay.transport_stats()
        body = metrics_body(snap)
        body.update(
            gateway_errors=self.errors,
            http=dict(self.server.stats),
            relay={k: transport.get(k, 0) for k in RELAY_STATS},
        )
        return Response.json(body)

    async def prometheus(self, request: Request) -> Response:
        snap = await self.service.metrics_snapshot()
        transport = relay.transport_stats()
        rstats = {k: transport.get(k, 0) for k in RELAY_STATS}
        text = prometheus_text(snap, self.errors, rstats, dict(self.server.stats))
        return Response(200, text.encode(), PROMETHEUS_TYPE)


async def serve(
    service, host: str = "127.0.0.1", port: int = 8000, token: str | None = None, limits: HttpLimits | None = None,
    unhealthy_status: int = 200,
) -> tuple[HttpServer, int]:
    """Serve ``service`` (a JudgeService of this process) on the running loop; returns the
    server (``await server.close()``) and its port. ``unhealthy_status``: the health route's
    status when an instance cannot serve (200, as the original, or 503). Use
    :meth:`JudgeService.serve_http` from outside."""
    gateway = Gateway(service, token, limits=limits, unhealthy_status=unhealthy_status)
    return gateway.server, await gateway.server.start(host, port)


def within_fd_limit(limits):
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
        log.warning(
            "judge gateway: the open-file limit (%d) holds %d connections, not %d: capping there",
            soft,
            cap,
            limits.max_connections,
        )
        return dataclasses.replace(limits, max_connections=cap)
    return limits
