"""A small, strict HTTP/1.1 server on asyncio (an ``asyncio.Protocol``; runs on uvloop too),
serving the judge's HTTP gateway.

We serve ourselves because aiohttp cannot bound how long a client takes to send its headers
or body, caps no connections, and answers ``100 Continue`` to any Content-Length. Here
everything a client can make the server hold is bounded (:class:`HttpLimits`): the bytes of
a request line and headers, their number, the body, the time to send each, the time a
connection may sit idle, the number of connections.

Contracts:

- HTTP/1.1 keep-alive; HTTP/1.0 or ``Connection: close`` closes after the response.
  Pipelined requests are answered in order, one handler at a time per connection; while a
  handler runs the server stops reading once it holds ``max_header_bytes + max_body``
  unprocessed bytes. A pipelined request's header time starts when its turn comes.
- Bodies are framed by Content-Length only: any Transfer-Encoding is refused (501).
- What the server refuses it answers itself with ``{"error": "<why>"}`` and closes: 400
  malformed, 408 too slow, 411 no length, 413 too large (before reading any of the body),
  417 unknown Expect, 431 head too large, 501 Transfer-Encoding, 503 over the connection
  cap. After any response that closes, the server shuts its sending side and discards what
  the client still sends for up to :data:`LINGER_SECONDS`, so a client still uploading a
  refused body reads the answer rather than a reset.
- A client that closes its side (fully or half) while its handler runs is gone: the
  handler's task is cancelled.
- The server logs nothing: a handler's exception (a 500 for the client, which never sees
  its text) and any fault of the server itself go to ``on_error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import parse_qsl

LINGER_SECONDS = 2.0  # how long a closing connection discards what the client still sends
CLOSE_TIMEOUT = 5.0  # how long close() waits for the cancelled handlers to end

STAT_NAMES = (
    "connections_open",  # a gauge: connections being served (the refused ones are not)
    "connections_total",  # connections served (under the cap)
    "connections_refused",  # answered 503: over max_connections
    "requests",  # requests given to the handler
    "timeouts_idle",  # closed: no request within idle_timeout, or a response left unread as long
    "timeouts_header",  # 408: the request line and headers took over header_timeout
    "timeouts_body",  # 408: the body took over body_timeout
    "bad_requests",  # every 4xx (408 and 413 included) and 501 the server wrote itself
    "too_large",  # 413
    "disconnects_in_flight",  # clients gone while their handler ran (it was cancelled)
    "handler_errors",  # handlers that raised or returned an invalid Response (a 500)
)

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_TOKEN_RE = re.compile(_TOKEN)
_REQUEST_LINE = re.compile(rf"({_TOKEN}) ([\x21-\x7e]+) (HTTP/1\.[01])")
_FIELD_VALUE = r"[^\x00-\x08\x0a-\x1f\x7f]*"  # visible characters, SP, HTAB and obs-text
_FIELD_VALUE_RE = re.compile(_FIELD_VALUE)
_HEADER_LINE = re.compile(rf"({_TOKEN}):({_FIELD_VALUE})")
_CONTENT_LENGTH = re.compile(r"[0-9]{1,18}")
_BARE_LF = re.compile(rb"(?<!\r)\n")
_UNIQUE_HEADERS = frozenset({"content-length", "host", "authorization", "content-type", "transfer-encoding"})
_SERVER_HEADERS = frozenset({"content-length", "content-type", "connection", "transfer-encoding", "date"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_REASONS = {status.value: status.phrase for status in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass(frozen=True)
class HttpLimits:
    """What one client may make the server hold. Sizes are positive ints, times positive
    finite seconds (ValueError otherwise)."""

    max_body: int = 1 << 20  # bytes of a request body
    max_header_bytes: int = 16384  # request line + headers
    max_headers: int = 64
    header_timeout: float = 10.0  # from a request's first byte to the end of its headers
    body_timeout: float = 30.0  # from the end of the headers to the end of the body
    idle_timeout: float = 60.0  # no byte of a (next) request this long after connect / the last response -> close
    max_connections: int = 512  # one more is answered 503 and closed at once; the others are unaffected

    def __post_init__(self) -> None:
        for name in ("max_body", "max_header_bytes", "max_headers", "max_connections"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"HttpLimits.{name} must be a positive int, got {value!r}")
        for name in ("header_timeout", "body_timeout", "idle_timeout"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not 0 < value < math.inf:
                raise ValueError(f"HttpLimits.{name} must be a positive finite number of seconds, got {value!r}")


@dataclass
class Request:
    """One parsed request, as the handler gets it."""

    method: str  # upper-case token as sent
    target: str  # raw request target
    path: str  # target before '?', percent-decoding NOT applied
    query: dict[str, str]  # parsed with urllib.parse.parse_qsl (last value wins)
    headers: dict[str, str]  # lower-case names -> value (surrounding whitespace stripped)
    body: bytes
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    peer: tuple | None


@dataclass
class Response:
    """What a handler returns. ``status`` is 200-599; ``headers`` may not set
    Content-Length, Content-Type, Connection, Transfer-Encoding or Date (the server writes
    those); an invalid Response is answered 500 and reported like a handler's exception."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj, status: int = 200, headers: dict | None = None) -> Response:
        """``obj`` as JSON, spaced as ``json.dumps`` writes it (as aiohttp's ``json_response``
        did: ``{"status": "healthy", "service": "genrm"}``); non-ASCII escaped, so valid UTF-8
        whatever it holds."""
        return cls(status, json.dumps(obj).encode(), headers=dict(headers or {}))


