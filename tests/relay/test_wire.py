"""The wire: typed values only, zero-copy buffers, bit-exact arrays and tensors, no pickle."""

from __future__ import annotations

import enum
import gc
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import relay
from relay import _wire, this_host
from tests.helpers import run
from tests.relay.actors import Echo, Job

DTYPES_NP = [
    np.float32,
    np.float64,
    np.float16,
    np.int8,
    np.uint8,
    np.int16,
    np.int32,
    np.int64,
    np.bool_,
    np.complex64,
]
DTYPES_TORCH = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]


def roundtrip(value):
    data, buffers = _wire.encode(value)
    frames = [
        memoryview(np.ascontiguousarray(b)).cast("B") if isinstance(b, np.ndarray) else memoryview(b) for b in buffers
    ]
    return _wire.decode(data, frames)


@pytest.mark.unit
def test_plain_values_roundtrip():
    value = {
        "a": [1, 2.5, "x", None, True],
        "t": (1, (2, 3)),
        "s": {1, 2},
        "f": frozenset({"q"}),
        "b": b"\x00\xff",
        3: "int key",
    }
    assert roundtrip(value) == value
    assert isinstance(roundtrip((1, 2)), tuple)
    assert roundtrip(bytearray(200_000)) == bytes(200_000)  # large: its own frame


@pytest.mark.unit
def test_registered_dataclass_and_enum_roundtrip():
    @relay.register(name="test.Color")
    class Color(enum.Enum):
        RED = 1

    job = Job("j", [1.0, 2.0], {"color": Color.RED})
    out = roundtrip(job)
    assert out == job and out.meta["color"] is Color.RED


@pytest.mark.unit
def test_unregistered_types_fail_at_the_sender_with_a_clear_error():
    @dataclass
    class NotRegistered:
        x: int

    with pytest.raises(TypeError, match="register it with @relay.register"):
        _wire.encode(NotRegistered(1))
    with pytest.raises(TypeError, match="cannot send a value of type builtins.object"):
        _wire.encode([object()])
    with pytest.raises(TypeError, match="object or structured"):
        _wire.encode(np.array([object()]))


@pytest.mark.unit
def test_exceptions_travel_as_structured_data():
    try:
        raise KeyError("missing")
    except KeyError as e:
        out = roundtrip(e)
    assert isinstance(out, KeyError) and out.args == ("missing",)
    assert "raise KeyError" in out.remote_traceback

    class Custom(Exception):
        pass

    out = roundtrip(Custom("boom"))
    assert isinstance(out, relay.RemoteException) and "Custom" in out.type_name and out.message == "boom"


@pytest.mark.unit
def test_decoding_never_unpickles():
    import pickle

    # An attacker-controlled header naming an arbitrary callable is refused, not called.
    data = _wire.Encoder()._ext(_wire._EXT_REGISTERED, ["os:system", {"command": "echo pwned"}])
    import msgpack

    blob = msgpack.packb(data)
    with pytest.raises(TypeError, match="unregistered type 'os:system'"):
        _wire.decode(blob, [])
    assert "pickle" not in open(_wire.__file__).read().replace("No pickle", "").replace("never unpickle", "")
    del pickle


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_arrays_and_tensors_roundtrip_bit_exact_through_processes():
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 100, size=(3, 5, 7)).astype(dt) for dt in DTYPES_NP]
    arrays.append(np.arange(60, dtype=np.float32).reshape(6, 10)[:, ::3])  # non-contiguous
    arrays.append(np.zeros((0, 4), dtype=np.float32))
    arrays.append(np.float32(1.5))  # numpy scalar
    tensors = [(torch.randn(4, 6) * 100).to(dt) for dt in DTYPES_TORCH]
    tensors.append(torch.arange(48, dtype=torch.float32).reshape(6, 8).t())  # non-contiguous
    tensors.append(torch.randn(3, 3, requires_grad=True))
    tensors.append(torch.empty(0, 3, dtype=torch.bfloat16))

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        echo = procs.spawn("echo", Echo)
        back = await echo.echo.call_one({"arrays": arrays, "tensors": tensors})
        for a, b in zip(arrays, back["arrays"]):
            assert type(a) is type(b)
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(tensors, back["tensors"]):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(
                a.detach().contiguous().view(-1).view(torch.uint8) if a.numel() else a.detach(),
                b.contiguous().view(-1).view(torch.uint8) if b.numel() else b,
            )
        big = rng.integers(0, 255, size=8 << 20, dtype=np.uint8)
        out = await echo.echo.call_one(big)
        assert np.array_equal(out, big)
        # Zero-copy on receive: the array is a view of the message frame, not a copy.
        base = out
        while isinstance(base, np.ndarray):
            assert not base.flags.owndata
            base = base.base
        assert isinstance(base, memoryview)
        await procs.stop()

    run(main())


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_unregistered_argument_fails_at_the_sender_and_reply_errors_name_the_endpoint():
    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 1})
        echo = procs.spawn("echo", Echo)
        with pytest.raises(TypeError, match="register it with @relay.register"):
            echo.echo.call_one(object())  # raised by call_one itself, nothing sent
        with pytest.raises(relay.ActorError, match="return value of 'unregistered_reply'"):
            await echo.unregistered_reply.call_one()
        with pytest.raises(TypeError, match="cannot send a tensor on meta"):
            echo.echo.call_one(torch.empty(2, device="meta"))
        assert await echo.echo.call_one("still fine") == "still fine"
        await procs.stop()

    run(main())


