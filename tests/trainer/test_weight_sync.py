"""Weight sync from the trainer into built-in engines on CPU: the relay path (auto on CPU)
and the broadcast group (gloo), flattened buckets, and the group's timeouts (no hangs).
CUDA IPC is covered by the gpu tests (tests/trainer/test_gpu.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from engines import weight_sync
from engines.actor import EngineActor
from engines.builtin import TorchEngine
from engines.models.model_builder import make_model
from engines.trainer.actor import TrainerActor
from engines.trainer.train_batch import TrainBatch
from relay import ActorError, setup_torch_distributed, this_host
from tests.helpers import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SEQS = [[5 + (i * 11 + j * 5) % 90 for j in range(18)] for i in range(4)]
MASKS = [[0] * 5 + [1] * 12 for _ in SEQS]
ADV = [1.0, -1.0, 0.5, -0.5]
GREEDY = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return make_model("qwen3", "tiny", str(tmp_path_factory.mktemp("p") / "policy"), seed=6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.unit
def test_flatten_packs_mixed_dtypes_aligned_and_unflatten_views_them():
    named = [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.tensor([1, 2, 3], dtype=torch.bfloat16)),
        ("c", torch.arange(5, dtype=torch.int64)),
    ]
    buf, metas = weight_sync.flatten(named, "cpu")
    assert buf.dtype == torch.uint8 and all(m[3] % weight_sync.ALIGN == 0 for m in metas)
    assert metas == weight_sync.metas_for([m[0] for m in metas], [m[2] for m in metas], [m[1] for m in metas])[0]
    back = weight_sync.unflatten(buf, metas)
    assert [n for n, _ in back] == ["a", "b", "c"]
    assert all(torch.equal(x, y) and x.dtype == y.dtype for (_, x), (_, y) in zip(named, back))
    reused, _ = weight_sync.flatten(named[:1], "cpu", out=buf)  # a smaller bucket packs into the same buffer
    assert reused.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="unknown dtype"):
        weight_sync.unflatten(buf, [["x", [1], "float99", 0]])


@pytest.mark.unit
def test_a_receiver_in_the_senders_process_reads_the_bucket_until_it_is_released():
    """Colocated actors share a worker process, where CUDA cannot open its own IPC handle:
    the handle then names the sender's buffer, valid until the sender releases it."""
    buf, metas = weight_sync.flatten([("w", torch.arange(6.0))], "cpu")
    h = weight_sync.ipc_handle(buf, cross_process=False)
    assert "handle" not in h  # nothing exported to CUDA
    ((name, view),) = weight_sync.unflatten(weight_sync.open_ipc(h, "cpu"), metas)
    assert name == "w" and torch.equal(view, torch.arange(6.0))
    assert view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # no copy
    weight_sync.release(h)
    with pytest.raises(RuntimeError, match="released before the receiver opened it"):
        weight_sync.open_ipc(h, "cpu")


@pytest.mark.unit
def test_tensors_inside_a_large_storage_are_shared_in_place_as_views():
    """The trainer's parameter buffer is shared once; each tensor is a view of it (strided
    ones included, as a q/k/v split of a fused weight is); small tensors are left to the
    flat buckets. The receiver's views read the very same memory."""
    flat = torch.arange(64, dtype=torch.float32)
    fused = flat[:48].view(6, 8)
    named = [("whole", fused), ("strided", fused[:, 2:5]), ("tail", flat[48:]), ("small", torch.ones(3))]
    # q split out of a fused [group x (q, k, v)] weight: no 2-D view of it exists
    split = weight_sync.shaped(fused.view(2, 3, 8)[:, :2], (4, 8))
    named.append(("split", split))
    handles, metas, rest = weight_sync.share_in_place(named, cross_process=False, min_bytes=64 * 4)
    assert len(handles) == 1 and [n for n, _ in rest] == ["small"]
    assert [m[5] for m in metas] == [0, 0, 0, 0]
    views = weight_sync.open_views(handles, metas, "cpu")
    for (name, view), (_, t) in zip(views[:3], named):
        assert torch.equal(view, t) and view.stride() == t.stride(), name
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # no copy
    name, view = views[3]  # still a view (no copy), marked with the HF shape it stands for
    assert name == "split" and view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert weight_sync.hf_shape(view) == (4, 8) and torch.equal(view.reshape(4, 8), split.reshape(4, 8))
    for bad in (["x", [4], [1], 61, "float32", 0, [4]],  # runs past the end of the 64-element storage
                ["x", [2, 2], [63, 1], 0, "float32", 0, [2, 2]], ["x", [2], [-1], 5, "float32", 0, [2]],
                ["x", [4], [1], 31, "float64", 0, [4]]):
        with pytest.raises(ValueError, match="does not lie within"):
            weight_sync.open_views(handles, [bad], "cpu")
    ok = weight_sync.open_views(handles, [["x", [4], [1], 60, "float32", 0, [2, 2]]], "cpu")[0][1]
    assert torch.equal(ok, flat[60:].view(2, 2))
    with pytest.raises(ValueError, match="cannot become shape"):
        weight_sync.open_views(handles, [["x", [4], [1], 60, "float32", 0, [5]]], "cpu")
    with pytest.raises(ValueError, match="shared storage 1 of 1"):
        weight_sync.open_views(handles, [["x", [1], [1], 0, "float32", 1, [1]]], "cpu")
    # packing a shaped view writes the HF tensor under its HF shape
    buf, packed = weight_sync.flatten([("split", split)], "cpu")
    assert packed[0][1] == [4, 8] and torch.equal(weight_sync.unflatten(buf, packed)[0][1], split.reshape(4, 8))
    for h in handles:
        weight_sync.release(h)


