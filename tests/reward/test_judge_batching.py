"""Batching in the judge path: many judge requests share one relay call (client -> service,
service -> engine), yet each request keeps its own result or error, in its own position."""

from __future__ import annotations

import asyncio
import json

import pytest

from engines.interface import GenerateResult
from relay import Actor, endpoint, inbox_address, this_proc
from reward.client import GenRMClient
from reward.errors import BadMessages, JudgeAsleep, JudgeEngineError, UnknownRouteKey
from reward.judge import JudgeService
from tests.helpers import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
MSG = [{"role": "user", "content": "Is 2+2=4? Answer 1 or 0."}]


class CancelRecorder(Actor):
    """The rest of the engine protocol the service uses: ``cancel(tags)`` (recorded) and
    ``health``."""

    cancelled: list

    @endpoint(concurrent=True)
    async def cancel(self, tags: list) -> int:
        self.__dict__.setdefault("cancelled", []).extend(tags)
        return 0

    @endpoint(concurrent=True)
    async def health(self) -> dict:
        return {"status": "healthy"}


class EchoEngine(CancelRecorder):
    """Answers "<seed>" for each request; a request with max_new_tokens == 13 is refused;
    ``broken=True`` makes every call fail as a whole. Counts its calls."""

    def __init__(self, broken: bool = False):
        self.broken = broken
        self.calls: list[int] = []

    @endpoint(concurrent=True)
    async def generate_rendered(self, requests: list) -> list:
        self.calls.append(len(requests))
        if self.broken:
            raise RuntimeError("this engine is broken")
        return [
            ValueError("max_new_tokens 13 is refused")
            if s["max_new_tokens"] == 13
            else GenerateResult([1], f" {s['seed']} ", [0.0], "stop", len(p), 0)
            for p, s, *_ in requests
        ]

    @endpoint(concurrent=True)
    async def call_sizes(self) -> list:
        return self.calls


async def start(engines: list, **kw):
    meshes = []
    for i, broken in enumerate(engines):
        m = this_proc().spawn(f"engine{i}", EchoEngine, broken)
        await m.initialized(60)
        meshes.append(m)
    spec = {"__default__": {"model_path": kw.pop("model"), "sampling_config": {"temperature": 0.0}, "engines": meshes}}
    judge = this_proc().spawn("genrm", JudgeService, spec, cache="off")
    await judge.initialized(120)
    return judge, meshes


async def served(judge_model):
    """(engine, service, HTTP gateway, its port): one echo engine behind a judge service of
    this process and its gateway on a free port (close ``gateway.server``)."""
    from reward.gateway import Gateway

    _, (engine,) = await start([False], model=judge_model)
    svc = JudgeService(
        {"__default__": {"model_path": judge_model, "sampling_config": {"temperature": 0.0}, "engines": [engine]}},
        cache="off",
    )
    await svc.setup()
    gateway = Gateway(svc)
    return engine, svc, gateway, await gateway.server.start("127.0.0.1", 0)


def test_generate_batch_keeps_order_and_each_requests_own_error(judge_model):
    async def main():
        judge, (engine,) = await start([False], model=judge_model)
        reqs = [[MSG, {"seed": i}, None] for i in range(6)]
        reqs[1] = [MSG, {"seed": 1}, "nope"]  # unknown route key
        reqs[3] = [MSG, {"top_p": 7}, None]  # bad sampling
        reqs[4] = [[5], {"seed": 4}, None]  # malformed messages: fails rendering alone
        reqs[5] = [MSG, {"seed": 5, "max_new_tokens": 13}, None]  # refused by the engine
        reqs.append("not a request")
        reqs.append([{"role": "user", "content": "a dict, not a list"}, None, None])
        out = await judge.generate_batch.call_one(reqs).result(60)
        assert out[0] == "0" and out[2] == "2"
        assert isinstance(out[1], UnknownRouteKey) and "available=['__default__']" in str(out[1])
        assert isinstance(out[3], ValueError) and "top_p" in str(out[3])
        assert isinstance(out[4], Exception)
        assert isinstance(out[5], ValueError) and "refused" in str(out[5]) and "13" in str(out[5])
        assert isinstance(out[6], TypeError)
        assert isinstance(out[7], BadMessages) and "list of {role, content}" in str(out[7])  # the shared request check
        # the well-formed requests reached the engine together, in one call
        assert await engine.call_sizes.call_one().result(10) == [3]
        await judge.set_awake.call_one(None, False).result(10)
        (asleep,) = await judge.generate_batch.call_one([[MSG, None, None]]).result(10)
        assert isinstance(asleep, JudgeAsleep)

    run(main(), 120)