_INTERNAL_ERROR = Response.json({"error": "internal error"}, 500)


class HttpServer:
    """Serves ``handler`` on one TCP address of the running loop (see the module's
    contracts). ``on_error(request, exc)`` hears of each handler exception (``request`` the
    one it was handling) and of any fault of the server itself (``request`` None); its own
    exceptions are ignored. ``stats`` counts what happened (:data:`STAT_NAMES`)."""

    def __init__(
        self,
        handler: Callable[[Request], Awaitable[Response]],
        limits: HttpLimits = HttpLimits(),
        on_error: Callable[[Request | None, BaseException], None] | None = None,
    ):
        self.limits = limits
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self._handler = handler
        self._on_error = on_error
        self._listener: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self._closing = False

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0: any free port); return the bound port. OSError if the
        address cannot be bound; RuntimeError if started before."""
        if self._listener is not None or self._closing:
            raise RuntimeError("an HttpServer starts once")
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(lambda: _Connection(self, loop), host, port)
        return self._listener.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, close every connection at once, cancel the running handlers and
        wait (at most :data:`CLOSE_TIMEOUT` s) for them to end. Idempotent."""
        self._closing = True
        if self._listener is not None:
            self._listener.close()
        handlers = [task for connection in list(self._connections) if (task := connection.abort()) is not None]
        self._connections.clear()
        self.stats["connections_open"] = 0
        if handlers:
            await asyncio.wait(handlers, timeout=CLOSE_TIMEOUT)
        if self._listener is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._listener.wait_closed(), CLOSE_TIMEOUT)

    def _release(self, connection: _Connection, handler_running: bool) -> None:
        self._connections.discard(connection)
        self.stats["connections_open"] = len(self._connections)
        if handler_running and not self._closing:
            self.stats["disconnects_in_flight"] += 1

    def _report(self, request: Request | None, exc: BaseException) -> None:
        if self._on_error is not None:
            with contextlib.suppress(Exception):
                self._on_error(request, exc)


