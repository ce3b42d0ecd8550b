"""reward.httpd against hostile clients: raw sockets, small timeouts, on the default event
loop and on uvloop. Each test bounds itself (5 s) and fails if it leaves a task running."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import random

import aiohttp
import pytest
import uvloop

from reward import httpd
from reward.httpd import HttpLimits, HttpServer, Request, Response

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

FAST = {"header_timeout": 0.3, "body_timeout": 0.3, "idle_timeout": 0.3}
LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
GET = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"


@pytest.fixture(params=list(LOOPS))
def run(request, caplog):
    """Run a test coroutine on a fresh loop of each kind, bounded; fail if it leaves a task
    running or anything is logged (asyncio logs what a protocol or a task lets escape)."""

    def run_on_loop(coro, timeout: float = 5.0):
        loop = LOOPS[request.param]()
        try:
            result = loop.run_until_complete(asyncio.wait_for(coro, timeout))
            left = [task for task in asyncio.all_tasks(loop) if not task.done()]
            assert not left, f"tasks left running: {left}"
        finally:
            loop.close()
        gc.collect()  # "Task exception was never retrieved" is logged when the task is collected
        assert not caplog.records, [record.getMessage() for record in caplog.records]
        return result

    return run_on_loop


async def echo(request: Request) -> Response:
    return Response.json({"path": request.path, "body": request.body.decode("latin-1")})


@contextlib.asynccontextmanager
async def serving(handler=echo, on_error=None, **limits):
    server = HttpServer(handler, HttpLimits(**{**FAST, **limits}), on_error)
    port = await server.start()
    try:
        yield server, port
    finally:
        await server.close()


async def connect(port: int):
    return await asyncio.open_connection("127.0.0.1", port)


def split_head(head: bytes) -> tuple[int, dict[str, str]]:
    status_line, *lines = head.decode("latin-1").split("\r\n")
    return int(status_line.split(" ")[1]), {
        name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)
    }


async def read_response(reader: asyncio.StreamReader, head_only: bool = False) -> tuple[int, dict[str, str], bytes]:
    status, headers = split_head((await reader.readuntil(b"\r\n\r\n"))[:-4])
    body = b"" if head_only else await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


async def read_to_close(reader: asyncio.StreamReader, timeout: float = 2.0) -> bytes:
    """Everything until the server closes (a reset counts as closed)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    except ConnectionResetError:
        return b""


async def exchange(port: int, data: bytes, timeout: float = 2.0) -> bytes:
    """Send ``data`` on a fresh connection; return all the server sends before closing."""
    reader, writer = await connect(port)
    try:
        writer.write(data)
        return await read_to_close(reader, timeout)
    finally:
        writer.close()