#: Values an engine's wire cannot carry (integers past 64 bits) or its sampler cannot handle.
POISONS = [
    {"seed": 2**64},
    {"top_k": 2**64},
    {"stop_token_ids": [2**64]},
    {"max_response_len": 2**64},
    {"temperature": float("nan")},
    {"max_response_len": float("nan")},
    {"top_k": 2.5, "temperature": 1.0},
    {"repetition_penalty": 1e-40, "temperature": 1.0},  # 0 in float32: it would fail the whole engine step
    {"temperature": 10**400},  # past float64: was a 500
    {"temperature": 1e300},  # inf in float32
]


def _field(poison: dict) -> str:
    return next(k for k in poison if k != "temperature" or len(poison) == 1).replace(
        "max_response_len", "max_new_tokens"
    )


def test_a_poisoned_request_never_fails_the_others_it_is_batched_with(judge_model):
    """Over HTTP (the gateway batches concurrent requests into engine calls) and over the
    ZeroMQ client (which batches concurrent calls into one message), a poisoned request is
    refused alone, naming the field: 400 / ValueError; the others get their answers."""
    import aiohttp

    async def main():
        engine, svc, gateway, port = await served(judge_model)
        try:
            async with aiohttp.ClientSession() as s:

                async def post(sp):
                    data = json.dumps({"messages": MSG, "sampling_params": sp}, allow_nan=True)
                    async with s.post(
                        f"http://127.0.0.1:{port}/genrm/generate",
                        data=data,
                        headers={"Content-Type": "application/json"},
                    ) as r:
                        return r.status, await r.json()

                http = await asyncio.gather(*(post({"seed": i}) for i in range(8)), *(post(p) for p in POISONS))
        finally:
            await gateway.server.close()
        client = GenRMClient(inbox_address())

        async def call(sp):
            try:
                return await client.generate(MSG, sp)
            except ValueError as e:
                return e

        zmq = await asyncio.gather(*(call({"seed": i}) for i in range(8)), *(call(p) for p in POISONS))
        return http, zmq

    http, zmq = run(main(), 120)
    assert http[:8] == [(200, {"response": str(i)}) for i in range(8)]
    for p, (status, body) in zip(POISONS, http[8:]):
        assert status == 400 and _field(p) in body["error"] and len(body["error"]) < 400, (p, status, body)
    assert zmq[:8] == [str(i) for i in range(8)]
    for p, e in zip(POISONS, zmq[8:]):
        assert isinstance(e, ValueError) and _field(p) in str(e), (p, e)


def test_concurrent_requests_share_engine_calls_and_get_their_own_answers(judge_model):
    async def main():
        judge, (engine,) = await start([False], model=judge_model)
        got = await asyncio.gather(*(judge.generate.call_one(MSG, {"seed": i}).result(60) for i in range(40)))
        assert got == [str(i) for i in range(40)]
        sizes = await engine.call_sizes.call_one().result(10)
        assert sum(sizes) == 40 and len(sizes) < 40

    run(main(), 120)


def test_client_coalesces_calls_but_each_caller_gets_its_result_or_error(judge_model):
    async def main():
        judge, (engine,) = await start([False], model=judge_model)
        client = GenRMClient(inbox_address())

        async def one(i):
            try:
                if i == 7:
                    return await client.generate(MSG, {"seed": i}, route_key="nope")
                if i == 9:
                    return await client.generate(MSG, {"seed": i, "max_new_tokens": 13})
                return await client.generate(MSG, {"seed": i})
            except Exception as e:  # noqa: BLE001
                return e

        got = await asyncio.gather(*(one(i) for i in range(30)))
        for i, g in enumerate(got):
            if i == 7:
                assert isinstance(g, UnknownRouteKey)
            elif i == 9:
                assert isinstance(g, ValueError) and "refused" in str(g)
            else:
                assert g == str(i)
        assert await client.generate_many([MSG] * 5, {"seed": 3}) == ["3"] * 5
        sizes = await engine.call_sizes.call_one().result(10)
        assert sum(sizes) == 29 + 5 and len(sizes) < 10  # all but the unknown route key

    run(main(), 120)


