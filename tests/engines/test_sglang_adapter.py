"""The SGLang adapter against a protocol-faithful fake server (tests/engines/fake_sglang.py)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from engines.interface import EngineFailed, EngineStepError
from engines.sglang.engine import SGLangEngine
from tests.helpers import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def fake_server(monkeypatch):
    monkeypatch.setenv("RELAY_SGLANG_LAUNCH", "tests.engines.fake_sglang")


async def server_info(eng):
    async with eng._session.get(f"{eng.url}/server_info") as r:
        return await r.json()


def test_launch_arguments_are_mapped_from_our_config(capfd):
    async def main():
        eng = SGLangEngine(
            "/models/judge",
            gpu_ids=[4, 5],
            engine_config={"dp_size": 2, "ep_size": 2, "max_context_len": 8192, "chunked_prefill_size": 4096,
                           "no_such_argument": 1},
            mem_fraction_static=0.3,
            offload=True,
            weights_mode="backup",
        )
        await eng.start()
        info = await server_info(eng)
        await eng.close()
        return info, eng

    info, eng = run(main())
    a = info["args"]
    assert a["model_path"] == "/models/judge" and a["tp_size"] == 2 and a["dp_size"] == 2 and a["ep_size"] == 2
    assert a["enable_dp_attention"]  # dp_size inside the one engine of 2 GPUs, as the original's judges run
    assert a["mem_fraction_static"] == 0.3 and a["context_length"] == 8192 and a["base_gpu_id"] == 4
    assert a["enable_memory_saver"] and a["enable_weights_cpu_backup"]
    assert a["cuda_graph_backend_prefill"] == "disabled"  # slime: the breakable prefill graph breaks under the saver
    assert a["chunked_prefill_size"] == "4096"  # an engine-config key that is a server argument: applied as given
    assert "no_such_argument" not in a and "'no_such_argument' is not a server argument" in capfd.readouterr().err
    assert eng.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5"  # node numbering: --base-gpu-id 4 is the 5th
    assert eng.proc.poll() is not None  # the server is gone after close()


def test_generate_shapes_and_explicit_max_new_tokens():
    async def main():
        eng = SGLangEngine("/m")
        await eng.start()
        r = await eng.generate([1, 2, 3], {"temperature": 0, "max_new_tokens": 5})
        default = await eng.generate([1, 2, 3], {"temperature": 0})  # our default (128) is sent, not left to the server
        stop = await eng.generate([1, 2, 3], {"max_new_tokens": 50, "stop_token_ids": [(6 + 2) % 100 + 5]})
        await eng.close()
        return r, default, stop

    r, default, stop = run(main())
    assert r.token_ids == [(6 + i) % 100 + 5 for i in range(5)] and r.finish_reason == "length"
    assert r.logprobs == pytest.approx([-0.5 - 0.01 * i for i in range(5)]) and r.prompt_tokens == 3
    assert len(default.token_ids) == 128
    assert stop.finish_reason == "stop" and len(stop.token_ids) == 3


def test_sleep_drains_then_releases_and_wake_resumes_in_order():
    async def main():
        eng = SGLangEngine("/m", offload=True)
        await eng.start()
        busy = asyncio.ensure_future(eng.generate([1], {"max_new_tokens": 5000}))
        await asyncio.sleep(0.3)
        await eng.sleep(["weights", "kv_cache"])  # release would be refused while busy
        aborted = await busy
        with pytest.raises(RuntimeError, match="asleep"):
            await eng.generate([1], {"max_new_tokens": 2})
        await eng.sleep(["weights", "kv_cache"])  # idempotent: no second release
        await eng.wake(["weights"])
        mid = (await server_info(eng))["log"]
        await eng.wake(["kv_cache"])
        log = (await server_info(eng))["log"]
        await eng.close()
        return aborted, mid, log

    aborted, mid, log = run(main())
    assert aborted.finish_reason == "abort"
    kinds = [e if isinstance(e, str) else e[0] for e in log]
    # pause (abort mode) -> abort all -> flush (400 while busy, retried) -> release
    first_release = kinds.index("release")
    assert kinds[0] == "pause" and log[0][1] == "abort" and "abort" in kinds[:first_release]
    assert kinds[first_release - 1] == "flush_cache"
    assert kinds.count("release") == 1
    # generation continues only after the full wake
    assert "continue" not in [e if isinstance(e, str) else e[0] for e in mid]
    assert kinds[-1] == "continue" and kinds[-2] == "resume"
    # SGLang's tags: the CUDA graphs go and come back with the KV cache (as slime and relax do)
    assert [e[1] for e in log if e[0] in ("release", "resume")] == [
        ["weights", "kv_cache", "cuda_graph"], ["weights"], ["kv_cache", "cuda_graph"]]


@pytest.mark.parametrize("backup", [True, False], ids=["judge-backup", "rollout-discard"])
def test_weights_after_wake(backup):
    async def main():
        eng = SGLangEngine("/m", offload=True, weights_mode="backup" if backup else "discard")
        await eng.start()
        await eng.sleep()
        await eng.wake()
        if backup:
            r = await eng.generate([4], {"max_new_tokens": 3})
        else:
            with pytest.raises(Exception, match="500"):
                await eng.generate([4], {"max_new_tokens": 3})
            await eng.update_weights([{"w": torch.ones(2, 2)}, [("b", torch.zeros(3))]], version=9)
            r = await eng.generate([4], {"max_new_tokens": 3})
        log = (await server_info(eng))["log"]
        await eng.close()
        return r, log

    r, log = run(main())
    assert len(r.token_ids) == 3
    if not backup:
        assert r.weight_version == 9
        assert [e[1] for e in log if isinstance(e, list) and e[0] == "update_weights_from_tensor"] == [["w"], ["b"]]


def test_distributed_weight_update_joins_the_trainers_group_and_receives_flattened_buckets():
    """The server joins a group the trainer builds as SGLang does (engines.weight_sync,
    protocol "sglang") and receives each bucket as one flat buffer, tensors back to back;
    a live engine is paused (retract) from the first bucket of a version to the last."""
    from engines.sglang.engine import _free_port as free_port
    from engines.weight_sync import BroadcastGroup, flatten

    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    c = torch.full((3,), 7, dtype=torch.int64)

    async def main():
        eng = SGLangEngine("/m", device="cpu")
        await eng.start()
        port = free_port()
        join = asyncio.ensure_future(eng.init_weights_update_group("127.0.0.1", port, 1, 2, "wg", "gloo"))
        group = await asyncio.to_thread(BroadcastGroup, "127.0.0.1", port, 0, 2, "gloo", 60.0, "wg", protocol="sglang")
        await join
        for i, bucket in enumerate([[("a", a), ("b", b)], [("c", c)]]):
            buf, metas = flatten(bucket, "cpu", align=1)
            names, shapes, dtypes = [m[0] for m in metas], [m[1] for m in metas], [m[2] for m in metas]
            receive = asyncio.ensure_future(eng.update_weights_from_distributed(names, dtypes, shapes, 3, "wg",
                                                                                last=i == 1))
            await asyncio.to_thread(group.broadcast, buf)
            await receive
        await eng.destroy_weights_update_group("wg")
        group.close()
        r = await eng.generate([4], {"max_new_tokens": 2})
        log = (await server_info(eng))["log"]
        await eng.close()
        return eng, r, log

    eng, r, log = run(main())
    assert eng.weight_version == 3 and r.weight_version == 3
    kinds = [e if isinstance(e, str) else e[0] for e in log]
    assert kinds == ["init_weights_update_group", "pause", "update_weights_from_distributed",
                     "update_weights_from_distributed", "continue"]
    assert log[1] == ["pause", "retract"]
    init = log[0][1]
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["group_name"] == "wg"
    assert [e[1] for e in log if e[0:1] == ["update_weights_from_distributed"]] == [["a", "b"], ["c"]]


def test_distributed_bucket_contents_arrive_intact(tmp_path, monkeypatch):
    """The record the fake writes holds each tensor's sum as received over the group."""
    import json

    from engines.sglang.engine import _free_port as free_port
    from engines.weight_sync import BroadcastGroup, flatten

    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(tmp_path))
    w = torch.linspace(-1, 1, 10, dtype=torch.float32)
    h = torch.tensor([0.25, 4.0, -8.0], dtype=torch.float16)

    async def main():
        eng = SGLangEngine("/m", device="cpu")
        await eng.start()
        port = free_port()
        join = asyncio.ensure_future(eng.init_weights_update_group("127.0.0.1", port, 1, 2, "g2", "gloo"))
        group = await asyncio.to_thread(BroadcastGroup, "127.0.0.1", port, 0, 2, "gloo", 60.0, "g2", protocol="sglang")
        await join
        buf, metas = flatten([("h", h), ("w", w)], "cpu", align=1)
        receive = asyncio.ensure_future(eng.update_weights_from_distributed(
            [m[0] for m in metas], [m[2] for m in metas], [m[1] for m in metas], 1, "g2"))
        await asyncio.to_thread(group.broadcast, buf)
        await receive
        group.close()
        await eng.close()
        return eng

    eng = run(main())
    with open(tmp_path / f"sglang-{eng.port}.jsonl") as f:
        entries = [json.loads(line) for line in f]
    (update,) = [e for e in entries if e.get("path") == "/update_weights_from_distributed"]
    assert update["tensors"] == {"h": pytest.approx(float(h.double().sum())), "w": pytest.approx(0.0, abs=1e-6)}
    assert update["body"]["load_format"] == "flattened_bucket" and update["body"]["weight_version"] == "1"


