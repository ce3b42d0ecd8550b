"""The judge service, HTTP gateway and ZeroMQ client against a tiny built-in-engine judge."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import textwrap
import threading

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.actor import EngineActor
from relay import ActorError, this_host
from reward.gateway import validate_request
from reward.judge import start_judge_service
from tests.helpers import interrupt, run
from tests.launcher.test_launch import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MSG = [{"role": "user", "content": "Is 2+2=4? Answer 1 or 0."}]


async def start(judge_model, instances=("__default__",), token=None, unhealthy_status=200):
    procs = this_host().spawn_procs(per_host={"gpus": len(instances)}, name="judges")
    engines = procs.spawn(
        "judge-engine", EngineActor, judge_model, "torch", kv_cache_tokens=2048, weights_mode="backup"
    )
    await engines.initialized(120)
    spec = {
        name: {
            "model_path": judge_model,
            "num_gpus": 1,
            "sampling_config": {"temperature": 0.0, "max_response_len": 4},
            "engines": [engines.slice(gpus=i)],
        }
        for i, name in enumerate(instances)
    }
    judge, judge_procs = await start_judge_service(spec, 120)  # serving HTTP from its own process
    port = await judge.serve_http.call_one("127.0.0.1", free_port(), token, None, unhealthy_status).result(30)
    return procs, engines, judge, judge_procs, f"http://127.0.0.1:{port}"


def _with_secret() -> dict:
    """This process's environment with its relay secret exported (a client process needs it)."""
    import relay

    relay.job_secret()  # settles and exports this process's secret
    return dict(os.environ)