def test_requests_an_engine_fails_are_retried_on_another_engine_after_a_backoff(judge_model):
    """An engine whose calls fail (not the requests' fault): each of its requests is tried
    again, RETRY_BACKOFF later, on the engine it has not failed on; every request is answered."""
    from reward.dispatch import RETRY_BACKOFF

    async def main():
        judge, (good, bad) = await start([False, True], model=judge_model)
        t0 = asyncio.get_running_loop().time()
        got = await judge.generate_batch.call_one([[MSG, {"seed": i}, None] for i in range(20)]).result(60)
        took = asyncio.get_running_loop().time() - t0
        bad_sizes = await bad.call_sizes.call_one().result(10)
        good_sizes = await good.call_sizes.call_one().result(10)
        snapshot = await judge.metrics_snapshot.call_one().result(10)
        return got, took, bad_sizes, good_sizes, snapshot["__default__"]

    got, took, bad_sizes, good_sizes, counts = run(main(), 120)
    assert sum(bad_sizes) > 0  # least-loaded: the broken engine got some
    assert got == [str(i) for i in range(20)]
    assert sum(good_sizes) == 20  # the good engine answered all, those that failed on the broken one included
    assert counts["retries"] == sum(bad_sizes) and counts["errors_engine"] == sum(bad_sizes)
    assert took >= RETRY_BACKOFF


def test_a_request_every_engine_fails_gets_a_5xx_error_after_its_attempts(judge_model):
    """Only broken engines: each request is tried ATTEMPTS times (backoff 0.3 s, then 0.6 s),
    then fails with JudgeEngineError (502), naming the engine's error."""
    from reward.dispatch import ATTEMPTS, RETRY_BACKOFF

    async def main():
        judge, (bad,) = await start([True], model=judge_model)
        t0 = asyncio.get_running_loop().time()
        got = await judge.generate_batch.call_one([[MSG, {"seed": i}, None] for i in range(3)]).result(60)
        took = asyncio.get_running_loop().time() - t0
        return got, took, await bad.call_sizes.call_one().result(10)

    got, took, sizes = run(main(), 120)
    assert all(isinstance(g, JudgeEngineError) and "this engine is broken" in str(g) for g in got), got
    assert sum(sizes) == 3 * ATTEMPTS
    assert took >= RETRY_BACKOFF * sum(range(1, ATTEMPTS))


def test_rendering_gives_the_ids_of_apply_chat_template(judge_model):
    """Batched or one by one, through the compiled template (plain messages) or through
    apply_chat_template (anything else, other chat_template_kwargs), rendered by the service
    and tokenized as the engines do: the ids of apply_chat_template(tokenize=True)."""
    from transformers import AutoTokenizer

    from engines.interface import encode_rendered
    from reward.templates import ChatTemplate

    tok = AutoTokenizer.from_pretrained(judge_model)
    convs = [
        MSG,
        [{"role": "system", "content": "Be strict."}, {"role": "user", "content": "x = \\frac{1}{2}?"}],
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "ünïcode ✓ <|im_end|>"},
        ],
        [{"role": "user", "content": "tool-less", "name": None}],  # not plain: goes through apply_chat_template
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        template = ChatTemplate.of(tok, kwargs)
        assert template.compiled is not None
        expected = [
            list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs))
            for c in convs
        ]
        # the compiled fast path (the configured kwargs themselves) and apply_chat_template (a copy)
        for given in (template.kwargs, dict(template.kwargs)):
            assert encode_rendered(tok, template.render(convs, given)) == expected
            assert [encode_rendered(tok, template.render([c], given))[0] for c in convs] == expected