@pytest.mark.unit
def test_a_lazy_qkv_split_is_views_of_the_fused_weight_with_the_same_values():
    from types import SimpleNamespace

    from engines.trainer.megatron_model import _split_qkv

    for groups in (1, 2):
        cfg = SimpleNamespace(num_kv_heads=groups, head_dim=4, num_heads=4)
        w = torch.randn(groups * (4 // groups + 2) * 4, 8)
        for eager, lazy in zip(_split_qkv(cfg, w), _split_qkv(cfg, w, lazy=True)):
            assert lazy.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()  # no copy
            assert weight_sync.hf_shape(lazy) == tuple(eager.shape)
            assert torch.equal(lazy.reshape(eager.shape), eager)


def test_an_engine_takes_weights_shared_in_place_as_from_update_weights(policy):
    """The receiving side of in-place sharing (``update_weights_from_ipc`` with a list of
    handles), in the sender's process as colocated actors are: the engine ends up with the
    same outputs as an engine given the same tensors by ``update_weights``. q/k/v are sent
    as a trainer does: strided views out of Megatron's fused per-group weight, which the
    engine copies into views of its own parameters."""
    from safetensors.torch import load_file

    from engines.models.model import ModelConfig
    from engines.trainer.megatron_model import _qkv_rows, _split_qkv

    cfg = ModelConfig.from_dir(policy)

    async def main():
        a, b = TorchEngine(policy, kv_cache_tokens=256), TorchEngine(policy, kv_cache_tokens=256)
        gen = torch.Generator().manual_seed(0)
        new = {n: t.float() + 0.05 * torch.randn(t.shape, generator=gen)
               for n, t in load_file(f"{policy}/model.safetensors").items()}
        # one storage for every tensor, as a trainer's parameter buffer holds them
        total = sum(t.numel() for t in new.values())
        flat, named, off = torch.empty(total, dtype=torch.float32), [], 0
        for n, t in new.items():
            flat[off:off + t.numel()].copy_(t.reshape(-1))
            named.append((n, flat[off:off + t.numel()].view(t.shape)))
            off += t.numel()
        named = dict(named)
        for i in range(cfg.num_layers):
            qkv = [f"model.layers.{i}.self_attn.{x}_proj.weight" for x in "qkv"]
            fused = _qkv_rows(cfg, *(named[n] for n in qkv))
            for n, view in zip(qkv, _split_qkv(cfg, fused, lazy=True)):
                named[n] = view
        assert weight_sync.hf_shape(named["model.layers.0.self_attn.q_proj.weight"]) != tuple(
            named["model.layers.0.self_attn.q_proj.weight"].shape)  # a strided view, as from a trainer
        handles, metas, rest = weight_sync.share_in_place(list(named.items()), cross_process=False, min_bytes=1)
        assert not rest
        await a.update_weights_from_ipc(handles, metas, 3)
        await b.update_weights([new], 3)
        outs = [await e.generate(SEQS[0][:8], GREEDY) for e in (a, b)]
        for e in (a, b):
            await e.close()
        return outs

    x, y = run(main(), 120)
    assert x.token_ids == y.token_ids and x.logprobs == y.logprobs and x.weight_version == 3


def test_the_in_place_push_sends_views_packed_rest_and_later_buckets(policy, monkeypatch):
    """``WeightSender.push`` to a built-in engine by IPC (in the sender's process, as
    colocated actors are): tensors of the large storage go as views, q/k/v as views the
    engine reshapes, the small rest packed with them in the same call and, past
    ``bucket_bytes``, in further buckets. The engine then equals one given the same tensors
    by ``update_weights``; every byte is counted once."""
    import os

    from safetensors.torch import load_file

    from engines.weight_sync.sender import Route, WeightSender

    gen = torch.Generator().manual_seed(1)
    new = {n: t.float() + 0.05 * torch.randn(t.shape, generator=gen)
           for n, t in load_file(f"{policy}/model.safetensors").items()}
    big = sorted(n for n in new if n.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight")))
    qs = sorted(n for n in new if n.endswith("q_proj.weight"))
    # a parameter buffer holding those, and each q inside a fused per-group weight (two groups,
    # each [its q rows; 3 more rows]) whose split hands q over as a view of another shape
    fused = {n: torch.cat([new[n].view(2, new[n].shape[0] // 2, -1), torch.zeros(2, 3, new[n].shape[1])], 1)
             for n in qs}
    flat = torch.cat([new[n].reshape(-1) for n in big] + [fused[n].reshape(-1) for n in qs])
    named, off = {}, 0
    for n in big + qs:
        shape = new[n].shape if n in big else fused[n].shape
        part = flat[off:off + shape.numel()].view(shape)
        named[n] = part if n in big else weight_sync.shaped(part[:, :new[n].shape[0] // 2], new[n].shape)
        off += shape.numel()
    for n, t in new.items():
        if n not in named:
            named[n] = t.clone()  # small tensors of their own

    async def main():
        a, b = TorchEngine(policy, kv_cache_tokens=256), TorchEngine(policy, kv_cache_tokens=256)
        loop = asyncio.get_running_loop()

        class Call:
            def __init__(self, *args):
                self.future = asyncio.run_coroutine_threadsafe(a.update_weights_from_ipc(*args), loop)
                calls.append(args)

            def get(self, timeout):
                return self.future.result(timeout)

        calls: list = []
        mesh = type("Mesh", (), {"update_weights_from_ipc": type("E", (), {"call": staticmethod(Call)})})
        route = Route(mesh, "ipc", 0, {"backend": "torch", "pid": os.getpid()})
        sender = WeightSender(0, torch.device("cpu"))
        assert sender.in_place_only([route], 0)
        monkeypatch.setattr(weight_sync, "SHARE_MIN_BYTES", flat.numel() * 4)  # only the "parameter buffer"
        sent = await asyncio.to_thread(sender.push, [route], named, 2048, 5, 60.0)
        await b.update_weights([new], 5)
        outs = [await e.generate(SEQS[0][:8], GREEDY) for e in (a, b)]
        for e in (a, b):
            await e.close()
        return sent, calls, outs

    sent, calls, (x, y) = run(main(), 120)
    total = sum(t.numel() * 4 for t in new.values())
    assert total <= sent <= total + weight_sync.ALIGN * len(new)  # packed buckets count their alignment
    assert isinstance(calls[0][0], list) and len(calls) > 2  # views first, then buckets
    assert [c[3] for c in calls] == [False] * (len(calls) - 1) + [True]  # the last call completes the version
    assert x.token_ids == y.token_ids and x.logprobs == y.logprobs and x.weight_version == 5


def test_push_weights_relay_and_broadcast_group_make_engines_match_the_trainer(policy):
    async def main():
        tprocs = this_host().spawn_procs(per_host={"gpus": 1})
        await setup_torch_distributed(tprocs)
        t = tprocs.spawn("trainer", TrainerActor, policy, lr=1e-2)
        eprocs = this_host().spawn_procs(per_host={"gpus": 2})
        engines = eprocs.spawn("rollout", EngineActor, policy, "torch", kv_cache_tokens=1024, weights_mode="discard")
        await asyncio.gather(t.initialized(240), engines.initialized(240))
        await t.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)  # weights now differ from the checkpoint
        await t.offload.call_one().result(60)  # colocated order: the trainer pushes while offloaded
        await engines.sleep.call(["weights", "kv_cache"]).result(60)
        await engines.wake.call(["weights"]).result(60)
        e0, e1 = engines.slice(gpus=0), engines.slice(gpus=1)
        relay_bytes = await t.push_weights.call_one([e0], 1, 4096).result(120)  # auto on CPU: relay
        bcast_bytes = await t.push_weights.call_one([e1], 1, 4096, 60.0, "distributed").result(
            120
        )  # gloo group, many buckets
        groups = [(await e1.stats.call_one().result(60))["weight_update_groups"]]
        await engines.wake.call(["kv_cache"]).result(60)
        outs = (await engines.generate.call(SEQS[0][:6], GREEDY).result(60)).values()
        await t.onload.call_one().result(60)
        seq = SEQS[0][:6] + outs[0].token_ids
        trainer_lp = (await t.compute_logprobs.call_one([seq]).result(60))[0][5:]
        # a second push (new weights) reuses the group: no second set-up
        await t.train_step.call_one(TrainBatch(SEQS, MASKS, ADV)).result(120)
        await t.push_weights.call_one([e1], 2, 4096, 60.0, "distributed").result(120)
        groups.append((await e1.stats.call_one().result(60))["weight_update_groups"])
        again = await e1.generate.call_one(SEQS[0][:6], GREEDY).result(60)
        seq2 = SEQS[0][:6] + again.token_ids
        trainer_lp2 = (await t.compute_logprobs.call_one([seq2]).result(60))[0][5:]
        events = (await engines.events.call().result(60)).values()
        with pytest.raises(ActorError, match="CUDA IPC"):
            await t.push_weights.call_one([e0], 2, 4096, 60.0, "ipc").result(60)
        await t.shutdown.call().result(60)
        groups.append((await e1.stats.call_one().result(60))["weight_update_groups"])  # the trainer tore it down
        await tprocs.stop()
        await eprocs.stop()
        return relay_bytes, bcast_bytes, outs, trainer_lp, events, groups, again, trainer_lp2

    relay_bytes, bcast_bytes, outs, trainer_lp, events, groups, again, trainer_lp2 = run(main(), 280)
    assert len(groups[0]) == 1 and groups[1] == groups[0] and groups[2] == []
    assert again.weight_version == 2 and max(abs(a - b) for a, b in zip(again.logprobs, trainer_lp2)) < 1e-4
    assert relay_bytes > 0 and bcast_bytes >= relay_bytes  # the flat buffers are padded to ALIGN
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs
    assert all(r.weight_version == 1 for r in outs)
    assert max(abs(a - b) for a, b in zip(outs[0].logprobs, trainer_lp)) < 1e-4
    assert [e[2] for e in events[0] if e[1] == "update_weights"] == [1]  # one event per push, after its last bucket
    assert [e[2] for e in events[1] if e[1] == "update_weights"] == [1, 2]


def test_broadcast_group_times_out_instead_of_hanging(policy):
    """An engine whose trainer never comes, a trainer whose engine never comes, and a
    receiver whose sender never sends: each raises within its timeout."""

    async def main():
        eng = TorchEngine(policy, kv_cache_tokens=256)
        with pytest.raises(TimeoutError, match="weight-sync group"):
            await eng.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "g", "gloo", timeout_s=2.0)
        with pytest.raises(RuntimeError, match="no weight-update group"):
            await eng.update_weights_from_distributed(["x"], ["float32"], [[1]], 1, "g")
        with pytest.raises(RuntimeError, match="needs a CUDA engine"):
            await eng.update_weights_from_ipc({}, [], 1)
        await eng.close()

    run(main(), 120)  # (the module's pytest timeout catches a hang)
    with pytest.raises(TimeoutError, match="did not meet its peers"):
        weight_sync.BroadcastGroup("127.0.0.1", free_port(), 0, 2, "gloo", 2.0, "lonely")
    # Both ranks joined, but the sender never broadcasts: the receiver gives up.
    import concurrent.futures

    port = free_port()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        groups = list(
            pool.map(lambda r: weight_sync.BroadcastGroup("127.0.0.1", port, r, 2, "gloo", 2.0, "silent"), [0, 1])
        )
    with pytest.raises(TimeoutError, match="did not finish"):
        groups[1].broadcast(torch.empty(16, dtype=torch.uint8))
    groups[0].close()


class _Call:
    """A fake actor endpoint: ``call`` runs ``fn`` on the engine's one thread (calls taken
    in order, as an actor's) and returns a future with ``get`` / ``done``, as relay's."""

    def __init__(self, engine, fn):
        self.engine, self.fn = engine, fn

    def call(self, *args):
        self.engine.log.append(("call", self.fn.__name__, args[-1] if self.fn.__name__ == "receive" else None))
        return _Fut(self.engine, self.engine.thread.submit(self.fn, *args))


class _Fut:
    def __init__(self, engine, cf):
        self.engine, self.cf = engine, cf

    def get(self, timeout=None):
        if timeout != 0:  # (the broadcast's watch reads done futures with 0: not a wait)
            self.engine.log.append(("get", self.cf in self.engine.receives))
        return self.cf.result(timeout)

    def done(self):
        return self.cf.done()


class _FakeEngine:
    """The receiving side of a broadcast group, as a built-in (or SGLang) engine runs it:
    joins the gloo group, receives each bucket into a flat buffer, keeps its tensors."""

    def __init__(self, backend: str, fail_at: int | None = None):
        import concurrent.futures

        self.info = {"backend": backend, "device_type": "cpu", "uuid": None, "engine_id": f"fake-{backend}"}
        self.thread = concurrent.futures.ThreadPoolExecutor(1)
        self.log, self.got, self.receives, self.fail_at = [], {}, set(), fail_at
        self.group = None
        self.init_weights_update_group = _Call(self, self.join)
        self.update_weights_from_distributed = _Call(self, self.receive)
        self.destroy_weights_update_group = _Call(self, self.leave)

    def join(self, address, port, rank, size, name, backend, timeout):
        self.group = weight_sync.BroadcastGroup(address, port, rank, size, backend, timeout, name)

    def receive(self, names, dtypes, shapes, version, name, last):
        metas, total = weight_sync.metas_for(names, dtypes, shapes)
        if self.fail_at is not None and len(self.got) >= self.fail_at:  # (one tensor a bucket here)
            raise RuntimeError("engine failed before receiving a bucket")  # as an allocation that fails
        buf = torch.empty(total, dtype=torch.uint8)
        self.group.broadcast(buf)
        self.got.update((n, t.clone()) for n, t in weight_sync.unflatten(buf, metas))

    def leave(self, name):
        if self.group is not None:
            self.group.close()


def _push_to_fake(engine: _FakeEngine, named: dict, timeout: float = 30.0) -> int:
    from engines.weight_sync.sender import WeightSender

    sender = WeightSender(0, torch.device("cpu"))
    calls = engine.receives
    original = engine.update_weights_from_distributed.call

    def call(*args):  # mark the futures of bucket calls (the log tells them from the join's)
        f = original(*args)
        calls.add(f.cf)
        return f

    engine.update_weights_from_distributed.call = call
    try:
        return sender._push_broadcast([engine], [engine.info], weight_sync.buckets(named, 64), 1, timeout)
    finally:
        sender.close(5.0)
        engine.thread.shutdown(wait=False)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_broadcast_push_sends_the_next_bucket_before_the_last_ack_to_built_in_engines_only():
    """Built-in engines take their calls in order: bucket i+1 is announced and broadcast
    before bucket i's acknowledgement is read. SGLang servers (unordered HTTP) get one
    bucket at a time. Both receive exactly the trainer's tensors."""
    named = {f"w{i:02d}": torch.arange(12, dtype=torch.float32) * (i + 1) for i in range(6)}  # 48 B each: 6 buckets
    orders = {}
    for backend in ("torch", "sglang"):
        engine = _FakeEngine(backend)
        sent = _push_to_fake(engine, named)
        assert sent >= sum(t.numel() * 4 for t in named.values())
        assert set(engine.got) == set(named) and all(torch.equal(engine.got[n], t) for n, t in named.items())
        orders[backend] = [e for e in engine.log if e[0] == "get" and e[1] or e[0] == "call" and e[1] == "receive"]
    calls_before_first_ack = {b: next(i for i, e in enumerate(o) if e[0] == "get") for b, o in orders.items()}
    assert calls_before_first_ack == {"torch": 2, "sglang": 1}
    assert [e[0] for e in orders["sglang"]] == ["call", "get"] * 6
    assert [e[0] for e in orders["torch"]] == ["call", "call"] + ["get", "call"] * 4 + ["get", "get"]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_an_engine_failing_mid_push_ends_the_broadcast_at_once_with_its_error():
    """A receiver that fails before taking part in a bucket's broadcast (its call raised)
    never joins it: the sender raises that error at once, not the group's timeout (30 s)
    for the broadcast it waits in, and tears the group down."""
    import time

    named = {f"w{i:02d}": torch.ones(12) * i for i in range(6)}
    engine = _FakeEngine("torch", fail_at=2)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="engine failed before receiving a bucket"):
        _push_to_fake(engine, named, timeout=30.0)
    assert time.monotonic() - t < 5
    assert engine.group.pg is None  # the sender's teardown reached the engine: it left the group