class _Reject(Exception):
    """A request the server answers itself (``status``, a short reason) and closes on."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class _State(enum.Enum):
    AWAIT_REQUEST = enum.auto()  # no byte of the next request yet (idle timer)
    READ_HEAD = enum.auto()  # the request line and headers are incomplete (header timer)
    READ_BODY = enum.auto()  # the body is incomplete (body timer)
    HANDLING = enum.auto()  # the handler runs; what arrives meanwhile is buffered
    AWAIT_DRAIN = enum.auto()  # the client has not read our responses yet (idle timer)
    CLOSING = enum.auto()  # answered and closing: what the client still sends is discarded
    CLOSED = enum.auto()


class _Connection(asyncio.Protocol):
    """One client connection: a state machine driven by the transport's callbacks and one
    timer (``loop.call_later``) for whichever deadline the state has."""

    def __init__(self, server: HttpServer, loop: asyncio.AbstractEventLoop):
        self._server = server
        self._limits = server.limits
        self._stats = server.stats
        self._loop = loop
        self._pause_above = server.limits.max_header_bytes + server.limits.max_body
        self._transport: asyncio.Transport
        self._peer: tuple | None = None
        self._state = _State.AWAIT_REQUEST
        self._buffer = bytearray()
        self._scanned = 0  # bytes of an incomplete head already checked
        self._request_line_checked = False
        self._timer: asyncio.TimerHandle | None = None
        self._request: Request | None = None  # its head parsed, its body awaited or handled
        self._body_length = 0
        self._keep_alive = True
        self._task: asyncio.Task | None = None
        self._reading_paused = False
        self._writing_paused = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        server = self._server
        if server._closing:
            self._state = _State.CLOSED
            self._transport.abort()
            return
        if len(server._connections) >= self._limits.max_connections:
            self._state = _State.CLOSED
            self._stats["connections_refused"] += 1
            self._transport.write(_error_response(503, "too many connections"))
            self._transport.close()
            return
        server._connections.add(self)
        self._stats["connections_total"] += 1
        self._stats["connections_open"] = len(server._connections)
        self._peer = transport.get_extra_info("peername")
        self._set_timer(self._limits.idle_timeout, self._idle_expired)

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state is _State.HANDLING or state is _State.AWAIT_DRAIN:
            self._buffer += data
            if not self._reading_paused and len(self._buffer) > self._pause_above:
                self._reading_paused = True
                self._transport.pause_reading()
        elif state is not _State.CLOSING and state is not _State.CLOSED:
            self._buffer += data
            self._process()

    def connection_lost(self, exc: Exception | None) -> None:
        self._state = _State.CLOSED
        self._stop_timer()
        self._buffer.clear()
        task = self._task
        handler_running = task is not None and not task.done()
        self._server._release(self, handler_running)
        if handler_running:
            task.cancel()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._state is _State.AWAIT_DRAIN:
            self._next_request()

    # called by HttpServer.close()

    def abort(self) -> asyncio.Task | None:
        """Close at once; return the handler's task, cancelled, if one runs."""
        self._state = _State.CLOSED
        self._stop_timer()
        self._transport.abort()
        task = self._task
        if task is None or task.done():
            return None
        task.cancel()
        return task

    # reading requests

    def _process(self) -> None:
        try:
            self._advance()
        except Exception as exc:  # a fault of this module: reported, and only this client sees it
            self._server._report(None, exc)
            if self._state is not _State.CLOSING and self._state is not _State.CLOSED:
                self._close_with(_error_response(500, "internal error"))

    def _advance(self) -> None:
        if self._state is _State.AWAIT_REQUEST:
            if not self._buffer:
                return
            self._stop_timer()
            self._state = _State.READ_HEAD
        if self._state is _State.READ_HEAD:
            try:
                head = self._take_head()
                if head is None:
                    if self._timer is None:
                        self._set_timer(self._limits.header_timeout, self._header_expired)
                    return
                self._start_request(head)
            except _Reject as reject:
                self._refuse(reject.status, reject.reason)
                return
        if self._state is _State.READ_BODY and len(self._buffer) >= self._body_length:
            self._dispatch()

    def _take_head(self) -> str | None:
        """The request line and headers, taken from the buffer; None while incomplete.
        Raises _Reject as soon as the bytes so far cannot start a valid request."""
        buffer, limit = self._buffer, self._limits.max_header_bytes
        end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3), limit)
        if end >= 0:
            head = buffer[:end].decode("latin-1")
            del buffer[: end + 4]
            self._scanned = 0
            self._request_line_checked = False
            return head
        if len(buffer) >= limit:
            raise _Reject(431, f"request line and headers over {limit} bytes")
        if _BARE_LF.search(buffer, self._scanned):
            raise _Reject(400, "bare LF: lines must end with CRLF")
        if not self._request_line_checked:
            line_end = buffer.find(b"\r\n", max(0, self._scanned - 1))
            if line_end >= 0:
                _parse_request_line(buffer[:line_end].decode("latin-1"))
                self._request_line_checked = True
        self._scanned = len(buffer)
        return None

    def _start_request(self, head: str) -> None:
        method, target, version, headers = _parse_head(head, self._limits.max_headers)
        if "transfer-encoding" in headers:
            raise _Reject(501, "Transfer-Encoding is not accepted; send a Content-Length")
        if version == "HTTP/1.1" and "host" not in headers:
            raise _Reject(400, "missing Host header")
        declared = headers.get("content-length")
        if declared is None:
            if method in _BODY_METHODS:
                raise _Reject(411, f"{method} needs a Content-Length")
            length = 0
        elif _CONTENT_LENGTH.fullmatch(declared):
            length = int(declared)
            if length > self._limits.max_body:
                raise _Reject(413, f"body over {self._limits.max_body} bytes")
        else:
            raise _Reject(400, "Content-Length must be 1-18 ASCII digits")
        expect = headers.get("expect")
        if expect is not None and expect.lower() != "100-continue":
            raise _Reject(417, "only Expect: 100-continue is accepted")
        connection = headers.get("connection")
        self._keep_alive = version == "HTTP/1.1" and (
            connection is None or "close" not in {token.strip().lower() for token in connection.split(",")}
        )
        path, _, query = target.partition("?")
        self._request = Request(
            method, target, path, dict(parse_qsl(query, keep_blank_values=True)) if query else {}, headers, b"", version, self._peer
        )
        self._body_length = length
        self._state = _State.READ_BODY
        if len(self._buffer) >= length:
            self._stop_timer()
            return
        if expect is not None and version == "HTTP/1.1":  # an HTTP/1.0 client's Expect is ignored
            self._transport.write(_CONTINUE)
        self._set_timer(self._limits.body_timeout, self._body_expired)

    def _dispatch(self) -> None:
        request = self._request
        if self._body_length:
            request.body = bytes(self._buffer[: self._body_length])
            del self._buffer[: self._body_length]
        self._stop_timer()
        self._state = _State.HANDLING
        self._stats["requests"] += 1
        self._task = self._loop.create_task(self._respond(request))

    # answering

    async def _respond(self, request: Request) -> None:
        head_only = request.method == "HEAD"
        try:
            data = _encode(await self._server._handler(request), head_only, not self._keep_alive)
        except asyncio.CancelledError as exc:
            if self._state is not _State.HANDLING:  # cancelled here: the client left, or close()
                raise
            data = self._handler_failed(request, exc, head_only)  # a CancelledError of its own
        except Exception as exc:
            data = self._handler_failed(request, exc, head_only)
        if self._state is not _State.HANDLING:  # the handler outlived its connection
            return
        if not self._keep_alive:
            self._close_with(data)
            return
        self._transport.write(data)
        if self._writing_paused:
            self._state = _State.AWAIT_DRAIN
            self._set_timer(self._limits.idle_timeout, self._drain_expired)
        else:
            self._next_request()

    def _handler_failed(self, request: Request, exc: BaseException, head_only: bool) -> bytes:
        self._stats["handler_errors"] += 1
        self._server._report(request, exc)
        return _encode(_INTERNAL_ERROR, head_only, not self._keep_alive)

    def _next_request(self) -> None:
        self._state = _State.AWAIT_REQUEST
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        if self._buffer:
            self._process()
        else:
            self._set_timer(self._limits.idle_timeout, self._idle_expired)

    def _refuse(self, status: int, reason: str) -> None:
        self._stats["bad_requests"] += 1
        if status == 413:
            self._stats["too_large"] += 1
        self._close_with(_error_response(status, reason))

    def _close_with(self, data: bytes) -> None:
        """Send ``data``, then FIN; discard what the client still sends until it closes or
        LINGER_SECONDS pass."""
        self._state = _State.CLOSING
        self._buffer.clear()
        self._transport.write(data)
        self._transport.write_eof()
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        self._set_timer(LINGER_SECONDS, self._transport.abort)

    # deadlines

    def _set_timer(self, delay: float, callback: Callable[[], object]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(delay, callback)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_expired(self) -> None:
        self._stats["timeouts_idle"] += 1
        self._state = _State.CLOSING
        self._transport.close()

    def _drain_expired(self) -> None:
        self._stats["timeouts_idle"] += 1
        self._state = _State.CLOSING
        self._transport.abort()

    def _header_expired(self) -> None:
        self._stats["timeouts_header"] += 1
        self._refuse(408, f"request line and headers not received within {self._limits.header_timeout:g} s")

    def _body_expired(self) -> None:
        self._stats["timeouts_body"] += 1
        self._refuse(408, f"body not received within {self._limits.body_timeout:g} s")


def _parse_request_line(line: str) -> tuple[str, str, str]:
    match = _REQUEST_LINE.fullmatch(line)
    if match is not None:
        return match.group(1), match.group(2), match.group(3)
    if "\r" in line or "\n" in line:
        raise _Reject(400, "bare CR or LF: lines must end with CRLF")
    parts = line.split(" ")
    if len(parts) != 3:
        raise _Reject(400, "the request line must be METHOD SP target SP HTTP-version")
    method, _, version = parts
    if not _TOKEN_RE.fullmatch(method):
        raise _Reject(400, "invalid method")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise _Reject(400, "only HTTP/1.0 and HTTP/1.1 are served")
    raise _Reject(400, "invalid request target")


def _parse_head(head: str, max_headers: int) -> tuple[str, str, str, dict[str, str]]:
    """(method, target, version, headers) of a head without its final CRLFCRLF."""
    lines = head.split("\r\n")
    method, target, version = _parse_request_line(lines[0])
    if len(lines) - 1 > max_headers:
        raise _Reject(431, f"more than {max_headers} headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        match = _HEADER_LINE.fullmatch(line)
        if match is None:
            raise _Reject(400, _header_line_problem(line))
        name, value = match.group(1).lower(), match.group(2).strip(" \t")
        if name not in headers:
            headers[name] = value
        elif name in _UNIQUE_HEADERS:
            raise _Reject(400, f"repeated {name} header")
        else:
            headers[name] += ", " + value
    return method, target, version, headers


def _header_line_problem(line: str) -> str:
    if line[:1] in (" ", "\t"):
        return "obsolete line folding is not accepted"
    if "\r" in line or "\n" in line:
        return "bare CR or LF: lines must end with CRLF"
    name, colon, _ = line.partition(":")
    if not colon:
        return "header line without a colon"
    if not _TOKEN_RE.fullmatch(name):
        return "invalid header name"
    return "invalid character in a header value"


@functools.lru_cache(maxsize=1)
def _http_date(second: int) -> str:
    return formatdate(second, usegmt=True)


def _encode(response: Response, head_only: bool, close: bool) -> bytes:
    """The bytes of ``response``; ValueError/TypeError when it is not a valid Response."""
    if not isinstance(response, Response):
        raise TypeError(f"the handler returned a {type(response).__name__}, not a Response")
    status, body = response.status, response.body
    if type(status) is not int or not 200 <= status <= 599:
        raise ValueError(f"Response.status must be an int in 200..599, got {status!r}")
    if not isinstance(body, bytes):
        raise TypeError(f"Response.body must be bytes, got a {type(body).__name__}")
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\nDate: {_http_date(int(time.time()))}\r\n"]
    if status != 204:
        lines.append(f"Content-Length: {len(body)}\r\n")
    if response.content_type:
        if not _FIELD_VALUE_RE.fullmatch(response.content_type):
            raise ValueError(f"Response.content_type {response.content_type!r} is not a valid header value")
        lines.append(f"Content-Type: {response.content_type}\r\n")
    if close:
        lines.append("Connection: close\r\n")
    for name, value in response.headers.items():
        if not _TOKEN_RE.fullmatch(name) or name.lower() in _SERVER_HEADERS:
            raise ValueError(f"Response.headers: {name!r} is not a header a handler may set")
        if not _FIELD_VALUE_RE.fullmatch(value):
            raise ValueError(f"Response.headers[{name!r}] = {value!r} is not a valid header value")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    head = "".join(lines).encode()
    return head if head_only or status in (204, 304) else head + body


def _error_response(status: int, reason: str) -> bytes:
    return _encode(Response.json({"error": reason}, status), head_only=False, close=True)