class GatedEngine(CancelRecorder):
    """Holds every request until ``release``; records the most requests it held at once."""

    def __init__(self):
        self.held = 0
        self.most = 0
        self.gate = asyncio.Event()

    @endpoint(concurrent=True)
    async def generate_rendered(self, requests: list) -> list:
        self.held += len(requests)
        self.most = max(self.most, self.held)
        await self.gate.wait()
        self.held -= len(requests)
        return [GenerateResult([1], "1", [0.0], "stop", len(p), 0) for p, *_ in requests]

    @endpoint(concurrent=True)
    async def release(self) -> int:
        self.gate.set()
        return self.most

    @endpoint(concurrent=True)
    async def holding(self) -> int:
        return self.held


def test_concurrency_cap_per_engine_holds_the_rest_back_until_answers_come(judge_model):
    async def main():
        engine = this_proc().spawn("gated", GatedEngine)
        await engine.initialized(60)
        spec = {"__default__": {"model_path": judge_model, "engines": [engine]}}
        judge = this_proc().spawn("genrm", JudgeService, spec, max_concurrency_per_engine=3, cache="off")
        await judge.initialized(120)
        calls = [judge.generate.call_one(MSG, {"seed": i}).result(60) for i in range(10)]
        for _ in range(200):
            if await engine.holding.call_one().result(10) == 3:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # nothing more may arrive while the first three are held
        assert await engine.holding.call_one().result(10) == 3
        most = await engine.release.call_one().result(10)
        assert await asyncio.gather(*calls) == ["1"] * 10 and most == 3

    run(main(), 120)


def test_a_dead_engine_is_retried_once_on_another_then_reported(judge_model, faults):
    """Engines in processes of their own: killing one turns its calls into transport
    failures, which the service retries once on the other engine; with both dead the
    caller gets JudgeUnavailable."""
    import os
    import signal

    from relay import this_host
    from reward.errors import JudgeUnavailable

    async def main():
        procs = this_host().spawn_procs(per_host={"engines": 2}, name="deadengines")
        try:
            engines = procs.spawn("engine", EchoEngine)
            await engines.initialized(60)
            meshes = [engines.slice(engines=i) for i in range(2)]
            spec = {
                "__default__": {"model_path": judge_model, "sampling_config": {"temperature": 0.0}, "engines": meshes}
            }
            judge = this_proc().spawn("genrm", JudgeService, spec, cache="off")
            await judge.initialized(120)
            assert await judge.generate_batch.call_one([[MSG, {"seed": i}, None] for i in range(4)]).result(60) == [
                "0",
                "1",
                "2",
                "3",
            ]
            os.kill(procs.procs[0].pid, signal.SIGKILL)
            for _ in range(100):  # until the runtime has seen the death
                try:
                    await meshes[0].call_sizes.call_one().result(1)
                except Exception:  # noqa: BLE001
                    break
                await asyncio.sleep(0.05)
            got = await judge.generate_batch.call_one([[MSG, {"seed": i}, None] for i in range(8)]).result(60)
            assert got == [str(i) for i in range(8)]  # all answered by the live engine
            metrics = await judge.metrics_snapshot.call_one().result(10)
            assert metrics["__default__"]["errors_transport"] >= 1
            os.kill(procs.procs[1].pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            got = await judge.generate_batch.call_one([[MSG, {"seed": 1}, None]]).result(60)
            # both engines left dispatch: the request fails at once, naming why
            assert (
                isinstance(got[0], JudgeUnavailable)
                and "has no working engine" in str(got[0])
                and "SIGKILL" in str(got[0])
            )
            assert (await judge.metrics_snapshot.call_one().result(10))["__default__"]["engines_down"] == 2
            health = (await judge.health.call_one().result(10))["__default__"]
            assert health["status"] == "unhealthy" and health["available"] is False
            assert {f.proc_id for f in faults} == {p.proc_id for p in procs.procs}  # both deaths reported
        finally:
            await procs.stop()

    run(main(), 180)


def test_gateway_answers_503_when_the_judge_does_not_answer_in_time(judge_model):
    """A request the engine holds past the gateway's timeout gets 503 with a reason; the
    gateway keeps serving (health) meanwhile."""
    import aiohttp

    from reward.gateway import Gateway

    async def main():
        engine = this_proc().spawn("gated2", GatedEngine)
        await engine.initialized(60)
        svc = JudgeService({"__default__": {"model_path": judge_model, "engines": [engine]}}, cache="off")
        await svc.setup()  # the service object itself, as its own process's gateway uses it
        gateway = Gateway(svc, timeout=0.5)
        port = await gateway.server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/genrm/generate", json={"messages": MSG}) as r:
                    status, body = r.status, await r.json()
                async with s.get(f"http://127.0.0.1:{port}/genrm/metrics") as r:
                    errors = (await r.json())["gateway_errors"]
        finally:
            await engine.release.call_one().result(10)
            await gateway.server.close()
        return status, body, errors

    status, body, errors = run(main(), 120)
    assert status == 503 and "did not answer within 0.5 s" in body["error"]
    assert errors == {"timeout": 1}  # (no working engine is "unavailable")


def test_serving_http_on_a_taken_port_says_to_choose_another(judge_model):
    import socket

    async def main():
        engine = this_proc().spawn("gated3", GatedEngine)
        await engine.initialized(60)
        svc = JudgeService({"__default__": {"model_path": judge_model, "engines": [engine]}}, cache="off")
        await svc.setup()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} .*choose another port"):
                await svc.serve_http("127.0.0.1", port)
        assert svc._http is None  # nothing half-started

    run(main(), 60)