def test_generate_health_metrics_and_sleeping_judge(judge_model):
    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/genrm/generate", json={"messages": MSG}) as r:
                assert r.status == 200
                first = (await r.json())["response"]
            assert isinstance(first, str)
            async with s.post(
                f"{url}/genrm/generate", json={"messages": MSG, "sampling_params": {"max_new_tokens": 2}}
            ) as r:
                assert r.status == 200
            async with s.get(f"{url}/genrm/health") as r:
                assert await r.json() == {"status": "healthy", "service": "genrm"}
            # curl, as a user would (in a thread: a blocking call)
            out = await asyncio.to_thread(
                subprocess.run, ["curl", "-s", f"{url}/genrm/health"], capture_output=True, text=True, timeout=30
            )
            assert json.loads(out.stdout)["status"] == "healthy"
            out = await asyncio.to_thread(
                subprocess.run,
                [
                    "curl",
                    "-s",
                    "-X",
                    "POST",
                    f"{url}/genrm/generate",
                    "-H",
                    "Content-Type: application/json",
                    "-d",
                    json.dumps({"messages": MSG}),
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert json.loads(out.stdout) == {"response": first}  # deterministic: cached
            # close admission (the controller does this while the judge sleeps)
            await judge.set_awake.call_one(None, False)
            async with s.post(f"{url}/genrm/generate", json={"messages": MSG}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
            async with s.get(f"{url}/genrm/health") as r:  # says why generate answers 503
                assert await r.json() == {"status": "healthy", "service": "genrm", "sleeping": True}
            await judge.set_awake.call_one(None, True)
            async with s.get(f"{url}/genrm/health") as r:
                assert await r.json() == {"status": "healthy", "service": "genrm"}
            async with s.get(f"{url}/genrm/metrics") as r:  # the original's JSON, one instance: flat
                assert r.headers["Content-Type"].startswith("application/json")
                m = await r.json()
            assert m["service"] == "genrm" and m["model_path"] == judge_model and m["num_gpus"] == 1
            assert "instances" not in m
            inst = m
            assert (
                inst["num_engines"] == 1
                and inst["requests"] == 3
                and inst["cache_hits"] == 1
                and inst["rejected_asleep"] == 1
            )
            lat = inst["latency_s"]  # cumulative histogram of the two calls that reached the engine
            assert lat["count"] == 2 and lat["buckets"][-1] == ["+Inf", 2] and lat["sum"] > 0
            for i in range(25):  # reward code reports unreadable verdicts: warned past 20%
                await judge.record_parse.call_one(None, i % 3 != 0)
            async with s.get(f"{url}/metrics") as r:  # Prometheus text
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = await r.text()
            # per judge instance under route_key (Prometheus keeps `instance` for its target)
            assert 'genrm_parse_failures_total{route_key="__default__"} 9\n' in text
            assert 'genrm_verdicts_total{route_key="__default__"} 25\n' in text
            assert 'genrm_requests_total{route_key="__default__"} 3\n' in text
            assert 'genrm_latency_seconds_bucket{route_key="__default__",le="+Inf"} 2\n' in text
            assert 'genrm_latency_seconds_count{route_key="__default__"} 2\n' in text
            assert "instance=" not in text and "_created" not in text
            # nothing happened in between but a scrape: the same judge series (the HTTP server's
            # count the scrape); /genrm/metrics serves the same text to a Prometheus Accept header
            prom_accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
            async with s.get(f"{url}/genrm/metrics", headers={"Accept": prom_accept}) as r:
                assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                again = await r.text()

            def judge_series(t):
                return [line for line in t.splitlines() if not line.startswith(("genrm_http_", "# "))]

            assert judge_series(again) == judge_series(text) and len(judge_series(text)) > 20
        with pytest.raises(ActorError, match="already served"):
            await judge.serve_http.call_one("127.0.0.1", 0).result(10)
        await judge_procs.stop()
        await procs.stop()

    run(main(), 240)


BAD_BODIES = [
    (b"not json", 400),
    (b"", 400),
    (b"[]", 400),
    (b'"text"', 400),
    (b"{}", 422),
    (b'{"messages": []}', 422),
    (b'{"messages": "hi"}', 422),
    (b'{"messages": [1]}', 422),
    (b'{"messages": [{"role": "user"}]}', 422),
    (b'{"messages": [{"role": 5, "content": "x"}]}', 422),
    (b'{"messages": [{"role": "", "content": "x"}]}', 422),  # any role the template takes, but not none
    (json.dumps({"messages": [{"role": "r" * 65, "content": "x"}]}).encode(), 422),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}', 400),
    (b'{"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}', 422),
    (b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', 422),
    (b'{"messages": [{"role": "user", "content": []}]}', 422),
    (b'{"text": "hi", "input_ids": [1]}', 400),
    (b'{"input_ids": [1, -1]}', 400),
    (b'{"input_ids": [1, 100000]}', 400),  # not in the tiny judge's vocabulary
    (b'{"input_ids": [true]}', 400),
    (b'{"text": ""}', 400),
    (b'{"text": "hi", "stream": true}', 400),
    (b'{"messages": [{"role": "user", "content": "x", "extra": 1}]}', 422),
    (json.dumps({"messages": MSG, "sampling_params": "hot"}).encode(), 400),
    (json.dumps({"messages": MSG, "sampling_params": {"temprature": 1}}).encode(), 400),
    (json.dumps({"messages": MSG, "sampling_params": {"top_p": 7}}).encode(), 400),
    (json.dumps({"messages": MSG, "route_key": 3}).encode(), 400),
    (json.dumps({"messages": MSG, "route_key": "nope"}).encode(), 400),
    (json.dumps({"messages": MSG, "extra": 1, "stream": True}).encode(), 400),  # other fields ignored; not streaming
    (b"{" * 5000, 400),
    (b'{"messages": [{"role": "user", "content": "' + b"x" * (2 << 20) + b'"}]}', 413),
]


def test_bad_input_gets_4xx_and_the_service_stays_healthy(judge_model):
    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model)
        async with aiohttp.ClientSession() as s:
            for body, status in BAD_BODIES:
                async with s.post(
                    f"{url}/genrm/generate", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    text = await r.text()
                    assert r.status == status, (body[:80], r.status, text)
                    assert r.status < 500
            async with s.post(f"{url}/genrm/generate", json={"messages": MSG, "route_key": "nope"}) as r:
                assert (
                    "No GenRM instance registered for route_key='nope'; available=['__default__']"
                    in (await r.json())["error"]
                )
            async with s.get(f"{url}/genrm/health") as r:
                assert (await r.json())["status"] == "healthy"
        await judge_procs.stop()
        await procs.stop()

    run(main(), 240)


def test_route_keys_token_and_zmq_client_from_another_process(judge_model):
    async def main():
        procs, engines, judge, judge_procs, url = await start(
            judge_model, instances=("quality", "safety"), token="s3cret"
        )
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/genrm/health") as r:
                assert r.status == 401
            h = {"Authorization": "Bearer s3cret"}
            async with s.get(f"{url}/genrm/health", headers=h) as r:
                body = await r.json()
            assert body["status"] == "healthy" and set(body["instances"]) == {"quality", "safety"}
            await judge.set_awake.call_one("safety", False)
            async with s.get(f"{url}/genrm/health", headers=h) as r:
                assert (await r.json())["instances"] == {
                    "quality": {"status": "healthy"},
                    "safety": {"status": "healthy", "sleeping": True},
                }
            await judge.set_awake.call_one("safety", True)
            async with s.post(f"{url}/genrm/generate", json={"messages": MSG}, headers=h) as r:
                assert (
                    r.status == 400 and "route_key='__default__'" in (await r.json())["error"]
                )  # several: must choose
            async with s.post(f"{url}/genrm/generate", json={"messages": MSG, "route_key": "safety"}, headers=h) as r:
                assert r.status == 200
        addr = judge._view.members[0].proc.addr
        script = textwrap.dedent(
            f"""
            import asyncio, json, sys
            sys.path.insert(0, {ROOT!r})
            from reward.client import get_genrm_client
            from reward.errors import UnknownRouteKey
            async def main():
                c = get_genrm_client({addr!r})
                assert get_genrm_client({addr!r}) is c
                one = await c.generate({MSG!r}, route_key="quality")
                many = await c.generate_many([{MSG!r}] * 3, route_key="safety")
                try:
                    await c.generate({MSG!r}, route_key="nope")
                except UnknownRouteKey as e:
                    err = str(e)
                print(json.dumps({{"one": one, "many": many, "err": err}}))
            asyncio.run(main())
            """
        )
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
            env=_with_secret()
        )
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert isinstance(got["one"], str) and len(got["many"]) == 3
        assert "available=['quality', 'safety']" in got["err"]
        await judge_procs.stop()
        await procs.stop()

    run(main(), 240)


def test_auth_is_exact_and_without_a_token_browsers_are_kept_out(judge_model):
    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model, token="s3cret")
        open_procs, open_engines, _, open_judge_procs, open_url = await start(judge_model)
        got = {}
        try:
            async with aiohttp.ClientSession() as s:
                for name, headers in {
                    "none": {},
                    "wrong": {"Authorization": "Bearer nope"},
                    "basic": {"Authorization": "Basic czNjcmV0"},
                    "lower": {"Authorization": "bearer s3cret"},
                    "upper": {"Authorization": "BEARER  s3cret"},
                }.items():
                    for route in ("health", "metrics"):
                        async with s.get(f"{url}/genrm/{route}", headers=headers) as r:
                            got[(name, route)] = (r.status, r.headers.get("WWW-Authenticate"))
                # two Authorization headers: ambiguous, refused (not "the first wins")
                raw = [("Authorization", "Bearer s3cret"), ("Authorization", "Bearer other")]
                async with s.get(f"{url}/genrm/health", headers=raw) as r:
                    got["two"] = r.status
                async with s.get(f"{url}/genrm/metrics") as r:
                    got["unauthorized_count"] = r.status
                async with s.get(f"{url}/metrics") as r:
                    got["unauthorized_prometheus"] = r.status
                async with s.get(f"{url}/genrm/no-such-route") as r:  # no route list before authentication
                    got["unauthorized_404"] = (r.status, "routes" in await r.text())
                async with s.get(f"{url}/genrm/metrics", headers={"Authorization": "Bearer s3cret"}) as r:
                    got["errors"] = (await r.json())["gateway_errors"]
                post = f"{open_url}/genrm/generate"
                body = json.dumps({"messages": MSG})
                port = open_url.rsplit(":", 1)[1]
                for name, headers in {
                    "text/plain": {"Content-Type": "text/plain"},
                    "form": {"Content-Type": "application/x-www-form-urlencoded"},
                    "no type": {},
                    "rebinding": {"Content-Type": "application/json", "Host": f"evil.example:{port}"},
                    "other site": {"Content-Type": "application/json", "Origin": "http://evil.example"},
                    "same site": {"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"},
                    "localhost": {"Content-Type": "application/json; charset=utf-8", "Host": f"localhost:{port}"},
                }.items():
                    async with s.post(post, data=body, headers=headers, skip_auto_headers=["Content-Type"]) as r:
                        got[name] = (r.status, (await r.json()).get("error", ""))
        finally:
            await judge_procs.stop()
            await procs.stop()
            await open_judge_procs.stop()
            await open_procs.stop()
        return got

    got = run(main(), 240)
    challenge = 'Bearer realm="genrm"'
    for name in ("none", "wrong", "basic"):
        assert got[(name, "health")] == got[(name, "metrics")] == (401, challenge), name
    for name in ("lower", "upper"):  # the scheme is case-insensitive (RFC 7235)
        assert got[(name, "health")][0] == got[(name, "metrics")][0] == 200, name
    assert got["two"] == 400
    assert got["unauthorized_prometheus"] == 401
    assert got["unauthorized_404"] == (401, False)  # was a 404 listing every route
    assert got["errors"]["unauthorized"] == 9  # every 401 counted
    for name in ("text/plain", "form", "no type"):
        assert got[name][0] == 415 and "Content-Type: application/json" in got[name][1], (name, got[name])
    assert got["rebinding"][0] == 403 and "evil.example" in got["rebinding"][1]
    assert got["other site"][0] == 403 and "evil.example" in got["other site"][1]
    assert got["same site"][0] == got["localhost"][0] == 200


def test_callers_that_leave_have_their_engine_work_aborted(judge_model):
    """An HTTP client that disconnects and a ZeroMQ caller whose task is cancelled: the
    service counts both as cancelled and the engine stops generating for them."""

    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model)
        long = {"max_new_tokens": 1900, "ignore_eos": True, "temperature": 0.0}
        engine = engines.slice(gpus=0)

        async def settled(cancelled: int) -> dict:
            for _ in range(200):
                stats = await engine.stats.call_one().result(10)
                metrics = (await judge.metrics_snapshot.call_one().result(10))["__default__"]
                if stats["running"] == 0 and metrics.get("cancelled") == cancelled:
                    break
                await asyncio.sleep(0.05)
            return {**stats, "cancelled": metrics.get("cancelled")}

        try:
            async with aiohttp.ClientSession() as s:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        s.post(f"{url}/genrm/generate", json={"messages": MSG, "sampling_params": long}), 0.5
                    )
            after_http = await settled(1)
            addr = judge._view.members[0].proc.addr
            script = textwrap.dedent(f"""
                import asyncio, sys
                sys.path.insert(0, {ROOT!r})
                from reward.client import GenRMClient
                async def main():
                    c = GenRMClient({addr!r})
                    task = asyncio.ensure_future(c.generate({MSG!r}, {{**{long!r}, "seed": 1}}))
                    await asyncio.sleep(0.5)
                    task.cancel()
                    await asyncio.sleep(0.5)  # the cancel message goes out
                asyncio.run(main())
            """)
            out = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
            env=_with_secret()
            )
            assert out.returncode == 0, out.stderr
            after_zmq = await settled(2)
        finally:
            await judge_procs.stop()
            await procs.stop()
        return after_http, after_zmq

    after_http, after_zmq = run(main(), 240)
    assert after_http["cancelled"] == 1 and after_http["running"] == 0
    assert after_zmq["cancelled"] == 2 and after_zmq["running"] == 0
    # neither ran to its end: the engine aborted each (the first before the second started)
    assert (
        after_http["tokens_generated"] < 1900 and after_zmq["tokens_generated"] - after_http["tokens_generated"] < 1900
    )
    assert after_zmq["kv_blocks_free"] == after_zmq["kv_blocks_total"]


