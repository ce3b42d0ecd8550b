"""Hostile input against a live ``relay judge`` (two real engines, the documented command):
generated bodies over HTTP and over the ZeroMQ client, and connection abuse. No request may
disable an engine, fail another request or get a 5xx; the judge answers valid requests
afterwards."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import aiohttp
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.helpers import interrupt, run
from tests.launcher.test_launch import free_port, read_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELAY = os.path.join(os.path.dirname(sys.executable), "relay")
TIMEOUT = 1.0  # the gateway's header, body and idle timeouts in these tests (seconds)
MAX_CONNECTIONS = 48
MAX_ERROR_CHARS = 700  # an error message echoes at most a short prefix of what was sent


@dataclass
class Judge:
    url: str
    port: int
    addr: str  # relay address for reward code
    env: dict  # with the judge's secret


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    port = free_port()
    env = dict(
        os.environ,
        RELAY_CACHE=str(tmp / "cache"),
        RELAY_JOB_SECRET=secrets.token_hex(32),
        XDG_CACHE_HOME=str(tmp / "xdg"),
    )
    limits = [
        "--genrm-gateway-header-timeout",
        str(TIMEOUT),
        "--genrm-gateway-body-timeout",
        str(TIMEOUT),
        "--genrm-gateway-idle-timeout",
        str(TIMEOUT),
        "--genrm-gateway-max-connections",
        str(MAX_CONNECTIONS),
    ]
    p = subprocess.Popen(
        [RELAY, "judge", "--config", "tiny-cpu-split", "--port", str(port), *limits],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = read_until(p, "judge ready", 240)
        addr = re.search(r"relay address for reward code: (\S+)\)", out).group(1)
        yield Judge(f"http://127.0.0.1:{port}", port, addr, env)
    finally:
        interrupt(p)


# ---------------------------------------------------------------------------- strategies

MSG = [{"role": "user", "content": "Is 2+2=4? Answer 1 or 0."}]
ENGINE_KILLERS = [  # each disabled an engine before (issue 14)
    {"temperature": 1e-50},
    {"top_k": 2.5, "temperature": 0.7},
    {"seed": 2**63, "temperature": 0.7},
    {"max_response_len": float("nan")},
]
POISON = [  # integers past 64 bits failed the other requests batched with them
    {"top_k": 2**64},
    {"seed": 2**64},
    {"stop_token_ids": [2**64]},
    {"max_response_len": 2**64},
    {"repetition_penalty": 1e-40, "temperature": 0.7},  # 0 in float32: it failed the engine step (issue 46)
    {"temperature": 10**309},  # an integer past float64: a 500
    {"frequency_penalty": 3.5e38, "temperature": 0.7},  # inf in float32
]
INNOCENT_EVERY = 5  # a known-valid request after every 5 generated ones: each must succeed
VALID = {
    "temperature": st.sampled_from([0.0, 0.0, 0.5, 1.0]),
    "top_p": st.floats(0.05, 1.0),
    "top_k": st.sampled_from([-1, 1, 5, 40]),
    "max_response_len": st.integers(1, 6),
    "max_new_tokens": st.integers(1, 6),
    "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 500), max_size=3),
    "ignore_eos": st.booleans(),
    "seed": st.none() | st.integers(0, 2**63 - 1),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "unread"]), st.booleans(), max_size=2),
}
HOSTILE_VALUE = st.one_of(
    st.sampled_from(
        [
            float("nan"),
            float("inf"),
            float("-inf"),
            1e-50,
            1e308,
            -1.0,
            2.5,
            2**63,
            2**64,
            -(2**63) - 1,
            10**40,
            True,
            False,
        ]
    ),
    st.integers(),
    st.floats(),
    st.none(),
    st.text(max_size=20),
    st.binary(max_size=8).map(lambda b: b.hex()),
    st.lists(st.integers() | st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from(
        [
            {"chat_template": "{% for i in range(10**9) %}x{% endfor %}"},
            {"chat_template": "{{ 7*7 }}"},
            {"tools": [{"a": 1}]},
            {"enable_thinking": [[[[]]]]},
            {"x" * 300: 1},
        ]
    ),
)


@st.composite
def sampling_params(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(list(VALID)), max_size=3, unique=True))
    out = {k: draw(HOSTILE_VALUE) if draw(st.integers(0, 11)) == 0 else draw(VALID[k]) for k in keys}
    if draw(st.integers(0, 7)) == 0:
        out["bogus"] = draw(HOSTILE_VALUE)
    return out


@st.composite
def request(draw) -> tuple:
    """(messages, sampling_params, route_key): mostly valid (unique text, so the judgment
    cache does not answer them), some hostile in one way or another."""
    kind = draw(st.integers(0, 49))
    # unique by construction (a drawn number repeats within a batch, and in hypothesis's
    # replays): a repeated greedy request would be answered by the judgment cache
    content = f"{draw(st.text(max_size=40))} #{draw(st.integers(0, 10**9))}.{next(_UNIQUE)}"
    messages, sp, rk = [{"role": "user", "content": content}], draw(sampling_params()), None
    if kind == 0:
        sp = draw(st.sampled_from(ENGINE_KILLERS + POISON))
    elif kind == 1:
        messages = draw(
            st.sampled_from(
                [
                    [],
                    [{}],
                    [{"role": "user"}],
                    [{"role": "root", "content": "x"}],
                    "text",
                    [["user", "x"]],
                    [{"role": "user", "content": 5}],
                    [{"role": "user", "content": "x", "extra": 1}],
                ]
            )
        )
    elif kind == 2:
        rk = draw(
            st.sampled_from(["x" * 200_000, "nope", "", "__default__"])
            | st.integers()
            | st.lists(st.integers(), max_size=2)
        )
    elif kind == 3:
        messages = [{"role": "user", "content": "{{ 7*7 }} {% for i in range(10**9) %}x{% endfor %}" + content}]
    elif kind == 4:
        messages = [
            {"role": "user", "content": "y" * draw(st.sampled_from([30_000, 300_000]))}
        ]  # past the KV cache: refused
    elif kind == 5:
        sp = draw(HOSTILE_VALUE)
    elif kind == 6:  # OpenAI text parts (valid: joined)
        messages = [{"role": "user", "content": [{"type": "text", "text": t} for t in (content, *draw(_TEXTS))]}]
    elif kind == 7:  # any role the template takes (valid)
        role = draw(
            st.sampled_from(["tool", "developer", "function", "observation"]) | st.text(min_size=1, max_size=64)
        )
        messages = [{"role": role, "content": content}, *messages]
    elif kind == 8:
        messages = [{"role": "user", "content": draw(st.sampled_from(HOSTILE_CONTENT))}]
    elif kind == 9:
        messages = [{"role": draw(st.sampled_from(["", "r" * 65, "r" * 100_000, "r\ud800"])), "content": content}]
    return messages, sp, rk


_TEXTS = st.lists(st.text(max_size=10), max_size=3)
_UNIQUE = itertools.count()
HOSTILE_CONTENT = [
    [],
    [{"type": "image_url", "image_url": {"url": "http://x"}}],
    [{"type": "input_audio", "input_audio": {}}],
    [{"type": "text"}],
    [{"type": "text", "text": 5}],
    [{"type": "text", "text": "x", "extra": 1}],
    [{"text": "x"}],
    ["x"],
    [{"type": "text", "text": "x"}] * 65,
    {"type": "text", "text": "x"},
    None,
    "a lone surrogate \ud800 in the content",  # not UTF-8: it failed every request batched with it
    [{"type": "text", "text": "\udfff"}],
]
NATIVE_HOSTILE = [
    {"input_ids": []},
    {"input_ids": [-1]},
    {"input_ids": [2**31]},
    {"input_ids": [2**64]},
    {"input_ids": [10**6]},
    {"input_ids": [True, 5]},
    {"input_ids": [1.5]},
    {"input_ids": "12"},
    {"input_ids": [[5]]},
    {"input_ids": [5] * 5000},  # past the KV cache: refused by the engine
    {"text": ""},
    {"text": 5},
    {"text": "x", "input_ids": [5]},
    {"text": "x", "stream": True},
    {"text": "y" * 30_000},  # past the KV cache: refused by the engine (the length bound: test_genrm_http_api)
    {"text": "x\ud83d"},  # a lone surrogate
]


@st.composite
def native_body(draw) -> dict:
    """An SGLang-native payload (no messages): mostly valid text or token ids, some hostile."""
    kind = draw(st.integers(0, 5))
    if kind == 0:
        body = dict(draw(st.sampled_from(NATIVE_HOSTILE)))
    elif kind <= 3:
        body = {"text": f"{draw(st.text(max_size=30))} native #{next(_UNIQUE)}"}
    else:  # printable characters of the tiny tokenizer (special tokens 0-4 first)
        body = {"input_ids": [*draw(st.lists(st.integers(5, 99), min_size=1, max_size=20)), 5 + kind]}
    if draw(st.booleans()):
        body["sampling_params"] = draw(sampling_params())
    return body


def _nest(depth: int) -> str:
    return "[" * depth + "]" * depth


RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            _nest(100_000).encode(),
            ('{"messages": ' + _nest(5000) + "}").encode(),
            (
                '{"messages": [{"role": "user", "content": "x"}], "sampling_params": {"seed": 1' + "0" * 5000 + "}}"
            ).encode(),
            b'{"messages": [{"role": "user", "content": "x"}], "sampling_params": {"temperature": NaN}}',
            b'{"messages": [{"role": "user", "content": "x"}], "sampling_params": {"temperature": Infinity}}',
            b"\xff\xfe{}",
            b"null",
            b"[]",
            b'"messages"',
        ]
    ),
)


@st.composite
def http_body(draw) -> bytes:
    if draw(st.integers(0, 15)) == 0:
        return draw(RAW_BODIES)
    if draw(st.integers(0, 7)) == 0:
        return json.dumps(draw(native_body())).encode()
    messages, sp, rk = draw(request())
    body = {"messages": messages}
    if sp is not None or draw(st.booleans()):
        body["sampling_params"] = sp
    if rk is not None:
        body["route_key"] = rk
    if draw(st.integers(0, 19)) == 0:
        body["unknown_field"] = 1
    return json.dumps(body).encode()  # NaN and Infinity as Python writes them


# ---------------------------------------------------------------------------- helpers


async def _engine_requests(session: aiohttp.ClientSession, url: str) -> tuple[int, list]:
    async with session.get(f"{url}/genrm/metrics?engines=1") as r:
        snap = await r.json()
    engines = snap["engines"]  # one instance: the original's flat shape
    return sum(e.get("requests_finished", 0) for e in engines), engines


async def _valid_requests_all_succeed(session: aiohttp.ClientSession, url: str, n: int = 200) -> list:
    async def one(i):
        body = {"messages": [{"role": "user", "content": f"Is {i}+{i}={2 * i}? Answer 1 or 0."}]}
        async with session.post(f"{url}/genrm/generate", json=body) as r:
            return r.status, await r.json()

    return await asyncio.gather(*(one(i) for i in range(n)))


def _check_answer(status: int, payload, sent) -> None:
    assert status == 200 or 400 <= status < 500, (status, payload, sent[:200])
    if status == 200:
        assert isinstance(payload["response"], str)
    else:
        assert isinstance(payload.get("error"), str) and payload["error"], (status, payload)
        assert len(payload["error"]) <= MAX_ERROR_CHARS, (status, len(payload["error"]), payload["error"][:200])


def _with_innocents(items: list, innocent) -> list[tuple]:
    """``items`` as (item, False), with (``innocent(k)``, True) after every ``INNOCENT_EVERY``:
    valid requests whose answers must not depend on what is batched with them."""
    out = []
    for k, item in enumerate(items):
        out.append((item, False))
        if k % INNOCENT_EVERY == INNOCENT_EVERY - 1:
            out.append((innocent(k), True))
    return out


def _innocent_messages(k: int) -> list:
    return [{"role": "user", "content": f"Innocent {k} #{next(_UNIQUE)}: is {k}+1={k + 1}? Answer 1 or 0."}]


BATCH = 125  # bodies per hypothesis example, sent 32 at a time (they batch in the service)
TALLY: collections.Counter = collections.Counter()  # across the examples of this module's fuzz tests


# ---------------------------------------------------------------------------- tests


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large, HealthCheck.too_slow],
)
@given(bodies=st.lists(http_body(), min_size=BATCH, max_size=BATCH))
@example(
    bodies=[json.dumps({"messages": MSG, "sampling_params": sp}).encode() for sp in ENGINE_KILLERS + POISON] * 4
    + [json.dumps({"messages": [{"role": "user", "content": f"valid {i}"}]}).encode() for i in range(BATCH - 32)]
)
@example(  # lone surrogates beside valid requests: they failed the whole engine batch with 502
    bodies=[json.dumps(b).encode() for b in (
        {"messages": [{"role": "user", "content": "x\ud800"}]}, {"messages": [{"role": "u\udc00", "content": "x"}]},
        {"messages": MSG, "sampling_params": {"stop": ["\ud800"]}}, {"text": "x\ud83d"},
    )] * 4 + [json.dumps({"messages": [{"role": "user", "content": f"valid beside {i}"}]}).encode()
              for i in range(BATCH - 16)]
)
def test_generated_http_bodies_never_get_a_5xx_or_harm_the_judge(judge, bodies):
    """Over HTTP, 32 at a time so that hostile and valid requests share engine batches:
    every answer is 200 or a 4xx with a short error, every known-valid request among them
    (chat and native) gets 200; most requests reach an engine (the engines' own counters
    say so: the fuzz is not stopped at the validator)."""
    mixed = _with_innocents(bodies, lambda k: json.dumps(
        {"messages": _innocent_messages(k)} if k % 2 else {"text": f"native innocent {k} #{next(_UNIQUE)}"}).encode())

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as s:
            before, _ = await _engine_requests(s, judge.url)

            async def send(body):
                async with s.post(
                    f"{judge.url}/genrm/generate", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    return r.status, await r.json(content_type=None), body

            answers = await asyncio.gather(*(send(b) for b, _ in mixed))
            after, engines = await _engine_requests(s, judge.url)
        return answers, after - before, engines

    answers, reached, engines = run(main(), 300)
    for status, payload, body in answers:
        _check_answer(status, payload, body)
    innocent = [(status, payload) for (status, payload, _), (_, valid) in zip(answers, mixed) if valid]
    assert [status for status, _ in innocent] == [200] * len(innocent), [a for a in innocent if a[0] != 200][:3]
    ok = sum(status == 200 for status, _, _ in answers)
    assert reached >= ok, (reached, ok)  # every 200 was an engine's answer (no cache hit: unique texts)
    assert all("error" not in e for e in engines), engines
    TALLY["http sent"] += len(bodies)
    TALLY["http reached an engine"] += reached


_ZMQ_CALLER = textwrap.dedent("""
    import asyncio, json, sys
    from reward.client import GenRMClient

    async def main():
        client = GenRMClient(sys.argv[1], retries=0)
        requests = [json.loads(line) for line in sys.stdin]
        sem = asyncio.Semaphore(32)

        async def one(req):
            async with sem:
                try:
                    return {"ok": True, "text": await client.generate(*req, timeout=120)}
                except Exception as e:
                    return {"ok": False, "type": type(e).__name__, "error": str(e)[:2000]}

        for out in await asyncio.gather(*(one(r) for r in requests)):
            print(json.dumps(out), flush=True)

    asyncio.run(main())
