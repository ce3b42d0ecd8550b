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
- Bodies are framed by Content-Length only: a chunked body is refused with 411 (send a
  Content-Length), another Transfer-Encoding with 501, one beside a Content-Length with 400;
  and a
  Content-Encoding other than identity (415). An absolute-form target
  (``GET http://host/path``) is served at its path (RFC 9112 3.2.2).
- What the server refuses it answers itself with ``{"error": "<why>"}`` and closes: 400
  malformed, 408 too slow, 411 no length, 413 too large (before reading any of the body),
  417 unknown Expect, 431 head too large, 501 Transfer-Encoding, 503 (``Retry-After: 1``)
  over the connection cap when no connection is idle; at the cap a new client otherwise
  takes the place of the connection idle the longest (closed as an idle timeout closes it),
  so idle or trickling connections cannot lock new clients out. After any response that
  closes, the server shuts its sending side and discards what the client still sends for
  up to :data:`LINGER_SECONDS`, so a client still uploading a refused body (or a request
  over the cap) reads the answer rather than a reset.
- A client that closes its side (fully or half) while its handler runs is gone: the
  handler's task is cancelled.
- The server logs nothing: a handler's exception (a 500 for the client, which never sees
  its text) and any fault of the server itself go to ``on_error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl

from .http_messages import (
    BARE_LF,
    BODY_METHODS,
    CONTENT_LENGTH,
    CONTINUE,
    INTERNAL_ERROR,
    HttpLimits,
    Reject,
    Request,
    Response,
    encode_response,
    error_response,
    parse_head,
    parse_request_line,
)

__all__ = ["HttpLimits", "HttpServer", "Request", "Response"]

LINGER_SECONDS = 2.0  # how long a closing connection discards what the client still sends
CLOSE_TIMEOUT = 5.0  # how long close() waits for the cancelled handlers to end