def test_a_server_that_dies_at_start_is_reported(monkeypatch):
    monkeypatch.setenv("RELAY_SGLANG_LAUNCH", "tests.engines.no_such_module")

    async def main():
        eng = SGLangEngine("/m", start_timeout=30)
        with pytest.raises(Exception, match="exited with code"):
            await eng.start()
        await eng.close()

    run(main())
    assert os.environ["RELAY_SGLANG_LAUNCH"] == "tests.engines.no_such_module"


def test_rendered_chats_are_tokenized_by_the_actor_and_sent_as_input_ids(tmp_path):
    """The judge service sends rendered chat text; behind an SGLang server the engine actor
    tokenizes it (no special tokens added) and the server gets input_ids."""
    from transformers import AutoTokenizer

    from engines.actor import EngineActor
    from engines.models.model_builder import make_model
    from relay import this_host

    judge = make_model("qwen3", "tiny", str(tmp_path / "j"), seed=3)
    tok = AutoTokenizer.from_pretrained(judge)
    chat = [{"role": "user", "content": "Is 2+2=4? Reply 1 or 0."}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)

    async def main():
        procs = this_host().spawn_procs(per_host={"procs": 1}, name="sgl")
        try:
            engine = procs.spawn("sgl", EngineActor, judge, "sglang")
            await engine.initialized(60)
            return await engine.generate_rendered.call_one([[text, {"temperature": 0, "max_new_tokens": 3}]]).result(60)
        finally:
            await procs.stop()

    (r,) = run(main())
    assert r.prompt_tokens == len(ids)
    assert r.token_ids == [(sum(ids) + i) % 100 + 5 for i in range(3)]  # the server was given these ids