@pytest.mark.unit
def test_relay_imports_without_torch():
    code = "import relay, sys; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr



def test_values_encode_while_another_thread_is_still_importing_numpy_and_torch():
    """A module being imported by another thread is already in sys.modules, without its
    classes yet (the controller imports torch in a thread while its event loop sends)."""
    code = (
        "import sys, types\n"
        "sys.modules['numpy'] = types.ModuleType('numpy')  # as a partially initialized import looks\n"
        "sys.modules['torch'] = types.ModuleType('torch')\n"
        "from relay import _wire\n"
        "blob, bufs = _wire.encode({'a': [1, 2.5, 'x'], 'b': b'y'})\n"
        "assert _wire.decode(blob, bufs) == {'a': [1, 2.5, 'x'], 'b': b'y'}\n"
        "try:\n"
        "    _wire.encode(object())\n"
        "except TypeError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout, out.stdout

def _state(path: str) -> int:
    """An arena segment's state byte."""
    with open(path, "rb") as f:
        return f.read(1)[0]


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "socket"])
def test_large_buffers_same_host_with_and_without_shared_memory(monkeypatch, shm):
    import os

    from relay import _shm

    monkeypatch.setenv("RELAY_SHM", shm)
    big = np.random.default_rng(1).standard_normal(3 << 20).astype(np.float32)  # 12 MiB
    tensor = torch.from_numpy(big.copy()).to(torch.bfloat16)

    async def main():
        procs = this_host().spawn_procs(per_host={"gpus": 2})
        echo = procs.spawn("echo", Echo)
        vm = await echo.echo.call({"a": big, "t": tensor})  # fan-out: each peer gets its own copy
        for out in vm.values():
            assert np.array_equal(out["a"], big) and torch.equal(out["t"], tensor)
        sent = relay.transport_stats().get("shm_buffers_sent", 0)
        replied = sum(s.get("shm_buffers_sent", 0) for s in (await echo.stats.call()).values())
        if shm == "1":
            assert sent == 4 and replied == 4  # 2 buffers to each of 2 peers, and back
            # arena segments only (one-off files are taken by their receivers), each free again once
            # its receiver's views are gone: ours of the replies now, the echoes' of the requests
            del vm, out
            gc.collect()
            names = os.listdir(_shm.job_dir())
            assert names and all(_shm._SEGMENT.match(n) for n in names), names
            assert all(_state(os.path.join(_shm.job_dir(), n)) == _shm.FREE for n in names)
            again = await echo.echo.call({"a": big, "t": tensor})  # the same segments carry the next ones
            assert all(np.array_equal(o["a"], big) for o in again.values())
            assert sorted(os.listdir(_shm.job_dir())) == sorted(names)
        else:
            assert sent == 0 and replied == 0
        await procs.stop()

    run(main())
    if shm == "1":
        assert not os.path.exists(_shm.job_dir())  # the root removed the job's directory
