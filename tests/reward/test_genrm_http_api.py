"""The original's HTTP surface against a live tiny judge (real engines, real HTTP): the
metrics shapes, OpenAI content parts and any template role, SGLang's sampling keys and
native payloads, the OpenAI-compatible routes with the official ``openai`` client, and the
client's ``health_check`` / ``get_metrics``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from reward.errors import BadMessages
from reward.gateway import validate_request, wants_prometheus
from reward.openai_api import completion_request
from reward.protocol import MAX_TOKEN_ID
from tests.helpers import run
from tests.reward.test_judge_gateway import MSG, ROOT, _with_secret, start

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SGLANG_SAMPLING = {  # SGLang sampling keys the gateway must pass on to the engines untouched
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.2,
    "presence_penalty": 0.1,
    "min_p": 0.05,
    "min_new_tokens": 1,
    "skip_special_tokens": True,
    "no_stop_trim": False,
    "n": 1,
}


async def _post(s, url, body):
    async with s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


def test_parts_roles_and_native_payloads_reach_the_engine_as_the_chat_would(judge_model):
    """Content parts are joined; any role the template takes is served; a native ``text``
    (the rendered chat) and its ``input_ids`` get the same greedy answer as the chat."""
    tok = AutoTokenizer.from_pretrained(judge_model)
    parts_msg = [{"role": "user", "content": [{"type": "text", "text": "Is 2+2"}, {"type": "text", "text": "=4?"}]}]
    joined = [{"role": "user", "content": "Is 2+2\n=4?"}]
    rendered = tok.apply_chat_template(MSG, add_generation_prompt=True, tokenize=False)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]

    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model)
        gen = f"{url}/genrm/generate"
        try:
            async with aiohttp.ClientSession() as s:
                return {
                    "chat": await _post(s, gen, {"messages": MSG}),
                    "parts": await _post(s, gen, {"messages": parts_msg}),
                    "joined": await _post(s, gen, {"messages": joined}),
                    "tool": await _post(s, gen, {"messages": [*MSG, {"role": "tool", "content": "4"}]}),
                    "image": await _post(
                        s, gen, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
                    ),
                    "video": await _post(s, gen, {"messages": [*MSG[:-1], {"role": "user", "content": [
                        {"type": "text", "text": "Is 2+2=4?"}, {"type": "video", "video": "clip.mp4"}]}]}),
                    "audio": await _post(s, gen, {"messages": [
                        {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}),
                    "text": await _post(s, gen, {"text": rendered, "sampling_params": {"max_new_tokens": 4}}),
                    "ids": await _post(s, gen, {"input_ids": ids, "route_key": "__default__"}),
                    "oov": await _post(s, gen, {"input_ids": [*ids, len(tok)]}),
                    "huge": await _post(s, gen, {"input_ids": [MAX_TOKEN_ID + 1]}),
                    "both": await _post(s, gen, {"text": "x", "messages": MSG}),
                }
        finally:
            await judge_procs.stop()
            await procs.stop()

    got = run(main(), 240)
    for key in ("chat", "parts", "joined", "tool", "text", "ids"):
        assert got[key][0] == 200 and isinstance(got[key][1]["response"], str), (key, got[key])
    assert got["parts"][1] == got["joined"][1]  # parts joined with a newline, greedy: the same answer
    # the native prompt is exactly the chat's: the same greedy answer (max_new_tokens 4 as configured)
    assert got["text"][1] == got["ids"][1] == got["chat"][1]
    # an image or video part (alone, or beside text parts): 400, this backend serves text only
    for key, where in (("image", "messages[0].content[0] has type 'image_url'"),
                       ("video", f"messages[{len(MSG) - 1}].content[1] has type 'video'")):
        assert got[key][0] == 400 and "this backend serves text only" in got[key][1]["error"], got[key]
        assert where in got[key][1]["error"], got[key]
    assert got["audio"][0] == 422 and "only text is supported" in got["audio"][1]["error"]  # malformed, as before
    assert got["oov"][0] == 400 and "not in the judge's vocabulary" in got["oov"][1]["error"]
    assert got["huge"][0] == 400 and "input_ids[0]" in got["huge"][1]["error"]
    assert got["both"][0] == 400 and "give 'messages' or a native text, not both" in got["both"][1]["error"]


def test_sglang_sampling_keys_are_passed_on_untouched_by_the_gateway():
    body = {"messages": MSG, "sampling_params": dict(SGLANG_SAMPLING)}
    _, sampling, _ = validate_request(body)
    assert sampling == SGLANG_SAMPLING
    _, sampling, _ = validate_request({"text": "x", "sampling_params": dict(SGLANG_SAMPLING)})
    assert sampling == SGLANG_SAMPLING


def test_sglang_sampling_keys_are_served_by_the_live_judge(judge_model):
    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model)
        try:
            async with aiohttp.ClientSession() as s:
                chat = await _post(s, f"{url}/genrm/generate", {"messages": MSG, "sampling_params": SGLANG_SAMPLING})
                native = await _post(s, f"{url}/genrm/generate", {"text": "x", "sampling_params": SGLANG_SAMPLING})
                regex = await _post(s, f"{url}/genrm/generate", {"messages": MSG, "sampling_params": {"regex": "[01]"}})
                both = await _post(s, f"{url}/genrm/generate",
                                   {"messages": MSG, "sampling_params": {"regex": "[01]", "ebnf": "root ::= '1'"}})
            return chat, native, regex, both
        finally:
            await judge_procs.stop()
            await procs.stop()

    chat, native, regex, both = run(main(), 240)
    # SGLang's constrained decoding: accepted by the gateway, refused by this built-in engine saying why
    assert regex[0] == 400 and "regex (constrained decoding) runs on SGLang engines only" in regex[1]["error"], regex
    assert both[0] == 400 and "at most one of regex, json_schema, ebnf" in both[1]["error"]
    assert chat[0] == 200 and isinstance(chat[1]["response"], str), chat
    assert native[0] == 200 and isinstance(native[1]["response"], str), native


def test_openai_client_models_chat_completions_and_metrics_of_two_instances(judge_model):
    """The official openai client against /genrm/v1: one model per instance, chat
    completions with usage counts, OpenAI error objects; /genrm/metrics per instance."""
    tok = AutoTokenizer.from_pretrained(judge_model)
    rendered = tok.apply_chat_template(MSG, add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tok(rendered, add_special_tokens=False)["input_ids"])

    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model, instances=("quality", "safety"))
        client = openai.AsyncOpenAI(base_url=f"{url}/genrm/v1", api_key="unused", max_retries=0)
        got = {}
        try:
            got["models"] = sorted((m.id, m.root) for m in (await client.models.list()).data)
            got["completion"] = await client.chat.completions.create(
                model="quality", messages=MSG, temperature=0, max_tokens=3, n=2, seed=7, stop=["\n\n"]
            )
            got["parts"] = await client.chat.completions.create(
                model="safety", messages=[{"role": "user", "content": [{"type": "text", "text": "Is 2+2=4?"}]}]
            )
            for name, kwargs in {
                "unknown": dict(model="nope", messages=MSG),
                "image": dict(
                    model="quality",
                    messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                ),
                "top_p": dict(model="quality", messages=MSG, top_p=7),
                "stream": dict(model="quality", messages=MSG, stream=True),
            }.items():
                try:
                    await client.chat.completions.create(**kwargs)
                except openai.APIStatusError as e:
                    got[name] = (e.status_code, e.body)
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/genrm/metrics") as r:
                    got["metrics"] = await r.json()
        finally:
            await client.close()
            await judge_procs.stop()
            await procs.stop()
        return got

    got = run(main(), 240)
    assert got["models"] == [("quality", judge_model), ("safety", judge_model)]
    c = got["completion"]
    assert c.object == "chat.completion" and c.model == "quality" and len(c.choices) == 2
    assert [ch.index for ch in c.choices] == [0, 1]
    assert all(ch.message.role == "assistant" and isinstance(ch.message.content, str) for ch in c.choices)
    assert c.choices[0].message.content == c.choices[1].message.content  # greedy
    assert all(ch.finish_reason in ("stop", "length") for ch in c.choices)
    assert c.usage.prompt_tokens == prompt_tokens
    assert 2 <= c.usage.completion_tokens <= 6 and c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens
    assert isinstance(got["parts"].choices[0].message.content, str)
    status, body = got["unknown"]
    assert status == 404 and body["code"] == "model_not_found" and body["param"] == "model"
    assert "'nope' does not exist" in body["message"] and "['quality', 'safety']" in body["message"]
    assert got["image"][0] == 400 and "this backend serves text only" in got["image"][1]["message"]
    assert got["top_p"][0] == 400 and "top_p" in got["top_p"][1]["message"]
    assert got["stream"][0] == 400 and "stream=True is not supported" in got["stream"][1]["message"]
    m = got["metrics"]
    assert m["service"] == "genrm" and set(m["instances"]) == {"quality", "safety"}
    for key in ("quality", "safety"):
        inst = m["instances"][key]
        assert inst["model_path"] == judge_model and inst["num_gpus"] == 1 and inst["num_engines"] == 1
    assert m["instances"]["quality"]["requests"] == 2  # n=2: two judge requests (never cached: usage counts)


_CLIENT = textwrap.dedent("""
    import asyncio, json, sys
    from reward.client import GenRMClient

    live, dead = GenRMClient(sys.argv[1]), GenRMClient("tcp://127.0.0.1:9", auth_timeout=1.0)
    out = {"timeout": live.timeout, "health": live.health_check(), "metrics": live.get_metrics()}
    out["dead_health"], out["dead_metrics"] = dead.health_check(), dead.get_metrics()

    async def in_loop():  # a client of this event loop (one client per process and loop)
        live = GenRMClient(sys.argv[1])
        return {
            "health_async": await live.health_check_async(),
            "metrics_async": await live.get_metrics_async(),
            "health_on_loop": live.health_check(),  # cannot block its own loop: says so, never raises
            "health_in_thread": await asyncio.to_thread(live.health_check),
        }

    out.update(asyncio.run(in_loop()))

    async def as_the_original_calls_it():  # from reward code, with the job's gateway URL exported
        import os

        from reward.client import get_genrm_client

        os.environ["RELAY_GENRM_URL"] = sys.argv[2]
        zmq_client = GenRMClient(sys.argv[1])
        http = get_genrm_client(service_url=sys.argv[2], timeout=60)
        got = {"zmq_health_on_loop": zmq_client.health_check(), "http_type": type(http).__name__,
               "http_timeout": http.timeout, "positional_type": type(get_genrm_client(sys.argv[2])).__name__,
               "http_health_on_loop": http.health_check(), "http_metrics": http.get_metrics(),
               "http_generate": await http.generate([{"role": "user", "content": "Is 2+2=4?"}],
                                                    {"max_new_tokens": 2, "temperature": 0})}
        try:
            await http.generate([{"role": "user"}])
        except ValueError as e:
            got["http_bad_request"] = str(e)
        try:
            get_genrm_client("127.0.0.1:8000")
        except ValueError as e:
            got["bad_address"] = str(e)
        await http.close()
        return got

    out.update(asyncio.run(as_the_original_calls_it()))
    print(json.dumps(out))