def test_failures_are_typed_and_a_cancelled_caller_is_aborted_in_the_server(monkeypatch):
    """A 4xx is the request's own error (ValueError), a 5xx an EngineStepError while the
    server lives, EngineFailed once it exited; a cancelled caller's rid is aborted."""

    async def main():
        monkeypatch.setenv("FAKE_SGLANG_TOKEN_DELAY", "0.01")
        eng = SGLangEngine("/m", engine_config={"context_length": 64})
        await eng.start()
        out = {}
        try:
            await eng.generate(list(range(100)), {"max_new_tokens": 4})
        except Exception as e:  # noqa: BLE001
            out["too long"] = e
        task = asyncio.ensure_future(eng.generate([1, 2], {"max_new_tokens": 50}))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.sleep(0.2)
        out["log"] = (await server_info(eng))["log"]
        await eng._post("/release_memory_occupation", {"tags": ["kv_cache"]})
        try:
            await eng.generate([1, 2], {"max_new_tokens": 2})
        except Exception as e:  # noqa: BLE001
            out["released"] = e
        os.killpg(eng.proc.pid, 9)
        eng.proc.wait(10)
        try:
            await eng.generate([1, 2], {"max_new_tokens": 2})
        except Exception as e:  # noqa: BLE001
            out["dead"] = e
        await eng.close()
        return out

    out = run(main())
    assert type(out["too long"]) is ValueError and "maximum context length of 64" in str(out["too long"])
    assert ["abort", "sglang-2", False] in out["log"]  # the second request's rid
    assert type(out["released"]) is EngineStepError and "500" in str(out["released"])
    assert type(out["dead"]) is EngineFailed and "exited" in str(out["dead"])


def test_sglang_sampling_keys_are_passed_through_unchanged_and_n_is_fanned_out():
    """SGLang's own keys reach /generate under their names and values (the fake refuses keys
    SGLang's SamplingParams does not take); n > 1 is not one request: generate_n sends n."""
    from engines.interface import generate_n

    keys = {
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "frequency_penalty": -0.5,
        "presence_penalty": 0.25,
        "min_new_tokens": 2,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }

    async def main():
        eng = SGLangEngine("/m")
        await eng.start()
        await eng.generate([1, 2, 3], {"temperature": 0.7, "max_new_tokens": 4, **keys})
        sent = (await server_info(eng))["last_sampling_params"]
        await eng.generate([1, 2, 3], {"max_new_tokens": 4})
        defaults = (await server_info(eng))["last_sampling_params"]
        with pytest.raises(ValueError, match="n must be 1 for one engine request"):
            await eng.generate([1, 2, 3], {"max_new_tokens": 4, "n": 2})
        many = await generate_n(eng, [1, 2, 3], {"max_new_tokens": 4, "n": 3, "seed": 5})
        last = (await server_info(eng))["last_sampling_params"]
        await eng.generate([1, 2, 3], {"max_new_tokens": 4, "regex": "[01]"})  # constrained decoding: passed on
        constrained = (await server_info(eng))["last_sampling_params"]
        async with eng._session.post(
            f"{eng.url}/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "bogus": 1}}
        ) as r:
            refused = (r.status, await r.text())
        await eng.close()
        return sent, defaults, many, last, refused, constrained

    sent, defaults, many, last, refused, constrained = run(main())
    assert constrained["regex"] == "[01]" and "json_schema" not in constrained and "regex" not in defaults
    assert refused[0] == 400 and "bogus" in refused[1]
    assert {k: sent[k] for k in keys} == keys and sent["temperature"] == 0.7 and "n" not in sent
    assert defaults["skip_special_tokens"] is True and defaults["no_stop_trim"] is False
    assert defaults["repetition_penalty"] == 1.0 and defaults["min_new_tokens"] == 0 and defaults["min_p"] == 0.0
    assert len(many) == 3 and all(len(r.token_ids) == 4 for r in many)
    assert last["sampling_seed"] in (5, 6, 7)
