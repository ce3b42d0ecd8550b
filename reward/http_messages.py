"""The messages of :mod:`reward.httpd`: its limits, requests and responses, and the strict
parsing and encoding of HTTP/1.1 heads (request line, headers, Content-Length) that the
server applies. Pure functions and data: no sockets here."""

from __future__ import annotations

import functools
import json
import math
import re
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_TOKEN_RE = re.compile(_TOKEN)
_REQUEST_LINE = re.compile(rf"({_TOKEN}) ([\x21-\x7e]+) (HTTP/1\.[01])")
_FIELD_VALUE = r"[^\x00-\x08\x0a-\x1f\x7f]*"  # visible characters, SP, HTAB and obs-text
_FIELD_VALUE_RE = re.compile(_FIELD_VALUE)
_HEADER_LINE = re.compile(rf"({_TOKEN}):({_FIELD_VALUE})")
CONTENT_LENGTH = re.compile(r"[0-9]{1,18}")
BARE_LF = re.compile(rb"(?<!\r)\n")
_UNIQUE_HEADERS = frozenset({"content-length", "host", "authorization", "content-type", "transfer-encoding"})
_SERVER_HEADERS = frozenset({"content-length", "content-type", "connection", "transfer-encoding", "date"})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_REASONS = {status.value: status.phrase for status in HTTPStatus}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"



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


INTERNAL_ERROR = Response.json({"error": "internal error"}, 500)


class Reject(Exception):
    """A request the server answers itself (``status``, a short reason) and closes on."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason



def parse_request_line(line: str) -> tuple[str, str, str]:
    match = _REQUEST_LINE.fullmatch(line)
    if match is not None:
        return match.group(1), match.group(2), match.group(3)
    if "\r" in line or "\n" in line:
        raise Reject(400, "bare CR or LF: lines must end with CRLF")
    parts = line.split(" ")
    if len(parts) != 3:
        raise Reject(400, "the request line must be METHOD SP target SP HTTP-version")
    method, _, version = parts
    if not _TOKEN_RE.fullmatch(method):
        raise Reject(400, "invalid method")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise Reject(400, "only HTTP/1.0 and HTTP/1.1 are served")
    raise Reject(400, "invalid request target")


def parse_head(head: str, max_headers: int) -> tuple[str, str, str, dict[str, str]]:
    """(method, target, version, headers) of a head without its final CRLFCRLF."""
    lines = head.split("\r\n")
    method, target, version = parse_request_line(lines[0])
    if len(lines) - 1 > max_headers:
        raise Reject(431, f"more than {max_headers} headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        match = _HEADER_LINE.fullmatch(line)
        if match is None:
            raise Reject(400, _header_line_problem(line))
        name, value = match.group(1).lower(), match.group(2).strip(" \t")
        if name not in headers:
            headers[name] = value
        elif name in _UNIQUE_HEADERS:
            raise Reject(400, f"repeated {name} header")
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


def encode_response(response: Response, head_only: bool, close: bool) -> bytes:
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


def error_response(status: int, reason: str) -> bytes:
    return encode_response(Response.json({"error": reason}, status), head_only=False, close=True)