STAT_NAMES = (
    "connections_open",  # a gauge: connections being served (the refused ones are not)
    "connections_total",  # connections served (under the cap)
    "connections_refused",  # answered 503: over max_connections with none idle
    "connections_evicted",  # idle connections closed to make room for a new one at max_connections
    "requests",  # requests given to the handler
    "timeouts_idle",  # closed: no request within idle_timeout, or a response left unread as long
    "timeouts_header",  # 408: the request line and headers took over header_timeout
    "timeouts_body",  # 408: the body took over body_timeout
    "bad_requests",  # every 4xx (408 and 413 included) and 501 the server wrote itself
    "too_large",  # 413
    "disconnects_in_flight",  # clients gone while their handler ran (it was cancelled)
    "handler_errors",  # handlers that raised or returned an invalid Response (a 500)
)


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

    def _longest_idle(self) -> _Connection | None:
        """The connection idle the longest (waiting for its next request), or None."""
        idle = [c for c in self._connections if c.idle()]
        return min(idle, key=lambda c: c._idle_since) if idle else None

    def _release(self, connection: _Connection, handler_running: bool) -> None:
        self._connections.discard(connection)
        self.stats["connections_open"] = len(self._connections)
        if handler_running and not self._closing:
            self.stats["disconnects_in_flight"] += 1

    def _report(self, request: Request | None, exc: BaseException) -> None:
        if self._on_error is not None:
            with contextlib.suppress(Exception):
                self._on_error(request, exc)


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
        self._idle_since = 0.0  # loop time it began waiting for its next request

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        server = self._server
        if server._closing:
            self._state = _State.CLOSED
            self._transport.abort()
            return
        if len(server._connections) >= self._limits.max_connections:
            idle = server._longest_idle()
            if idle is None:  # every connection is busy: 503, lingering so the client reads it (no reset)
                self._stats["connections_refused"] += 1
                self._close_with(encode_response(Response.json({"error": "too many connections"}, 503,
                                                               {"Retry-After": "1"}), False, True))
                return
            # the longest-idle connection makes room: idle ones (or a trickle of cheap requests
            # between long waits) cannot lock new clients out
            self._stats["connections_evicted"] += 1
            idle._evict()
        server._connections.add(self)
        self._stats["connections_total"] += 1
        self._stats["connections_open"] = len(server._connections)
        self._peer = transport.get_extra_info("peername")
        self._idle_since = self._loop.time()
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
                self._close_with(error_response(500, "internal error"))

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
            except Reject as reject:
                self._refuse(reject.status, reject.reason)
                return
        if self._state is _State.READ_BODY and len(self._buffer) >= self._body_length:
            self._dispatch()

    def _take_head(self) -> str | None:
        """The request line and headers, taken from the buffer; None while incomplete.
        Raises Reject as soon as the bytes so far cannot start a valid request."""
        buffer, limit = self._buffer, self._limits.max_header_bytes
        end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3), limit)
        if end >= 0:
            head = buffer[:end].decode("latin-1")
            del buffer[: end + 4]
            self._scanned = 0
            self._request_line_checked = False
            return head
        if len(buffer) >= limit:
            raise Reject(431, f"request line and headers over {limit} bytes")
        if BARE_LF.search(buffer, self._scanned):
            raise Reject(400, "bare LF: lines must end with CRLF")
        if not self._request_line_checked:
            line_end = buffer.find(b"\r\n", max(0, self._scanned - 1))
            if line_end >= 0:
                parse_request_line(buffer[:line_end].decode("latin-1"))
                self._request_line_checked = True
        self._scanned = len(buffer)
        return None

    def _start_request(self, head: str) -> None:
        method, target, version, headers = parse_head(head, self._limits.max_headers)
        coding = headers.get("transfer-encoding")
        if coding is not None:  # framed by Content-Length only (no smuggling surface)
            if "content-length" in headers:
                raise Reject(400, "both Transfer-Encoding and Content-Length: ambiguous framing")
            if coding.strip().lower() == "chunked":  # the client can send the same body with a length: 4xx
                raise Reject(411, "chunked bodies are not accepted; send the body with a Content-Length")
            raise Reject(501, "Transfer-Encoding is not accepted; send a Content-Length")
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise Reject(415, f"Content-Encoding {encoding[:40]!r} is not accepted: send the body uncompressed")
        if target[:8].lower().startswith(("http://", "https://")):  # absolute form (RFC 9112 3.2.2): its path
            rest = target.partition("://")[2]
            target = rest[rest.index("/"):] if "/" in rest else "/"
        if version == "HTTP/1.1" and "host" not in headers:
            raise Reject(400, "missing Host header")
        declared = headers.get("content-length")
        if declared is None:
            if method in BODY_METHODS:
                raise Reject(411, f"{method} needs a Content-Length")
            length = 0
        elif CONTENT_LENGTH.fullmatch(declared):
            length = int(declared)
            if length > self._limits.max_body:
                raise Reject(413, f"body over {self._limits.max_body} bytes")
        else:
            raise Reject(400, "Content-Length must be 1-18 ASCII digits")
        expect = headers.get("expect")
        if expect is not None and expect.lower() != "100-continue":
            raise Reject(417, "only Expect: 100-continue is accepted")
        connection = headers.get("connection")
        self._keep_alive = version == "HTTP/1.1" and (
            connection is None or "close" not in {token.strip().lower() for token in connection.split(",")}
        )
        path, _, query = target.partition("?")
        self._request = Request(
            method,
            target,
            path,
            dict(parse_qsl(query, keep_blank_values=True)) if query else {},
            headers,
            b"",
            version,
            self._peer,
        )
        self._body_length = length
        self._state = _State.READ_BODY
        if len(self._buffer) >= length:
            self._stop_timer()
            return
        if expect is not None and version == "HTTP/1.1":  # an HTTP/1.0 client's Expect is ignored
            self._transport.write(CONTINUE)
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
            data = encode_response(await self._server._handler(request), head_only, not self._keep_alive)
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
        return encode_response(INTERNAL_ERROR, head_only, not self._keep_alive)

    def _next_request(self) -> None:
        self._state = _State.AWAIT_REQUEST
        if self._reading_paused:
            self._reading_paused = False
            self._transport.resume_reading()
        if self._buffer:
            self._process()
        else:
            self._idle_since = self._loop.time()
            self._set_timer(self._limits.idle_timeout, self._idle_expired)

    def _refuse(self, status: int, reason: str) -> None:
        self._stats["bad_requests"] += 1
        if status == 413:
            self._stats["too_large"] += 1
        self._close_with(error_response(status, reason))

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

    def idle(self) -> bool:
        """Waiting for its next request, nothing of it received."""
        return self._state is _State.AWAIT_REQUEST and not self._buffer

    def _evict(self) -> None:
        """Close an idle connection to make room for a new client (as an idle timeout would)."""
        self._stop_timer()
        self._state = _State.CLOSING
        self._server._release(self, False)
        self._transport.close()

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