""")


def test_client_health_check_and_get_metrics_never_raise(judge_model):
    async def main():
        procs, engines, judge, judge_procs, url = await start(judge_model)
        try:
            addr = judge._view.members[0].proc.addr
            p = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", _CLIENT, addr, f"{url}/genrm"],
                env=dict(_with_secret(), PYTHONPATH=ROOT),
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert p.returncode == 0, p.stderr[-3000:]
            return json.loads(p.stdout.splitlines()[-1])
        finally:
            await judge_procs.stop()
            await procs.stop()

    got = run(main(), 240)
    assert got["timeout"] == 1800.0
    assert got["health"] == got["health_async"] == got["health_in_thread"] == {"status": "healthy", "service": "genrm"}
    m = got["metrics"]
    assert m["service"] == "genrm" and m["model_path"] == judge_model and m["num_gpus"] == 1 and m["num_engines"] == 1
    assert got["metrics_async"]["model_path"] == judge_model
    assert got["dead_health"]["status"] == "unhealthy" and got["dead_health"]["error"]
    assert got["dead_metrics"] == {}
    assert got["health_on_loop"]["status"] == "unhealthy" and "health_check_async" in got["health_on_loop"]["error"]
    # with the job's gateway URL (RELAY_GENRM_URL, exported by the launcher) it tells the truth
    assert got["zmq_health_on_loop"] == {"status": "healthy", "service": "genrm"}
    # the original's get_genrm_client(service_url=..., timeout=...): an HTTP client, same calls
    assert got["http_type"] == got["positional_type"] == "HTTPGenRMClient" and got["http_timeout"] == 60
    assert got["http_health_on_loop"] == {"status": "healthy", "service": "genrm"}
    assert got["http_metrics"]["model_path"] == judge_model and isinstance(got["http_generate"], str)
    assert "HTTP 422" in got["http_bad_request"] or "HTTP 400" in got["http_bad_request"]
    assert "service_url='http://HOST:PORT/genrm'" in got["bad_address"]


def test_native_payload_bounds():
    from reward.protocol import MAX_INPUT_IDS, MAX_PROMPT_CHARS

    assert validate_request({"input_ids": [0] * MAX_INPUT_IDS})[0] == [0] * MAX_INPUT_IDS
    for body in ({"input_ids": [0] * (MAX_INPUT_IDS + 1)}, {"text": "x" * (MAX_PROMPT_CHARS + 1)}):
        with pytest.raises(ValueError, match="must be a"):
            validate_request(body)


def test_prometheus_is_chosen_only_when_the_accept_header_asks_for_it():
    prometheus = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    assert wants_prometheus(prometheus) and wants_prometheus("text/plain")
    for accept in ("", "*/*", "application/json", "text/html,application/xhtml+xml,*/*;q=0.8"):
        assert not wants_prometheus(accept), accept
    assert not wants_prometheus("text/plain;q=0.5, application/json")
    assert not wants_prometheus("text/plain;q=0")


# ---------------------------------------------------------------------------- the validators, fuzzed

_KEYS = ["messages", "role", "content", "type", "text", "input_ids", "sampling_params", "route_key", "model", "n"]
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.sampled_from(["text", "user", "tool", "image_url", "__default__"]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(_KEYS), children, max_size=4),
    max_leaves=16,
)
_PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}) | _JSON
_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.text(max_size=70), "content": st.text(max_size=8) | st.lists(_PART, max_size=3)}),
    max_size=3,
)
_BODIES = st.one_of(
    _JSON,
    _MESSAGES.map(lambda m: {"messages": m}),
    st.fixed_dictionaries(
        {"input_ids": st.lists(st.integers(-3, 2**40) | st.booleans() | st.floats(), max_size=4)},
        optional={"sampling_params": _JSON, "route_key": _JSON},
    ),
    st.fixed_dictionaries({"text": st.text(max_size=8) | _JSON}, optional={"input_ids": _JSON}),
)


@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_BODIES)
def test_fuzzed_generate_bodies_are_valid_or_refused_with_a_reason(body):
    try:
        prompt, sampling, route_key = validate_request(body)
    except ValueError as e:
        assert str(e) and len(str(e)) < 700
        return
    if isinstance(prompt, str):
        assert 1 <= len(prompt)
    elif isinstance(prompt[0], dict):  # chat: plain string contents, roles of 1 to 64 characters
        assert all(type(m["content"]) is str and 1 <= len(m["role"]) <= 64 for m in prompt)
    else:
        assert all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in prompt)
    assert sampling is None or isinstance(sampling, dict)
    assert route_key is None or isinstance(route_key, str)


def _resolve(model):
    if model != "__default__":
        raise LookupError(f"no model {model!r}")
    return model


@settings(max_examples=600, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        _JSON,
        st.fixed_dictionaries(
            {"model": st.sampled_from(["__default__", "nope"]) | _JSON, "messages": _MESSAGES | _JSON},
            optional={
                k: _JSON | st.floats(0, 2) | st.integers(1, 20)
                for k in ("temperature", "top_p", "max_tokens", "n", "seed", "stop", "stream", "user", "bogus")
            },
        ),
    )
)
def test_fuzzed_chat_completion_bodies_are_valid_or_refused_with_a_reason(body):
    try:
        route_key, messages, sampling, n = completion_request(body, _resolve)
    except (ValueError, LookupError) as e:
        assert str(e) and len(str(e)) < 700
        assert not isinstance(e, BadMessages) or "messages" in str(e) or "content" in str(e)
        return
    assert route_key == "__default__" and 1 <= n <= 16 and isinstance(sampling, dict)
    assert all(type(m["content"]) is str for m in messages)