""")


@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large, HealthCheck.too_slow],
)
@given(requests=st.lists(request(), min_size=BATCH, max_size=BATCH))
@example(
    requests=[(MSG, sp, None) for sp in ENGINE_KILLERS + POISON] * 4
    + [([{"role": "user", "content": f"zmq {i}"}], None, None) for i in range(BATCH - 32)]
)
def test_generated_requests_over_the_zeromq_client_fail_only_themselves(judge, requests):
    """The same requests through the reward-code client (calls of one loop turn share one
    relay message): each gets its response or its own error (ValueError, TypeError and
    their kinds); none fails for another's sake (JudgeUnavailable, JudgeEngineError,
    CallTimeout, a transport error), and every known-valid request among them succeeds."""
    mixed = _with_innocents(requests, lambda k: (_innocent_messages(k), {"temperature": 0.7, "seed": k}, None))
    lines = "".join(json.dumps(list(r)) + "\n" for r, _ in mixed)
    env = dict(judge.env, PYTHONPATH=ROOT)
    p = subprocess.run(
        [sys.executable, "-c", _ZMQ_CALLER, judge.addr],
        input=lines,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    outcomes = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(outcomes) == len(mixed)
    own = {"ValueError", "TypeError", "BadMessages", "TextOnly", "UnknownRouteKey", "RequestFault"}
    for out, (req, valid) in zip(outcomes, mixed):
        assert out["ok"] or (out["type"] in own and not valid), (out, json.dumps(req)[:300])
        if not out["ok"]:
            assert len(out["error"]) <= MAX_ERROR_CHARS, out["error"][:300]
    TALLY["zmq sent"] += len(requests)
    TALLY["zmq answered"] += sum(o["ok"] for o in outcomes)


OPENAI_VALID = {
    "temperature": VALID["temperature"],
    "top_p": VALID["top_p"],
    "max_tokens": st.integers(1, 6),
    "n": st.integers(1, 3),
    "seed": VALID["seed"],
    "stop": VALID["stop"],
    "user": st.text(max_size=5),
    "stream": st.just(False),
}


@st.composite
def openai_body(draw) -> bytes:
    """A chat completion body: mostly valid (model ``__default__``, the request strategy's
    messages), some with an unknown model, hostile values or unsupported fields."""
    messages, _, _ = draw(request())
    model = "__default__" if draw(st.integers(0, 7)) else draw(st.sampled_from(["nope", "", 5, None, "x" * 10_000]))
    body = {"model": model, "messages": messages}
    for key in draw(st.lists(st.sampled_from(list(OPENAI_VALID)), max_size=4, unique=True)):
        body[key] = draw(HOSTILE_VALUE) if draw(st.integers(0, 9)) == 0 else draw(OPENAI_VALID[key])
    if draw(st.integers(0, 11)) == 0:
        body[draw(st.sampled_from(["stream", "tools", "logprobs", "bogus"]))] = draw(HOSTILE_VALUE | st.just(True))
    return json.dumps(body).encode()


@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large, HealthCheck.too_slow],
)
@given(bodies=st.lists(openai_body(), min_size=BATCH, max_size=BATCH))
def test_generated_openai_chat_completions_never_get_a_5xx(judge, bodies):
    """POST /genrm/v1/chat/completions, 32 at a time: every answer is a chat.completion
    with n choices and usage counts, or a 4xx OpenAI error object with a short message;
    every known-valid request among them gets 200."""
    mixed = _with_innocents(bodies, lambda k: json.dumps(
        {"model": "__default__", "messages": _innocent_messages(k), "max_tokens": 4, "n": 1 + k % 3}).encode())

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as s:

            async def send(body):
                async with s.post(
                    f"{judge.url}/genrm/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    return r.status, await r.json(content_type=None), body

            answers = await asyncio.gather(*(send(b) for b, _ in mixed))
            async with s.get(f"{judge.url}/genrm/metrics") as r:
                return answers, (await r.json())["gateway_errors"]

    answers, gateway_errors = run(main(), 300)
    assert "internal" not in gateway_errors, gateway_errors  # no handler failed (here or in the fuzz before)
    innocent = [status for (status, _, _), (_, valid) in zip(answers, mixed) if valid]
    assert innocent == [200] * len(innocent), innocent
    for status, payload, body in answers:
        assert status == 200 or 400 <= status < 500, (status, payload, body[:200])
        if status == 200:
            sent = json.loads(body)
            assert payload["object"] == "chat.completion" and len(payload["choices"]) == sent.get("n", 1)
            assert all(isinstance(c["message"]["content"], str) for c in payload["choices"])
            usage = payload["usage"]
            assert (
                usage["prompt_tokens"] > 0
                and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            )
        else:
            error = payload["error"]
            assert isinstance(error["message"], str) and error["message"], (status, payload)
            assert len(error["message"]) <= MAX_ERROR_CHARS, (status, error["message"][:200])
    TALLY["openai sent"] += len(bodies)
    TALLY["openai answered"] += sum(status == 200 for status, _, _ in answers)


def test_after_the_fuzz_no_engine_failed_and_valid_requests_all_succeed(judge):
    """Runs after the fuzz tests in this module (same live judge): over 1,000 generated
    requests were sent and at least half of them reached an engine (the engines' own
    counters for HTTP; answers over ZeroMQ), health is 200 healthy, both engines serve, and
    200 of 200 valid requests succeed."""

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32)) as s:  # within the cap of 48
            async with s.get(f"{judge.url}/genrm/health") as r:
                health = (r.status, await r.json())
            _, engines = await _engine_requests(s, judge.url)
            answers = await _valid_requests_all_succeed(s, judge.url)
        return health, engines, answers

    health, engines, answers = run(main(), 300)
    print(f"hostile-input fuzz: {dict(TALLY)}")
    if TALLY["http sent"]:  # the fuzz tests ran in this session (not deselected)
        assert TALLY["http sent"] + TALLY["zmq sent"] >= 1000, TALLY
        assert TALLY["http reached an engine"] >= TALLY["http sent"] / 2, TALLY
        assert TALLY["zmq answered"] >= TALLY["zmq sent"] / 2, TALLY
    assert health == (200, {"status": "healthy", "service": "genrm"})
    assert len(engines) == 2 and all("error" not in e for e in engines), engines
    assert [status for status, _ in answers] == [200] * 200, answers[:3]


# ---------------------------------------------------------------------------- connections


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(10)
    return s


def _closed_within(s: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed ``s`` within ``seconds``, and what it sent before."""
    s.settimeout(seconds)
    got = b""
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return True, got
            got += chunk
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got