@pytest.mark.parametrize("unhealthy_status", [200, 503])
def test_with_no_working_engine_generate_answers_503_and_health_says_why(judge_model, faults, unhealthy_status):
    """A judge whose only engine process was killed: /genrm/generate answers 503 at once
    (not a 400, not a wait), and /genrm/health says why: with status 200 and the body, as the
    original, or 503 (--genrm-gateway-unhealthy-503: a watchdog that reads the status restarts
    it); asleep is 200 either way (tested above)."""
    import signal

    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model, unhealthy_status=unhealthy_status)
        try:
            os.kill(procs.procs[0].pid, signal.SIGKILL)
            async with aiohttp.ClientSession() as s:
                for _ in range(100):  # until the service has seen the death
                    async with s.post(
                        f"{url}/genrm/generate", json={"messages": MSG, "sampling_params": {"seed": _}}
                    ) as r:
                        gen = (r.status, await r.json(), r.headers.get("Retry-After"))
                    if "no working engine" in gen[1].get("error", ""):
                        break
                    await asyncio.sleep(0.05)
                t0 = asyncio.get_running_loop().time()
                async with s.post(f"{url}/genrm/generate", json={"messages": MSG}) as r:
                    again = (r.status, asyncio.get_running_loop().time() - t0)
                async with s.get(f"{url}/genrm/health") as r:
                    health = (r.status, await r.json())
        finally:
            await judge_procs.stop()
            await procs.stop()
        return gen, again, health

    gen, again, health = run(main(), 120)
    assert gen[0] == 503 and gen[2] == "5" and "its process is gone" in gen[1]["error"], gen
    assert again[0] == 503 and again[1] < 1.0
    assert health[0] == unhealthy_status and health[1]["status"] == "unhealthy"
    assert "its process is gone" in health[1]["error"]


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(
                st.sampled_from(["messages", "role", "content", "sampling_params", "route_key", "x"]),
                children,
                max_size=4,
            )
        ),
        max_leaves=12,
    )
)
def test_fuzzed_bodies_are_accepted_or_rejected_with_a_reason(body):
    """Any JSON value: either a valid (messages, sampling, route_key) or a ValueError."""
    try:
        messages, sp, rk = validate_request(body)
    except ValueError as e:
        assert str(e)
        return
    assert messages and all(isinstance(m["content"], str) for m in messages)
    assert sp is None or isinstance(sp, dict)
    assert rk is None or isinstance(rk, str)