def parse_responses(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    responses = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        status, headers = split_head(head)
        length = int(headers.get("content-length", "0"))
        responses.append((status, headers, data[:length]))
        data = data[length:]
    return responses


def test_limits_are_validated():
    assert HttpLimits().max_body == 1 << 20
    bad = [
        ("max_body", 0),
        ("max_body", 1.5),
        ("max_header_bytes", "16384"),
        ("max_headers", True),
        ("max_connections", -1),
        ("header_timeout", 0),
        ("body_timeout", math.nan),
        ("idle_timeout", math.inf),
        ("idle_timeout", "1"),
    ]
    for name, value in bad:
        with pytest.raises(ValueError, match=f"HttpLimits.{name} must be a positive"):
            HttpLimits(**{name: value})


def test_requests_are_parsed_and_the_connection_kept_alive(run):
    seen: list[Request] = []

    async def handler(request: Request) -> Response:
        seen.append(request)
        return Response.json({"ok": True}, headers={"X-Seen": str(len(seen))})

    async def main():
        async with serving(handler) as (server, port):
            reader, writer = await connect(port)
            writer.write(
                b"GET /a/%7Eb?x=1&y=2&x=3&z= HTTP/1.1\r\nHost: h\r\nX-Dup: 1\r\nx-dup: 2\r\nX-Pad:  v \t\r\n\r\n"
            )
            status, headers, body = await read_response(reader)
            assert (status, body, headers["content-type"], headers["content-length"]) == (
                200,
                b'{"ok": true}',
                "application/json",
                "12",
            )
            assert headers["x-seen"] == "1" and "date" in headers and "connection" not in headers
            writer.write(b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello")
            status, headers, _ = await read_response(reader)
            assert status == 200 and headers["x-seen"] == "2"
            writer.close()
            assert server.stats["connections_total"] == 1 and server.stats["requests"] == 2

    run(main())
    get, post = seen
    assert (get.method, get.target, get.path, get.version) == ("GET", "/a/%7Eb?x=1&y=2&x=3&z=", "/a/%7Eb", "HTTP/1.1")
    assert get.query == {"x": "3", "y": "2", "z": ""}
    assert get.headers == {"host": "h", "x-dup": "1, 2", "x-pad": "v"}
    assert get.body == b"" and get.peer[0] == "127.0.0.1"
    assert (post.method, post.body, post.query, post.headers["content-length"]) == ("POST", b"hello", {}, "5")


def test_pipelined_requests_are_answered_in_order_one_at_a_time(run):
    running = peak = 0

    async def handler(request: Request) -> Response:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep({"/0": 0.1, "/1": 0.05}.get(request.path, 0))
        running -= 1
        return await echo(request)

    async def main():
        async with serving(handler) as (_, port):
            reader, writer = await connect(port)
            writer.write(
                b"".join(b"POST /%d HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\n%d" % (i, i) for i in range(3))
            )
            bodies = [json.loads((await read_response(reader))[2]) for _ in range(3)]
            writer.close()
            assert bodies == [{"path": f"/{i}", "body": str(i)} for i in range(3)] and peak == 1

    run(main())


def test_reading_pauses_while_a_handler_runs(run):
    release = asyncio.Event()

    async def handler(request: Request) -> Response:
        await release.wait()
        return Response.json({})

    async def main():
        async with serving(handler, max_body=1000, max_header_bytes=1000, idle_timeout=3) as (server, port):
            reader, writer = await connect(port)
            writer.write(GET + b"x" * (8 << 20))  # unread, 8 MiB cannot fit in the socket buffers
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(writer.drain(), 0.5)
            release.set()
            (first, _, _), (second, _, body) = parse_responses(await read_to_close(reader))
            writer.close()
            assert (first, second, json.loads(body)) == (
                200,
                431,
                {"error": "request line and headers over 1000 bytes"},
            )
            assert server.stats["bad_requests"] == 1

    run(main())


def test_slowloris_gets_408_after_the_header_timeout(run):
    async def main():
        async with serving(header_timeout=0.5) as (server, port):  # idle_timeout 0.3 no longer applies
            reader, writer = await connect(port)

            async def drip():
                for byte in b"GET / HTTP/1.1\r\nHost: slow\r\nX-Long: " + b"a" * 100:
                    writer.write(bytes([byte]))
                    await asyncio.sleep(0.1)

            dripping = asyncio.create_task(drip())
            started = asyncio.get_running_loop().time()
            status, headers, body = await read_response(reader)
            elapsed = asyncio.get_running_loop().time() - started
            assert await read_to_close(reader) == b""
            dripping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dripping
            writer.close()
            assert (status, headers["connection"]) == (408, "close") and 0.45 < elapsed < 1.2
            assert json.loads(body) == {"error": "request line and headers not received within 0.5 s"}
            assert (
                server.stats["timeouts_header"] == 1
                and server.stats["bad_requests"] == 1
                and server.stats["timeouts_idle"] == 0
            )

    run(main())


def test_half_a_body_gets_408_after_the_body_timeout(run):
    async def main():
        async with serving() as (server, port):
            started = asyncio.get_running_loop().time()
            reply = await exchange(port, b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\nhalf!")
            elapsed = asyncio.get_running_loop().time() - started
            [(status, _, body)] = parse_responses(reply)
            assert (status, json.loads(body)) == (
                408,
                {"error": "body not received within 0.3 s"},
            ) and 0.25 < elapsed < 1.0
            assert server.stats["timeouts_body"] == 1 and server.stats["requests"] == 0

    run(main())


def test_idle_connections_are_closed_silently_and_the_timer_restarts_per_request(run):
    async def main():
        async with serving() as (server, port):
            reader, writer = await connect(port)
            assert await read_to_close(reader) == b""  # nothing sent: closed without a response
            writer.close()
            loop = asyncio.get_running_loop()
            reader, writer = await connect(port)
            for _ in range(3):  # 0.2 s apart: each response restarts the 0.3 s idle timer
                await asyncio.sleep(0.2)
                writer.write(GET)
                assert (await read_response(reader))[0] == 200
            answered = loop.time()
            assert await read_to_close(reader) == b""
            assert 0.25 < loop.time() - answered < 1.0
            writer.close()
            assert server.stats["timeouts_idle"] == 2 and server.stats["bad_requests"] == 0

    run(main())


def test_200_idle_connections_do_not_keep_a_client_waiting(run):
    async def main():
        async with serving(idle_timeout=3, header_timeout=3) as (server, port):
            held = [await connect(port) for _ in range(200)]
            for _, writer in held[::2]:
                writer.write(b"GET / HTTP/1.1\r\n")  # half of them in the middle of a head
            while server.stats["connections_open"] < 200:
                await asyncio.sleep(0.01)
            reader, writer = await connect(port)
            writer.write(GET)
            assert (await read_response(reader))[0] == 200
            for _, idle in held + [(reader, writer)]:
                idle.close()

    run(main())


def test_at_the_cap_a_new_client_takes_the_longest_idle_connections_place(run):
    """Idle keep-alive connections (or ones a trickle of requests keeps past the idle timeout)
    cannot lock new clients out: at the cap the one idle the longest is closed (0 of 38 new
    clients were served before, over 75 s)."""
    async def main():
        async with serving(max_connections=5, idle_timeout=30) as (server, port):
            held = []
            for _ in range(5):
                held.append(await connect(port))
                held[-1][1].write(GET)
                assert (await read_response(held[-1][0]))[0] == 200
                await asyncio.sleep(0.02)
            held[0][1].write(GET)  # a trickle: the first is served again, so the second is now the longest idle
            assert (await read_response(held[0][0]))[0] == 200
            [(status, _, _)] = parse_responses(
                await exchange(port, GET.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
            )
            assert status == 200 and server.stats["connections_evicted"] == 1
            assert await held[1][0].read() == b""  # closed for the newcomer
            for reader, writer in held[:1] + held[2:]:
                writer.write(GET)
                assert (await read_response(reader))[0] == 200
                writer.close()

    run(main())


def test_over_the_cap_with_every_connection_busy_a_client_reads_503_with_retry_after(run):
    release = asyncio.Event()

    async def handler(request: Request) -> Response:
        await release.wait()
        return Response.json({})

    async def main():
        async with serving(handler, max_connections=3, idle_timeout=5) as (server, port):
            busy = [await connect(port) for _ in range(3)]
            for _, writer in busy:
                writer.write(GET)
            while server.stats["requests"] < 3:
                await asyncio.sleep(0.01)
            # it sends a whole request before reading: it reads the 503, not a reset
            [(status, headers, body)] = parse_responses(await exchange(port, GET))
            assert (status, headers["retry-after"], json.loads(body)) == (503, "1", {"error": "too many connections"})
            assert server.stats["connections_refused"] == 1 and server.stats["connections_open"] == 3
            release.set()
            for reader, writer in busy:
                assert (await read_response(reader))[0] == 200
                writer.close()

    run(main())


@pytest.mark.parametrize("expect", [b"", b"Expect: 100-continue\r\n"], ids=["plain", "expect-100"])
def test_a_declared_10e12_byte_body_is_refused_at_once(run, expect):
    async def main():
        async with serving(body_timeout=3, header_timeout=3, idle_timeout=3) as (server, port):
            loop = asyncio.get_running_loop()
            started = loop.time()
            reply = await exchange(
                port, b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1000000000000\r\n" + expect + b"\r\n"
            )
            assert loop.time() - started < 0.5
            assert b"100 Continue" not in reply
            [(status, headers, body)] = parse_responses(reply)
            assert (status, headers["connection"], json.loads(body)) == (
                413,
                "close",
                {"error": "body over 1048576 bytes"},
            )
            assert (server.stats["too_large"], server.stats["bad_requests"], server.stats["requests"]) == (1, 1, 0)

    run(main())


def test_an_aiohttp_client_uploading_an_oversized_body_reads_the_413(run):
    async def main():
        async with serving(idle_timeout=3) as (_, port), aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/", data=b"x" * (2 << 20)) as response:
                assert response.status == 413 and (await response.json())["error"] == "body over 1048576 bytes"
            async with session.post(f"http://127.0.0.1:{port}/", json={"fits": True}) as response:
                assert response.status == 200 and await response.json() == {"path": "/", "body": '{"fits": true}'}

    run(main())


def test_a_client_still_uploading_a_refused_body_reads_the_413(run):
    async def main():
        async with serving(max_body=1000, idle_timeout=3) as (server, port):
            reply = await exchange(
                port, b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4000000\r\n\r\n" + b"x" * 4_000_000
            )
            [(status, _, _)] = parse_responses(reply)  # not a reset: the server lingered, reading
            assert status == 413 and server.stats["too_large"] == 1

    run(main())


def test_expect_100_continue_is_answered_before_the_body_is_read(run):
    async def main():
        async with serving() as (_, port):
            reader, writer = await connect(port)
            writer.write(b"POST /e HTTP/1.1\r\nHost: h\r\nExpect: 100-Continue\r\nContent-Length: 5\r\n\r\n")
            assert await reader.readexactly(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"hello")
            assert json.loads((await read_response(reader))[2]) == {"path": "/e", "body": "hello"}
            # the body already sent with the head: no 100 Continue
            writer.write(b"POST /f HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nhi")
            assert json.loads((await read_response(reader))[2]) == {"path": "/f", "body": "hi"}
            writer.close()

    run(main())


def request_with(*header_lines: bytes, method: bytes = b"GET", body: bytes = b"") -> bytes:
    return method + b" / HTTP/1.1\r\n" + b"".join(line + b"\r\n" for line in header_lines) + b"\r\n" + body


BAD_REQUESTS = {
    "bare LF": (b"GET / HTTP/1.1\nHost: h\n\n", 400, "bare LF: lines must end with CRLF"),
    "bare LF in a header": (b"GET / HTTP/1.1\r\nHost: h\nX: 1\r\n\r\n", 400, "bare CR or LF: lines must end with CRLF"),
    "bare CR in the request line": (
        b"GET /\r HTTP/1.1\r\nHost: h\r\n\r\n",
        400,
        "bare CR or LF: lines must end with CRLF",
    ),
    "obs-fold": (request_with(b"Host: h", b"X-A: 1", b"  folded"), 400, "obsolete line folding is not accepted"),
    "no colon": (request_with(b"Host: h", b"NoColon"), 400, "header line without a colon"),
    "space before the colon": (request_with(b"Host : h"), 400, "invalid header name"),
    "NUL in a value": (request_with(b"Host: h", b"X-A: a\x00b"), 400, "invalid character in a header value"),
    "method not a token": (b"G(ET / HTTP/1.1\r\nHost: h\r\n\r\n", 400, "invalid method"),
    "bad request line before the headers end": (b"G(ET / HTTP/1.1\r\nHost: h", 400, "invalid method"),
    "two spaces": (
        b"GET  / HTTP/1.1\r\nHost: h\r\n\r\n",
        400,
        "the request line must be METHOD SP target SP HTTP-version",
    ),
    "space in the target": (
        b"GET /a b HTTP/1.1\r\nHost: h\r\n\r\n",
        400,
        "the request line must be METHOD SP target SP HTTP-version",
    ),
    "non-ASCII target": (b"GET /\xff HTTP/1.1\r\nHost: h\r\n\r\n", 400, "invalid request target"),
    "HTTP/2.0": (b"GET / HTTP/2.0\r\nHost: h\r\n\r\n", 400, "only HTTP/1.0 and HTTP/1.1 are served"),
    "empty line first": (
        b"\r\nGET / HTTP/1.1\r\nHost: h\r\n\r\n",
        400,
        "the request line must be METHOD SP target SP HTTP-version",
    ),
    "no Host": (b"GET / HTTP/1.1\r\n\r\n", 400, "missing Host header"),
    "repeated Content-Length": (
        request_with(b"Host: h", b"Content-Length: 1", b"Content-Length: 1", body=b"x"),
        400,
        "repeated content-length header",
    ),
    "repeated Host": (request_with(b"Host: h", b"host: h"), 400, "repeated host header"),
    "repeated Authorization": (
        request_with(b"Host: h", b"Authorization: a", b"Authorization: b"),
        400,
        "repeated authorization header",
    ),
    "repeated Content-Type": (
        request_with(b"Host: h", b"Content-Type: a", b"Content-Type: b"),
        400,
        "repeated content-type header",
    ),
    "repeated Transfer-Encoding": (
        request_with(b"Host: h", b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked"),
        400,
        "repeated transfer-encoding header",
    ),
    "Content-Length +5": (
        request_with(b"Host: h", b"Content-Length: +5", body=b"12345"),
        400,
        "Content-Length must be 1-18 ASCII digits",
    ),
    "Content-Length -1": (
        request_with(b"Host: h", b"Content-Length: -1"),
        400,
        "Content-Length must be 1-18 ASCII digits",
    ),
    "Content-Length 5, 5": (
        request_with(b"Host: h", b"Content-Length: 5, 5", body=b"12345"),
        400,
        "Content-Length must be 1-18 ASCII digits",
    ),
    "Content-Length 0x10": (
        request_with(b"Host: h", b"Content-Length: 0x10"),
        400,
        "Content-Length must be 1-18 ASCII digits",
    ),
    "Content-Length 5 5": (
        request_with(b"Host: h", b"Content-Length: 5 5"),
        400,
        "Content-Length must be 1-18 ASCII digits",
    ),
    "Content-Length empty": (
        request_with(b"Host: h", b"Content-Length:"),
        400,
        "Content-Length must be 1-18 ASCII digits",
    ),
    "Content-Length 19 digits": (
        request_with(b"Host: h", b"Content-Length: " + b"1" * 19),
        400,
        "Content-Length must be 1-18 ASCII digits",
    ),
    "Content-Length Arabic digit": (
        request_with(b"Host: h", "Content-Length: \u0665".encode()),
        400,
        "Content-Length must be 1-18 ASCII digits",
    ),
    "chunked": (  # a 4xx the client can act on (was 501, a 5xx)
        request_with(b"Host: h", b"Transfer-Encoding: chunked", method=b"POST", body=b"5\r\nhello\r\n0\r\n\r\n"),
        411,
        "chunked bodies are not accepted; send the body with a Content-Length",
    ),
    "gzip transfer coding": (
        request_with(b"Host: h", b"Transfer-Encoding: gzip", method=b"POST"),
        501,
        "Transfer-Encoding is not accepted; send a Content-Length",
    ),
    "chunked and Content-Length": (
        request_with(
            b"Host: h",
            b"Content-Length: 4",
            b"Transfer-Encoding: chunked",
            method=b"POST",
            body=b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: h\r\n\r\n",
        ),
        400,
        "both Transfer-Encoding and Content-Length: ambiguous framing",
    ),
    "POST without Content-Length": (request_with(b"Host: h", method=b"POST"), 411, "POST needs a Content-Length"),
    "gzip body": (  # its Content-Encoding was ignored
        request_with(b"Host: h", b"Content-Encoding: gzip", b"Content-Length: 2", method=b"POST", body=b"{}"),
        415,
        "Content-Encoding 'gzip' is not accepted: send the body uncompressed",
    ),
    "unknown Expect": (request_with(b"Host: h", b"Expect: 200-ok"), 417, "only Expect: 100-continue is accepted"),
    "65 headers": (request_with(b"Host: h", *[b"X-%d: 1" % i for i in range(64)]), 431, "more than 64 headers"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_malformed_requests_are_refused_and_closed(run, case):
    data, expected_status, expected_error = BAD_REQUESTS[case]
    handled = []

    async def handler(request: Request) -> Response:
        handled.append(request)
        return Response.json({})

    async def main():
        async with serving(handler, header_timeout=3) as (server, port):
            [(status, headers, body)] = parse_responses(await exchange(port, data))
            assert (status, headers["connection"], json.loads(body)) == (
                expected_status,
                "close",
                {"error": expected_error},
            )
            assert server.stats["bad_requests"] == 1 and not handled

    run(main())


def test_an_oversized_head_gets_431_at_once_and_one_at_the_limit_is_served(run):
    async def main():
        async with serving(header_timeout=3, max_header_bytes=1024) as (server, port):
            loop = asyncio.get_running_loop()
            started = loop.time()
            reply = await exchange(port, b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * 1024)  # no end of head
            assert loop.time() - started < 0.5 and reply.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
            at_limit = b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: "
            at_limit += b"a" * (1024 - len(at_limit) - 4) + b"\r\n\r\n"
            assert len(at_limit) == 1024
            reader, writer = await connect(port)
            writer.write(at_limit)
            assert (await read_response(reader))[0] == 200
            writer.close()
            assert server.stats["bad_requests"] == 1

    run(main())


def test_a_handler_4xx_keeps_the_connection(run):
    async def handler(request: Request) -> Response:
        return Response.json({"error": "no such thing"}, 404) if request.path == "/missing" else await echo(request)

    async def main():
        async with serving(handler) as (server, port):
            reader, writer = await connect(port)
            writer.write(b"GET /missing HTTP/1.1\r\nHost: h\r\n\r\n")
            status, headers, _ = await read_response(reader)
            assert status == 404 and "connection" not in headers
            writer.write(GET)
            assert (await read_response(reader))[0] == 200
            writer.close()
            assert server.stats["bad_requests"] == 0  # only what the server itself answers

    run(main())


def test_a_failing_handler_is_a_500_without_its_text_and_the_connection_survives(run):
    reported = []

    def on_error(request, exc):
        reported.append((request.path, type(exc).__name__))
        raise RuntimeError("on_error fails too")

    async def handler(request: Request) -> Response:
        if request.path == "/raise":
            raise RuntimeError("secret detail")
        if request.path == "/not-a-response":
            return {"ok": True}
        if request.path == "/bad-header":
            return Response.json({}, headers={"X-Injected": "a\r\nSet-Cookie: x"})
        if request.path == "/bad-status":
            return Response(100)
        if request.path == "/cancelled":
            raise asyncio.CancelledError  # not by the server: a failure like any other
        return await echo(request)

    async def main():
        async with serving(handler, on_error=on_error) as (server, port):
            reader, writer = await connect(port)
            for path in ("/raise", "/not-a-response", "/bad-header", "/bad-status", "/cancelled", "/fine"):
                writer.write(b"GET %s HTTP/1.1\r\nHost: h\r\n\r\n" % path.encode())
                status, headers, body = await read_response(reader)
                assert (status, body) == (
                    (200, b'{"path": "/fine", "body": ""}')
                    if path == "/fine"
                    else (500, b'{"error": "internal error"}')
                )
                assert "connection" not in headers
            writer.close()
            assert server.stats["handler_errors"] == 5

    run(main())
    assert reported == [
        ("/raise", "RuntimeError"),
        ("/not-a-response", "TypeError"),
        ("/bad-header", "ValueError"),
        ("/bad-status", "ValueError"),
        ("/cancelled", "CancelledError"),
    ]


def test_a_client_leaving_mid_handler_cancels_the_handler(run):
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handler(request: Request) -> Response:
        if request.path in ("/slow", "/stubborn"):
            started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                cancelled.set()
                if request.path == "/slow":
                    raise
        return await echo(request)  # /stubborn answers a client that has gone

    async def main():
        async with serving(handler) as (server, port):
            for path in (b"/slow", b"/stubborn"):
                started.clear()
                cancelled.clear()
                _, writer = await connect(port)
                writer.write(b"GET %s HTTP/1.1\r\nHost: h\r\n\r\n" % path)
                await started.wait()
                writer.close()
                await asyncio.wait_for(cancelled.wait(), 1)
            await asyncio.sleep(0.05)
            assert server.stats["disconnects_in_flight"] == 2 and server.stats["connections_open"] == 0
            [(status, _, _)] = parse_responses(await exchange(port, b"GET / HTTP/1.0\r\n\r\n"))
            assert status == 200

    run(main())


def test_http10_and_connection_close_end_the_connection_after_the_response(run):
    async def main():
        async with serving(idle_timeout=3) as (server, port):
            pipelined = b"GET /next HTTP/1.1\r\nHost: h\r\n\r\n"
            for request in (
                b"GET /old HTTP/1.0\r\n\r\n",
                b"GET /old HTTP/1.1\r\nHost: h\r\nConnection: keep-alive, Close\r\n\r\n",
            ):
                [(status, headers, body)] = parse_responses(await exchange(port, request + pipelined))
                assert (status, headers["connection"], json.loads(body)["path"]) == (200, "close", "/old")
            assert server.stats["requests"] == 2

    run(main())


def test_head_204_and_custom_response_headers(run):
    async def handler(request: Request) -> Response:
        if request.path == "/empty":
            return Response(204, content_type="")
        if request.path == "/odd":
            return Response(299, b"odd", content_type="")
        return Response(200, b"hello", "text/plain; charset=utf-8", {"X-A": "1", "Retry-After": "1"})

    async def main():
        async with serving(handler) as (_, port):
            reader, writer = await connect(port)
            writer.write(
                b"HEAD / HTTP/1.1\r\nHost: h\r\n\r\n"
                + GET
                + b"GET /empty HTTP/1.1\r\nHost: h\r\n\r\nGET /odd HTTP/1.1\r\nHost: h\r\n\r\n"
            )
            status, headers, _ = await read_response(reader, head_only=True)
            assert (
                status,
                headers["content-length"],
                headers["content-type"],
                headers["x-a"],
                headers["retry-after"],
            ) == (200, "5", "text/plain; charset=utf-8", "1", "1")
            assert (await read_response(reader))[2] == b"hello"
            status, headers, _ = await read_response(reader, head_only=True)
            assert status == 204 and "content-length" not in headers and "content-type" not in headers
            assert await reader.readuntil(b"\r\n") == b"HTTP/1.1 299 Unknown\r\n"
            writer.close()

    run(main())


def test_a_response_the_client_does_not_read_is_dropped_after_the_idle_timeout(run):
    async def handler(request: Request) -> Response:
        return Response(200, b"x" * (1 << 20))

    async def main():
        async with serving(handler) as (server, port):
            _, writer = await connect(port)
            writer.write(GET * 30)  # 30 MiB of answers that are never read
            while server.stats["timeouts_idle"] == 0:
                await asyncio.sleep(0.05)
            assert server.stats["connections_open"] == 0 and server.stats["requests"] < 30
            writer.close()

    run(main())


def test_a_fault_of_the_server_is_reported_and_answered_500(run, monkeypatch):
    reported = []
    parse_head = httpd.parse_head

    def faulty_parse_head(head, max_headers):
        if head.startswith("GET /fault "):
            raise RuntimeError("a bug")
        return parse_head(head, max_headers)

    monkeypatch.setattr(httpd, "parse_head", faulty_parse_head)

    async def main():
        async with serving(on_error=lambda request, exc: reported.append((request, str(exc)))) as (_, port):
            [(status, headers, body)] = parse_responses(await exchange(port, b"GET /fault HTTP/1.1\r\nHost: h\r\n\r\n"))
            assert (status, headers["connection"], body) == (500, "close", b'{"error": "internal error"}')
            [(status, _, _)] = parse_responses(await exchange(port, b"GET / HTTP/1.0\r\n\r\n"))
            assert status == 200

    run(main())
    assert reported == [(None, "a bug")]


def test_close_with_open_connections_leaves_nothing_running(run):
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handler(request: Request) -> Response:
        started.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response.json({})

    async def main():
        server = HttpServer(handler, HttpLimits(idle_timeout=3, header_timeout=3, body_timeout=3))
        port = await server.start()
        idle = await connect(port)
        in_head = await connect(port)
        in_head[1].write(b"GET / HTTP/1.1\r\n")
        in_body = await connect(port)
        in_body[1].write(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 9\r\n\r\nabc")
        busy = await connect(port)
        busy[1].write(GET)
        await started.wait()
        await server.close()
        assert cancelled.is_set() and server.stats["connections_open"] == 0
        for reader, writer in (idle, in_head, in_body, busy):
            assert await read_to_close(reader) == b""
            writer.close()
        with pytest.raises(OSError):
            await connect(port)
        await server.close()  # idempotent
        assert server.stats["disconnects_in_flight"] == 0

    run(main())


def test_start_on_a_taken_port_raises_oserror(run):
    async def main():
        async with serving() as (_, port):
            other = HttpServer(echo)
            with pytest.raises(OSError):
                await other.start(port=port)
            await other.close()

    run(main())


def random_requests(count: int) -> list[bytes]:
    """Random bytes with CRLFs mixed in, and a valid request with a few random mutations."""
    rng = random.Random(0)
    valid = b"POST /x?a=1 HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nabc"
    samples = []
    for _ in range(count):
        if rng.random() < 0.5:
            pieces = [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(1, 5))]
            samples.append(b"\r\n".join(pieces) + rng.choice([b"", b"\r\n", b"\r\n\r\n"]))
            continue
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            mutation = rng.choice(["flip", "delete", "insert", "crlf"])
            if mutation == "flip":
                data[at] = rng.randrange(256)
            elif mutation == "delete":
                del data[at]
            else:
                data[at:at] = b"\r\n" if mutation == "crlf" else bytes([rng.randrange(256)])
        samples.append(bytes(data))
    return samples


def test_random_bytes_never_break_the_server(run):
    reported = []

    async def main():
        async with serving(on_error=lambda request, exc: reported.append(exc)) as (server, port):

            async def probe(data: bytes) -> bytes:
                reader, writer = await connect(port)
                try:
                    writer.write(data)
                    return await read_to_close(reader, timeout=3.0)  # closed within the timeouts
                finally:
                    writer.close()

            replies = await asyncio.gather(*(probe(data) for data in random_requests(300)))
            assert all(not reply or reply.startswith(b"HTTP/1.1 ") for reply in replies)
            [(status, _, _)] = parse_responses(await exchange(port, b"GET / HTTP/1.0\r\n\r\n"))
            assert status == 200 and server.stats["connections_total"] == 301

    run(main())
    assert not reported


def test_an_absolute_form_target_is_served_at_its_path(run):
    """RFC 9112 3.2.2: a server must accept ``GET http://host/path``; it was a 404."""
    seen = []

    async def handler(request: Request) -> Response:
        seen.append((request.path, request.query))
        return Response.json({})

    async def main():
        async with serving(handler) as (server, port):
            for target in (b"http://127.0.0.1/genrm/health?x=1", b"HTTP://h:1", b"https://h/a/b"):
                [(status, _, _)] = parse_responses(await exchange(port, b"GET " + target + b" HTTP/1.1\r\nHost: h\r\n"
                                                                   b"Connection: close\r\n\r\n"))
                assert status == 200, target

    run(main())
    assert seen == [("/genrm/health", {"x": "1"}), ("/", {}), ("/a/b", {})]