def _health(port: int) -> int:
    s = _connect(port)
    try:
        s.sendall(b"GET /genrm/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        _, got = _closed_within(s, 10)
        return int(got.split(b" ", 2)[1])
    finally:
        s.close()


def test_idle_and_slow_connections_are_closed_by_the_timeouts(judge):
    idle, slow_header, slow_body = _connect(judge.port), _connect(judge.port), _connect(judge.port)
    try:
        slow_header.sendall(b"POST /genrm/generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow_body.sendall(
            b"POST /genrm/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        t0 = time.monotonic()
        results = [_closed_within(s, 10 * TIMEOUT) for s in (idle, slow_header, slow_body)]
        took = time.monotonic() - t0
    finally:
        for s in (idle, slow_header, slow_body):
            s.close()
    assert all(closed for closed, _ in results), results
    assert results[0][1] == b""  # idle: closed without a word
    assert results[1][1].startswith(b"HTTP/1.1 408") and results[2][1].startswith(b"HTTP/1.1 408"), results
    assert took < 6 * TIMEOUT


def test_the_judge_keeps_answering_while_idle_connections_are_held(judge):
    """Idle connections do not keep new clients out: past the cap each newcomer takes the
    place of the connection idle the longest (closed without a word, as an idle timeout
    closes it), so a client is served at once, even with the cap reached (a trickle of
    requests could hold every slot before)."""
    held = []
    try:
        for _ in range(MAX_CONNECTIONS - 8):
            held.append(_connect(judge.port))
        assert _health(judge.port) == 200  # at once, with 40 idle connections open
        for _ in range(16):
            held.append(_connect(judge.port))
        evicted = [s for s in held[:8] if (r := _closed_within(s, 2))[0] and r[1] == b""]
        assert len(evicted) == 8  # the 8 oldest made room for the 8 past the cap
        assert _health(judge.port) == 200  # at the cap: the oldest idle one makes room again
    finally:
        for s in held:
            s.close()
    assert _health(judge.port) == 200


@pytest.mark.parametrize("expect", [False, True])
def test_a_declared_length_over_the_limit_gets_413_at_once(judge, expect):
    s = _connect(judge.port)
    try:
        head = (
            b"POST /genrm/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000000\r\n"
        )
        t0 = time.monotonic()
        s.sendall(head + (b"Expect: 100-continue\r\n" if expect else b"") + b"\r\n")
        closed, got = _closed_within(s, 5)
    finally:
        s.close()
    assert closed and got.startswith(b"HTTP/1.1 413") and b"100 Continue" not in got, got[:200]
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize(
    "head",
    [
        b"Transfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFF\r\n",
        b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n",
        b"Content-Length: 2\r\nContent-Length: 20\r\n\r\n{}",
    ],
)
def test_chunked_and_ambiguous_bodies_are_refused(judge, head):
    s = _connect(judge.port)
    try:
        s.sendall(b"POST /genrm/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + head)
        closed, got = _closed_within(s, 5)
    finally:
        s.close()
    assert closed and re.match(rb"HTTP/1.1 (400|411) ", got), got[:200]  # a 4xx: never a 5xx for what a client sent