class PromptEcho(CancelRecorder):
    """Answers each request with the rendered prompt it was sent."""

    @endpoint(concurrent=True)
    async def generate_rendered(self, requests: list) -> list:
        return [GenerateResult([1], p, [0.0], "stop", len(p), 0) for p, *_ in requests]


def test_no_client_template_source_and_only_scalar_template_arguments_the_template_reads(judge_model):
    """Message text is data (a Jinja expression in it is not evaluated); chat_template and
    apply_chat_template's own arguments are refused; an argument the template reads changes
    the prompt, one it does not read is dropped; non-scalars are refused; a rendered prompt
    past the bound is refused (over relay: HTTP bodies cannot get there)."""
    from reward.templates import MAX_RENDERED_CHARS

    async def main():
        m = this_proc().spawn("echo", PromptEcho)
        await m.initialized(60)
        spec = {"__default__": {"model_path": judge_model, "sampling_config": {"temperature": 0.0}, "engines": [m]}}
        judge = this_proc().spawn("genrm", JudgeService, spec, cache="off")
        await judge.initialized(120)
        jinja = [{"role": "user", "content": "{{ 7*7 }} {% for i in range(10**9) %}x{% endfor %}"}]
        reqs = [
            [jinja, None, None],
            [MSG, {"chat_template_kwargs": {"chat_template": "{{ 7*7 }}"}}, None],
            [MSG, {"chat_template_kwargs": {"tools": "x"}}, None],
            [MSG, {"chat_template_kwargs": {"add_generation_prompt": False}}, None],
            [MSG, {"chat_template_kwargs": {"eos_token": "x"}}, None],
            [MSG, {"chat_template_kwargs": {"enable_thinking": [1, 2]}}, None],
            [MSG, {"chat_template_kwargs": {f"k{i}": 1 for i in range(17)}}, None],
            [MSG, {"chat_template_kwargs": {"enable_thinking": False}}, None],
            [MSG, {"chat_template_kwargs": {"not_read_by_the_template": "x" * 256}}, None],
            [MSG, None, None],
            [[{"role": "user", "content": "z" * (MAX_RENDERED_CHARS + 1)}], None, None],
        ]
        return await judge.generate_batch.call_one(reqs).result(60)

    out = run(main(), 120)
    assert "{{ 7*7 }} {% for i in range(10**9) %}x{% endfor %}" in out[0] and "49" not in out[0]
    for got, name in zip(out[1:5], ("chat_template", "tools", "add_generation_prompt", "eos_token")):
        assert isinstance(got, ValueError) and f"chat_template_kwargs.'{name}' is not allowed" in str(got), got
    assert isinstance(out[5], ValueError) and "must be null, a boolean, a finite number or a string" in str(out[5])
    assert isinstance(out[6], ValueError) and "at most 16 entries" in str(out[6])
    assert "<think>" in out[7] and "<think>" not in out[9]  # read by the template: changes the prompt
    assert out[8] == out[9]  # not read: dropped
    assert isinstance(out[10], ValueError) and f"at most {MAX_RENDERED_CHARS}" in str(out[10])