def test_relay_judge_serves_the_tiny_config_and_stops_on_sigint(tmp_path):
    """`relay judge --config tiny-cpu-split` on a fresh machine: the tiny judge is built on
    first use (no download), curl sees it healthy, Ctrl-C stops it and its engines."""
    import signal

    from tests.launcher.test_launch import read_until

    port = free_port()
    env = dict(
        os.environ,
        RELAY_CACHE=str(tmp_path / "cache"),
        RELAY_JOB_SECRET=secrets.token_hex(32),
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "judge", "--config", "tiny-cpu-split", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out = read_until(p, "judge ready", 120)
        # An exported secret is the one clients need; no file is written.
        assert (
            "relay secret: RELAY_JOB_SECRET as exported here; reward code outside this process needs the same value: "
            "export RELAY_GENRM_ADDR="
            in out
        )
        assert not os.path.exists(tmp_path / "xdg")
        health = subprocess.run(
            ["curl", "-s", f"http://127.0.0.1:{port}/genrm/health"], capture_output=True, text=True, timeout=30
        )
        assert json.loads(health.stdout) == {"status": "healthy", "service": "genrm"}
        gen = subprocess.run(
            [
                "curl",
                "-s",
                "-X",
                "POST",
                f"http://127.0.0.1:{port}/genrm/generate",
                "-H",
                "Content-Type: application/json",
                "-d",
                json.dumps({"messages": MSG}),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert "response" in json.loads(gen.stdout)
        # curl -d alone sends a form content type, as a browser's simple POST would: refused, saying what to send
        form = subprocess.run(
            [
                "curl",
                "-s",
                "-w",
                " %{http_code}",
                "-X",
                "POST",
                f"http://127.0.0.1:{port}/genrm/generate",
                "-d",
                json.dumps({"messages": MSG}),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert form.stdout.endswith(" 415") and "Content-Type: application/json" in form.stdout
        assert os.path.exists(tmp_path / "cache" / "models" / "tiny-judge" / "config.json")
        p.send_signal(signal.SIGINT)
        p.wait(60)
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.communicate()


def test_relay_judge_reads_its_token_from_a_file_and_warns_about_one_on_the_command_line(tmp_path):
    """`relay judge --token-file F`: every route needs the token, and no process's command
    line shows it; `--token T` works but warns that ps shows it; a missing or empty file
    stops the start with a message naming the flag."""

    from tests.launcher.test_launch import read_until

    relay_bin = os.path.join(os.path.dirname(sys.executable), "relay")
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "empty").write_text("")
    env = dict(os.environ, RELAY_CACHE=str(tmp_path / "cache"), RELAY_JOB_SECRET=secrets.token_hex(32))
    env.pop("RELAY_GENRM_TOKEN", None)
    base = [relay_bin, "judge", "--config", "tiny-cpu-split"]
    for flag, message in (
        ("/nonexistent/token", "cannot read --token-file /nonexistent/token"),
        (str(tmp_path / "empty"), "is empty"),
    ):
        bad = subprocess.run(
            [*base, "--token-file", flag], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    port = free_port()
    p = subprocess.Popen(
        [*base, "--port", str(port), "--token-file", str(tmp_path / "token")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        read_until(p, "judge ready", 120)
        url = f"http://127.0.0.1:{port}/genrm"
        codes = [
            subprocess.run(
                ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *auth, f"{url}/{route}"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            for route in ("health", "metrics")
            for auth in ([], ["-H", f"Authorization: Bearer {token}"])
        ]
        assert codes == ["401", "200", "401", "200"]
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=30).stdout
        assert token not in ps
    finally:
        interrupt(p)
    p = subprocess.Popen(
        [*base, "--port", str(free_port()), "--token", token],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    warning = "--token is visible to every user of this machine in ps; use RELAY_GENRM_TOKEN or --token-file instead"
    lines: list[str] = []

    def pump():
        for line in p.stderr:
            lines.append(line)
            if warning in line:
                return

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        # other warnings (an untested package version, say) may come first
        reader.join(60)
    finally:
        p.kill()
        p.communicate()
    assert any(warning in line for line in lines), "".join(lines)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["messages", "role", "content", "sampling_params", "route_key", "x"]), children, max_size=4
        )
    ),
    max_leaves=12,
)
_SAMPLING = st.dictionaries(
    st.sampled_from(["temperature", "top_p", "top_k", "max_new_tokens", "max_response_len", "stop", "seed", "bogus"]),
    st.none()
    | st.integers(-5, 10**7)
    | st.floats(-2, 5, allow_nan=False)
    | st.text(max_size=5)
    | st.lists(st.text(max_size=3), max_size=2),
    max_size=4,
)
_BODIES = st.one_of(
    _JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    _SAMPLING.map(lambda sp: json.dumps({"messages": MSG, "sampling_params": sp}).encode()),
)


@settings(max_examples=3, deadline=None)
@given(st.lists(_BODIES, min_size=40, max_size=40))
def test_fuzzed_http_requests_never_get_a_5xx_and_the_gateway_stays_healthy(judge_model, bodies):
    """Arbitrary bytes, JSON values and sampling parameters POSTed to the live gateway:
    every answer is 200 with a response or a 4xx with an error message; never a 5xx."""

    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model)
        seen = []
        try:
            async with aiohttp.ClientSession() as s:
                for body in bodies:
                    async with s.post(
                        f"{url}/genrm/generate", data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        payload = await r.json(content_type=None)
                        seen.append((r.status, payload, body[:80]))
                async with s.get(f"{url}/genrm/health") as r:
                    health = await r.json()
        finally:
            await judge_procs.stop()
            await procs.stop()
        return seen, health

    seen, health = run(main(), 240)
    for status, payload, body in seen:
        assert status == 200 or 400 <= status < 500, (status, payload, body)
        if status == 200:
            assert isinstance(payload["response"], str)
        else:
            assert isinstance(payload.get("error"), str) and payload["error"], (status, payload, body)
    assert health["status"] == "healthy"


def test_unknown_top_level_fields_are_ignored_as_the_original_ignores_them_but_not_streaming():
    messages, sp, rk = validate_request({"messages": MSG, "model": "judge", "request_id": "r1", "stream": False})
    assert messages == MSG and sp is None and rk is None
    assert validate_request({"text": "hi", "user": "me"})[0] == "hi"
    with pytest.raises(ValueError, match="stream=true is not supported"):
        validate_request({"messages": MSG, "stream": True})
    with pytest.raises(ValueError, match="give 'messages' or a native input_ids, not both"):
        validate_request({"messages": MSG, "input_ids": [1]})


@pytest.mark.unit
def test_every_prometheus_counter_ends_in_total_once():
    from reward.httpd import STAT_NAMES
    from reward.metrics import prometheus_text

    text = prometheus_text({}, {"invalid_json": 2}, {"dropped_malformed": 1}, dict.fromkeys(STAT_NAMES, 3))
    names = {line.split()[0].split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert "genrm_http_connections_total" in names and not [n for n in names if n.endswith("_total_total")], names
