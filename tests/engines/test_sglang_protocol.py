"""The SGLang adapter speaks the pinned version's protocol (engines/sglang/protocol.json,
sglang 0.5.15.post1, read from its wheel): every server argument it emits is a ServerArgs
field of that version, given with that version's flag, and every request it sends is a
route of that version with keys its request type takes. And the launcher computes the
original's arguments for the shipped GPU configs (relax ``_compute_genrm_server_args``)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch

from engines.sglang.args import check_request, protocol, server_argv, server_fields
from engines.sglang.engine import SGLangEngine
from launcher.allocator import make_plan
from launcher.config import load_config
from launcher.rl.engine_pool import PooledEngine, engine_gpus, engine_options
from launcher.serve_judge import judge_engine_options
from tests.engines import fake_sglang
from tests.helpers import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "torchrun_configs")


def test_the_record_names_its_version_and_holds_what_the_adapter_relies_on():
    record = protocol()
    assert record["sglang_version"] == "0.5.15.post1"
    for route, methods in {"/generate": "POST", "/health_generate": "GET", "/flush_cache": "POST",
                           "/release_memory_occupation": "POST", "/resume_memory_occupation": "POST",
                           "/pause_generation": "POST", "/continue_generation": "POST", "/abort_request": "POST",
                           "/update_weights_from_tensor": "POST", "/init_weights_update_group": "POST",
                           "/update_weights_from_distributed": "POST", "/destroy_weights_update_group": "POST",
                           "/v1/loads": "GET"}.items():
        assert methods in record["routes"][route], route
    assert record["server_args"]["enable_memory_saver"] == {"flag": "--enable-memory-saver", "aliases": [],
                                                            "kind": "switch"}
    assert record["server_args"]["tp_size"]["flag"] == "--tp-size"


def _every_config_option() -> list[dict]:
    """Engine options of every engine of every shipped config, rollout and judge, under
    relay train (as if --engine sglang --device cuda) and relay judge."""
    out = []
    for name in sorted(os.listdir(CONFIGS)):
        cfg = load_config(os.path.join(CONFIGS, name), {"engine": "sglang", "device": "cuda"})
        try:
            plan = make_plan(cfg)
        except Exception:  # noqa: BLE001 - a train-only config (SFT) places no engines
            continue
        for claim in plan.claims:
            if claim.role not in ("rollout", "genrm"):
                continue
            for i, bundles in enumerate(plan.engines_of(claim)):
                engine = PooledEngine(claim.role, claim.instance, None, i, bundles[0].index)
                weights = "discard" if claim.role == "rollout" else "backup"
                out.append(engine_options(cfg, claim, weights, engine_gpus(cfg, claim, engine), True))
        for inst in cfg.genrm:
            out.append(judge_engine_options(cfg, inst, 0))
    return out


def test_every_argument_the_launcher_makes_is_a_server_argument_of_the_pinned_version():
    options = _every_config_option()
    assert len(options) > 10
    flags = {s["flag"] for s in protocol()["server_args"].values()}
    for opts in options:
        argv = server_argv(server_fields("/m", 30000, **opts, warn=pytest.fail))
        assert {a for a in argv if a.startswith("--")} <= flags, argv
        parsed = fake_sglang.parse(argv)  # the pinned version's parser: an unknown flag would exit 2
        assert parsed.tp_size * parsed.pp_size == len(opts["gpu_ids"])


def test_the_launcher_computes_the_originals_arguments_for_the_397b_judge_configs():
    for name in ("qwen35-35b-a3b-16gpu-genrm-397b-split", "qwen35-35b-a3b-16gpu-genrm-397b-defer"):
        cfg = load_config(os.path.join(CONFIGS, name + ".yaml"), {"engine": "sglang"})
        plan = make_plan(cfg)
        got = {}
        for claim in plan.claims:
            for i, bundles in enumerate(plan.engines_of(claim) if claim.role in ("rollout", "genrm") else []):
                engine = PooledEngine(claim.role, claim.instance, None, i, bundles[0].index)
                weights = "discard" if claim.role == "rollout" else "backup"
                opts = engine_options(cfg, claim, weights, engine_gpus(cfg, claim, engine), True)
                got[(claim.role, bundles[0].node)] = server_fields("/m", 1, **opts, warn=pytest.fail)
        judge = next(v for (role, _), v in got.items() if role == "genrm")
        rollout = next(v for (role, _), v in got.items() if role == "rollout")
        # judge: tp = its GPUs, dp/ep/pp and the fraction from its engine config, context length, memory saver
        # (colocated), weights CPU backup
        assert {k: judge[k] for k in ("tp_size", "dp_size", "ep_size", "pp_size", "base_gpu_id", "gpu_id_step",
                                      "mem_fraction_static", "context_length", "enable_memory_saver",
                                      "enable_weights_cpu_backup", "device")} == {
            "tp_size": 8, "dp_size": 8, "ep_size": 8, "pp_size": 1, "base_gpu_id": 0, "gpu_id_step": 1,
            "mem_fraction_static": 0.85, "context_length": 8192, "enable_memory_saver": True,
            "enable_weights_cpu_backup": True, "device": "cuda"}
        assert judge["enable_dp_attention"] and "enable_dp_attention" not in rollout
        assert {k: rollout[k] for k in ("tp_size", "dp_size", "mem_fraction_static", "enable_memory_saver",
                                        "enable_weights_cpu_backup")} == {
            "tp_size": 8, "dp_size": 1, "mem_fraction_static": cfg.sglang_mem_fraction_static,
            "enable_memory_saver": True, "enable_weights_cpu_backup": False}


def test_engine_config_keys_are_applied_last_and_unknown_ones_dropped_with_a_warning():
    warned = []
    fields = server_fields("/m", 1, gpu_ids=[2, 3, 4, 5], mem_fraction_static=0.5, warn=warned.append,
                           engine_config={"pp_size": 2, "mem_fraction_static": 0.7, "tp_size": 4,
                                          "enable_dp_attention": True, "bogus_key": 3, "port": 1234})
    assert fields["pp_size"] == 2 and fields["mem_fraction_static"] == 0.7 and fields["tp_size"] == 4
    assert fields["base_gpu_id"] == 2 and fields["enable_dp_attention"] is True and "bogus_key" not in fields
    assert fields["port"] == 1  # the adapter's own port: an engine config cannot move it
    assert warned == ["engine config key 'bogus_key' is not a server argument of sglang 0.5.15.post1; dropped",
                      "engine config key 'port' is set by relay (the adapter's own server); dropped"]
    with pytest.raises(ValueError, match="pp_size 3"):
        server_fields("/m", 1, gpu_ids=[0, 1], engine_config={"pp_size": 3})


def test_check_request_refuses_what_the_pinned_version_does_not_take():
    check_request("/update_weights_from_tensor", {"serialized_named_tensors": [], "weight_version": "1"})
    with pytest.raises(ValueError, match="takes no bogus"):
        check_request("/pause_generation", {"mode": "abort", "bogus": 1})
    with pytest.raises(ValueError, match="takes no timeout"):
        check_request("/flush_cache", {"timeout": 1})  # a query parameter, not a body key
    with pytest.raises(ValueError, match="no route"):
        check_request("/release_memory", {})
    with pytest.raises(ValueError, match="SamplingParams takes no seed"):
        check_request("/generate", {"input_ids": [1], "sampling_params": {"seed": 1}})


def test_every_request_the_adapter_sends_is_a_route_and_key_of_the_pinned_version(tmp_path, monkeypatch):
    """Every control path of the adapter, against the fake, which records each request."""
    from engines.sglang.engine import _free_port
    from engines.weight_sync import BroadcastGroup, flatten

    monkeypatch.setenv("RELAY_SGLANG_LAUNCH", "tests.engines.fake_sglang")
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(tmp_path))

    async def main():
        eng = SGLangEngine("/m", device="cpu", offload=True, weights_mode="discard", engine_config={"dp_size": 1})
        await eng.start()
        await eng.generate([1, 2], {"max_new_tokens": 2, "stop": ["x"], "stop_token_ids": [3], "seed": 4})
        await eng.generate("text", {"max_new_tokens": 2})
        await eng.abort(["r1"])
        await eng.stats()
        await eng.sleep(drain="finish")
        await eng.wake(["weights"])
        await eng.update_weights([{"w": torch.ones(2)}], 1)
        await eng.wake(["kv_cache"])
        port = _free_port()
        join = asyncio.ensure_future(eng.init_weights_update_group("127.0.0.1", port, 1, 2, "g", "gloo"))
        group = await asyncio.to_thread(BroadcastGroup, "127.0.0.1", port, 0, 2, "gloo", 60.0, "g", protocol="sglang")
        await join
        buf, metas = flatten([("w", torch.zeros(2))], "cpu", align=1)
        receive = asyncio.ensure_future(eng.update_weights_from_distributed(["w"], ["float32"], [[2]], 2, "g"))
        await asyncio.to_thread(group.broadcast, buf)
        await receive
        await eng.destroy_weights_update_group("g")
        group.close()
        await eng.close()
        return eng

    eng = run(main())
    with open(tmp_path / f"sglang-{eng.port}.jsonl") as f:
        entries = [json.loads(line) for line in f][1:]
    record = protocol()
    paths = set()
    for e in entries:
        paths.add(e["path"])
        assert e["method"] in record["routes"][e["path"]], e
        body = e["body"] or {}
        assert set(body) <= set(record["requests"].get(e["path"], ())), e  # /flush_cache takes no body
        assert set(body.get("sampling_params") or {}) <= set(record["sampling_params"]), e
    assert paths == {"/generate", "/abort_request", "/pause_generation", "/flush_cache", "/release_memory_occupation",
                     "/resume_memory_occupation", "/update_weights_from_tensor", "/continue_generation",
                     "/init_weights_update_group", "/update_weights_from_distributed",
                     "/destroy_weights_update_group"}


def test_the_cuda_ipc_payload_rebuilds_each_tensor_from_the_trainers_handle_by_gpu_uuid():
    """What SGLang's TP ranks unpickle (CPU check; no GPU here): every tensor is
    ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` over the trainer's exported
    storage (the handle's fields, untouched), at its byte offset, with the GPU's UUID as the
    device (SGLang's patched rebuild maps it to its own index), and nothing outside the
    modules SGLang's SafeUnpickler allows."""
    import base64
    import io
    import pickle

    from engines.sglang.weights import by_ipc_handle

    handle = {"nbytes": 1024, "pid": 1, "token": "t", "handle": b"\x01ipc", "size": 4096, "offset": 512,
              "ref_counter_handle": b"\x02rc", "ref_counter_offset": 8, "event_handle": b"\x03ev",
              "event_sync_required": True}
    metas = [["a.weight", [2, 3], "bfloat16", 0], ["b.bias", [4], "float32", 256]]
    rebuilt, modules = [], set()

    class Capture(pickle.Unpickler):
        def find_class(self, module, name):
            modules.add(module)
            if name == "rebuild_cuda_tensor":
                return lambda *args: rebuilt.append(args) or args
            return super().find_class(module, name)

    items = Capture(io.BytesIO(base64.b64decode(by_ipc_handle(handle, metas, "GPU-1234")))).load()
    assert [name for name, _ in items] == ["a.weight", "b.bias"]
    assert all(m.startswith(fake_sglang.SAFE_PREFIXES) or m + "." in fake_sglang.SAFE_PREFIXES for m in modules)
    a, b = rebuilt
    assert a[0] is torch.Tensor and a[1] == torch.Size([2, 3]) and a[2] == (3, 1) and a[3] == 0
    assert a[4] is torch.UntypedStorage and a[5] is torch.bfloat16 and a[6] == "GPU-1234"
    assert a[7:] == (b"\x01ipc", 4096, 512, False, b"\x02rc", 8, b"\x03ev", True)
    assert b[1] == torch.Size([4]) and b[3] == 256 // 4 and b[5] is torch.float32  # offset in elements
    with pytest.raises(ValueError, match="not exported"):
        by_ipc_handle({"nbytes": 1, "pid": 1, "token": "t"}, metas, "GPU-1234")


def test_the_trainer_pushes_into_an_sglang_engine_by_broadcast_and_by_relay(tmp_path, monkeypatch):
    """The trainer's own sender (engines.weight_sync.sender) into an SGLang EngineActor:
    forced ``distributed`` (gloo on CPU) builds a group SGLang's server joins (one rank per
    TP rank) and broadcasts back-to-back buckets it receives intact; the group is kept for
    the next push; ``auto`` on CPU goes by value through /update_weights_from_tensor."""
    from engines.actor import EngineActor
    from engines.models.model_builder import make_model
    from engines.trainer.actor import TrainerActor
    from relay import setup_torch_distributed, this_host

    monkeypatch.setenv("RELAY_SGLANG_LAUNCH", "tests.engines.fake_sglang")
    monkeypatch.setenv("FAKE_SGLANG_RECORD", str(tmp_path))
    policy = make_model("qwen3", "tiny", str(tmp_path / "policy"), seed=6)

    async def main():
        tprocs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(tprocs)
        t = tprocs.spawn("trainer", TrainerActor, policy, lr=1e-2)
        eprocs = this_host().spawn_procs(per_host={"gpus": 1})
        e = eprocs.spawn("rollout", EngineActor, policy, "sglang", device="cpu", weights_mode="discard",
                         offload=False, gpu_ids=[0], engine_config={})
        try:
            await asyncio.gather(t.initialized(240), e.initialized(240))
            await t.push_weights.call_one([e], 1, 4096, 60.0, "distributed").result(120)
            await t.push_weights.call_one([e], 2, 4096, 60.0, "distributed").result(120)
            await t.push_weights.call_one([e], 3).result(120)  # auto on CPU: by value
            weights = {n: t_ for b in await t.export_hf.call_one().result(60) for n, t_ in b.items()}
            stats = await e.stats.call_one().result(60)
            await t.shutdown.call().result(60)
        finally:
            await tprocs.stop()
            await eprocs.stop()
        return weights, stats

    weights, stats = run(main(), 280)
    assert stats["weight_version"] == 3
    (path,) = [p for p in os.listdir(tmp_path) if p.endswith(".jsonl")]
    with open(tmp_path / path) as f:
        entries = [json.loads(line) for line in f][1:]
    kinds = [e["path"] for e in entries if e["path"] != "/generate"]
    bcast = [e for e in entries if e["path"] == "/update_weights_from_distributed"]
    assert kinds.count("/init_weights_update_group") == 1  # kept across the two pushes
    init = next(e["body"] for e in entries if e["path"] == "/init_weights_update_group")
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["backend"] == "gloo"
    assert len(bcast) > 2 and {e["body"]["weight_version"] for e in bcast} == {"1", "2"}
    # a live engine: paused (retract) around each version, cache flushed on its last bucket only
    runs = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert runs == ["/init_weights_update_group", "/pause_generation", "/update_weights_from_distributed",
                    "/continue_generation", "/pause_generation", "/update_weights_from_distributed",
                    "/continue_generation", "/pause_generation", "/update_weights_from_tensor",
                    "/continue_generation", "/destroy_weights_update_group"]  # the trainer's shutdown leaves the group
    assert {e["body"]["mode"] for e in entries if e["path"] == "/pause_generation"} == {"retract"}
    assert [e["body"]["flush_cache"] for e in bcast].count(True) == 2
    received = {n: v for e in bcast if e["body"]["weight_version"] == "2" for n, v in e["tensors"].items()}
    assert set(received) == set(weights)
    assert received == pytest.approx({n: float(w.double().sum()) for n, w in weights.items()}, rel=1e-5, abs=1e-5)
    (by_value,) = [e for e in entries if e["path"] == "/update_weights_from_tensor"]
    assert by_value["body"]["weight_version"] == "3" and by_value["tensors"] == pytest.approx(received)


@pytest.mark.unit
def test_a_hostile_engine_config_gives_server_arguments_of_the_pinned_version_or_a_clear_error():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    fields = sorted(protocol()["server_args"])
    keys = st.one_of(st.sampled_from(fields + ["max_context_len", "kv_cache_tokens"]), st.text(max_size=30))
    values = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 40), st.floats(allow_nan=False),
                       st.text(max_size=20), st.lists(st.integers(), max_size=3))
    flags = {s["flag"] for s in protocol()["server_args"].values()}

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(keys, values, max_size=6), st.lists(st.integers(0, 7), min_size=1, max_size=8))
    def check(config, gpus):
        warned = []
        try:
            f = server_fields("/m", 30000, gpu_ids=gpus, engine_config=config, warn=warned.append)
        except ValueError as e:
            assert "engine config" in str(e) or "pp_size" in str(e)
            return
        argv = server_argv(f)
        assert all(isinstance(a, str) for a in argv)
        assert {a for a in argv if a.startswith("--")} <= flags
        assert f["model_path"] == "/m" and f["port"] == 30000 and f["host"] == "127.0.0.1"
        assert len(warned) == len([k for k in config if k not in protocol()["server_args"]
                                   and k not in ("max_context_len", "kv_cache_tokens")]) + len(
            [k for k in config if k in ("model_path", "host", "port")])

    check()


def test_the_installed_sglang_must_be_the_recorded_version(monkeypatch):
    """The adapter speaks one recorded SGLang version: another installed one (or none) is
    refused at start with what to install; a stand-in server (the fake) is not checked; the
    [sglang] extra pins the recorded version."""
    from importlib import metadata

    from engines.sglang.args import version_problem

    recorded = protocol()["sglang_version"]
    monkeypatch.setattr(metadata, "version", lambda name: "0.4.9")
    assert f"sglang 0.4.9 is installed, but this adapter speaks sglang {recorded}" in version_problem(
        "sglang.launch_server")
    assert version_problem("tests.engines.fake_sglang") is None

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert f"pip install 'relay-rl[sglang]' (sglang=={recorded})" in version_problem("sglang.launch_server")
    monkeypatch.setattr(metadata, "version", lambda name: recorded)
    assert version_problem("sglang.launch_server") is None
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           "pyproject.toml")) as f:
        assert f'sglang = ["sglang=={recorded}"]' in f.read()