class FailedEngine(CancelRecorder):
    """Reports EngineFailed for every request (its steps cannot run any more); counts calls."""

    def __init__(self):
        self.calls = 0

    @endpoint(concurrent=True)
    async def generate_rendered(self, requests: list) -> list:
        from engines.interface import EngineFailed

        self.calls += 1
        return [EngineFailed("engine: the engine failed and serves no more requests: CUDA error") for _ in requests]

    @endpoint(concurrent=True)
    async def call_count(self) -> int:
        return self.calls


def test_an_engine_that_cannot_go_on_leaves_dispatch_at_once(judge_model):
    """The failed engine answers instantly, so least-loaded dispatch would prefer it: it must
    leave dispatch at its first EngineFailed, its requests go to the other engine, and no
    later request is sent to it."""

    async def main():
        bad = this_proc().spawn("failed", FailedEngine)
        good = this_proc().spawn("good", EchoEngine)
        await bad.initialized(60)
        await good.initialized(60)
        spec = {
            "__default__": {"model_path": judge_model, "sampling_config": {"temperature": 0.0}, "engines": [bad, good]}
        }
        judge = this_proc().spawn("genrm", JudgeService, spec, cache="off")
        await judge.initialized(120)
        first = await judge.generate_batch.call_one([[MSG, {"seed": i}, None] for i in range(10)]).result(60)
        calls = await bad.call_count.call_one().result(10)
        later = [
            await judge.generate_batch.call_one([[MSG, {"seed": i}, None] for i in range(10)]).result(60)
            for _ in range(5)
        ]
        health = await judge.health.call_one().result(10)
        metrics = await judge.metrics_snapshot.call_one().result(10)
        return first, calls, later, await bad.call_count.call_one().result(10), health, metrics

    first, calls, later, calls_after, health, metrics = run(main(), 120)
    assert first == [str(i) for i in range(10)]  # each retried once, on the working engine
    assert all(batch == [str(i) for i in range(10)] for batch in later)
    assert calls == calls_after == 1  # never chosen again
    h = health["__default__"]
    assert h["status"] == "unhealthy" and "CUDA error" in h["error"] and "available" not in h
    assert metrics["__default__"]["engines_down"] == 1


def test_a_template_the_sandbox_cannot_match_renders_through_apply_chat_template(judge_model):
    """A template with transformers-only tags ({% generation %}) has no compiled fast path;
    its prompts still come out exactly as apply_chat_template renders them."""
    from transformers import AutoTokenizer

    from reward.templates import ChatTemplate

    tok = AutoTokenizer.from_pretrained(judge_model)
    tok.chat_template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    template = ChatTemplate.of(tok, {})
    assert template.compiled is None
    convs = [MSG, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]]
    expected = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
    assert template.render(convs, template.kwargs) == expected


def test_a_sync_hook_reaches_the_judge_from_its_worker_threads_own_event_loop(judge_model):
    """Sync post-process hooks run in a worker thread (launcher/rl/scoring.py) and may call
    ``asyncio.run`` themselves: ``get_genrm_client()`` there is that loop's own client, and
    its calls are answered like those of the job's loop."""
    from reward.client import get_genrm_client

    def sync_hook(address: str) -> list:
        async def judge_all():
            client = get_genrm_client(address)
            return await asyncio.gather(*(client.generate(MSG, {"seed": i}) for i in range(5)))

        return asyncio.run(judge_all())

    async def main():
        await start([False], model=judge_model)
        address = inbox_address()
        on_loop = await get_genrm_client(address).generate(MSG, {"seed": 1})
        in_thread = await asyncio.to_thread(sync_hook, address)
        return on_loop, in_thread

    assert run(main(), 120) == ("1", ["0", "1", "2", "3", "4"])


def test_a_lone_surrogate_fails_only_its_own_request_at_every_edge(judge_model):
    """A lone surrogate (not UTF-8: it cannot travel to an engine) in a message's content or
    role, a stop string, a native text or the OpenAI route's content is refused alone with
    400 naming the field (HTTP) or ValueError (the ZeroMQ client; ``generate_many`` serves
    the valid conversations beside it); past the checks (a request admitted unchecked),
    dispatch sends the engine call that could not go again one request each: the innocent
    ones are answered."""
    import aiohttp

    bad = "\ud800"
    http_cases = [
        ("/genrm/generate", {"messages": [{"role": "user", "content": "a" + bad}]}, "messages[0].content"),
        ("/genrm/generate", {"messages": [{"role": "us" + bad, "content": "a"}]}, "messages[0].role"),
        ("/genrm/generate", {"messages": MSG, "sampling_params": {"stop": [bad]}}, "sampling_params.stop[0]"),
        ("/genrm/generate", {"text": "x" + bad}, "text holds a lone surrogate"),
        ("/genrm/v1/chat/completions", {"model": "__default__", "messages": [{"role": "user", "content": bad}]},
         "messages[0].content"),
        ("/genrm/v1/chat/completions", {"model": "__default__", "messages": MSG, "stop": bad}, "stop"),
    ]

    async def main():
        engine, svc, gateway, port = await served(judge_model)
        try:
            async with aiohttp.ClientSession() as s:

                async def post(path, body):
                    async with s.post(f"http://127.0.0.1:{port}{path}", data=json.dumps(body),
                                      headers={"Content-Type": "application/json"}) as r:
                        return r.status, await r.json()

                http = await asyncio.gather(*(post("/genrm/generate", {"messages": MSG, "sampling_params": {"seed": i}})
                                              for i in range(8)), *(post(p, b) for p, b, _ in http_cases))
            # admitted unchecked (as if a check missed it): batched with 8 innocent requests
            futures = [svc.submit(MSG, {"seed": i}, checked=True) for i in range(8)]
            futures.append(svc.submit([{"role": "user", "content": bad}], None, checked=True))
            unchecked = await asyncio.gather(*futures, return_exceptions=True)
            split = (await svc.metrics_snapshot())
        finally:
            await gateway.server.close()
        client = GenRMClient(inbox_address())
        before = list(await engine.call_sizes.call_one().result(10))
        convs = [[{"role": "user", "content": f"q{i}"}] for i in range(8)]
        many = None
        try:
            await client.generate_many(convs + [[{"role": "user", "content": bad}]], {"seed": 1})
        except ValueError as e:
            many = e
        reached = sum((await engine.call_sizes.call_one().result(10))[len(before):])
        return http, unchecked, split, many, reached

    http, unchecked, split, many, reached = run(main(), 120)
    assert http[:8] == [(200, {"response": str(i)}) for i in range(8)]
    for (path, _, field), (status, body) in zip(http_cases, http[8:]):
        message = body["error"] if isinstance(body["error"], str) else body["error"]["message"]
        assert status == 400 and field in message and "lone surrogate" in message, (path, status, body)
    assert unchecked[:8] == [str(i) for i in range(8)]
    assert isinstance(unchecked[8], ValueError) and "cannot be sent to the engine" in str(unchecked[8])
    assert "calls_split" in json.dumps(split, default=str)
    assert isinstance(many, ValueError) and "lone surrogate" in str(many)
    assert reached >= 8  # the valid conversations reached the engine


def test_openai_choices_with_a_seed_differ_and_n_in_sampling_params_is_refused_at_admission(judge_model):
    """``n`` choices with a ``seed`` sample with seed, seed + 1, ... (they were n copies of one);
    ``sampling_params.n`` > 1 on /genrm/generate is a 400 naming it (it passed the service and
    failed at the engine)."""
    import aiohttp

    async def main():
        engine, svc, gateway, port = await served(judge_model)
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": "__default__", "messages": MSG, "n": 3, "seed": 5, "temperature": 1.0}
                async with s.post(f"http://127.0.0.1:{port}/genrm/v1/chat/completions", json=body) as r:
                    chat = r.status, await r.json()
                body = {"messages": MSG, "sampling_params": {"n": 2, "temperature": 1.0}}
                async with s.post(f"http://127.0.0.1:{port}/genrm/generate", json=body) as r:
                    many = r.status, await r.json()
        finally:
            await gateway.server.close()
        return chat, many, await engine.call_sizes.call_one().result(10)

    (status, chat), (n_status, refused), calls = run(main(), 120)
    assert status == 200 and [c["message"]["content"] for c in chat["choices"]] == ["5", "6", "7"]
    assert n_status == 400 and "sampling_params.n must be 1" in refused["error"]
    assert sum(calls) == 3  # the refused request never reached the engine
