"""Wire encoding: msgpack headers plus raw buffer frames. No pickle, ever.

A value is encoded into one msgpack blob plus a list of out-of-band buffers (numpy arrays,
CPU torch tensors, large bytes). Buffers travel as separate ZeroMQ frames and are decoded
as read-only views of the received frames (zero-copy). Only these values travel:
None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, numpy arrays and
scalars, CPU torch tensors, exceptions (as structured data), and classes registered with
:func:`register` (dataclasses and enums). Anything else fails at the sender with a
``TypeError`` that says what to do.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import importlib
import sys
import threading
import traceback
import warnings
from typing import Any

import msgpack

# Ext type codes (stable: they are the wire format).
_EXT_TUPLE = 1
_EXT_SET = 2
_EXT_FROZENSET = 3
_EXT_NDARRAY = 4
_EXT_TENSOR = 5
_EXT_REGISTERED = 6
_EXT_EXCEPTION = 7
_EXT_OOB_BYTES = 8
_EXT_NPSCALAR = 9
_EXT_ENUM = 10
_EXT_CODEC = 11

#: Bytes longer than this travel as their own frame instead of inside the header.
OOB_BYTES_THRESHOLD = 64 * 1024

_registry: dict[str, type] = {}
_codecs_by_type: dict[type, tuple[str, Any]] = {}
_codecs_by_name: dict[str, Any] = {}


def register_codec(cls: type, name: str, to_wire, from_wire) -> None:
    """Let instances of ``cls`` travel as ``to_wire(obj)`` (any wire value), rebuilt on the
    other side with ``from_wire(value)``. For runtime types such as mesh references."""
    _codecs_by_type[cls] = (name, to_wire)
    _codecs_by_name[name] = from_wire


def _type_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def register(cls: type | None = None, *, name: str | None = None):
    """Allow a dataclass, an enum or an exception class to travel over the wire.

    Usable as ``@register`` or ``@register(name="stable.name")``. Both ends must import the
    module that registers the class (the receiver imports it by module name on first use).
    """

    def apply(c: type) -> type:
        ok = dataclasses.is_dataclass(c) or issubclass(c, enum.Enum) or issubclass(c, BaseException)
        if not ok:
            raise TypeError(
                f"relay.register accepts dataclasses, enums and exception classes; "
                f"{_type_name(c)} is none of these"
            )
        key = name or _type_name(c)
        prev = _registry.get(key)
        if prev is not None and prev is not c and _type_name(prev) != _type_name(c):
            raise ValueError(f"wire name {key!r} is already registered for {_type_name(prev)}")
        _registry[key] = c
        c.__relay_wire_name__ = key
        return c

    return apply(cls) if cls is not None else apply


def is_registered(cls: type) -> bool:
    return getattr(cls, "__relay_wire_name__", None) in _registry


def _lookup(key: str) -> type:
    cls = _registry.get(key)
    if cls is None:
        module = key.split(":", 1)[0]
        if module and module not in sys.modules:
            try:
                importlib.import_module(module)
            except Exception as e:  # the message below says what to do
                raise TypeError(f"cannot decode {key!r}: importing {module!r} failed: {e}") from None
        cls = _registry.get(key)
    if cls is None:
        raise TypeError(f"received a value of unregistered type {key!r}; register it with @relay.register")
    return cls


class RemoteException(Exception):
    """Stand-in for an exception whose class cannot be rebuilt on this side."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.message = message
        self.remote_traceback = remote_traceback


def _unsupported(obj: Any) -> TypeError:
    return TypeError(
        f"relay cannot send a value of type {type(obj).__module__}.{type(obj).__qualname__}: "
        "register it with @relay.register (dataclasses, enums, exceptions) or convert it to a "
        "supported type (None, bool, int, float, str, bytes, list, tuple, dict, set, "
        "numpy.ndarray, CPU torch.Tensor)"
    )


def _np():
    import numpy

    return numpy


class Encoder:
    """Encodes messages; collects one message's out-of-band buffers in ``self.buffers``.

    Reused (one per thread, see :func:`encode`): its msgpack packers keep their internal
    buffers, since allocating a fresh one per message costs more than the packing."""

    __slots__ = ("buffers", "_packers", "_depth")

    def __init__(self) -> None:
        self.buffers: list[Any] = []
        self._packers: list[msgpack.Packer] = []
        self._depth = 0

    def _packer(self) -> msgpack.Packer:
        while len(self._packers) <= self._depth:
            packer = msgpack.Packer(default=self._default, strict_types=True, use_bin_type=True, autoreset=True)
            self._packers.append(packer)
        return self._packers[self._depth]

    def pack(self, obj: Any) -> bytes:
        self._depth = 0
        return self._packer().pack(obj)

    def _ext(self, code: int, data: Any) -> msgpack.ExtType:
        self._depth += 1  # an ext's payload is packed while its parent is being packed
        try:
            return msgpack.ExtType(code, self._packer().pack(data))
        finally:
            self._depth -= 1

    def _buffer(self, buf: Any) -> int:
        self.buffers.append(buf)
        return len(self.buffers) - 1

    def _default(self, obj: Any) -> Any:
        t = type(obj)
        if t is tuple:
            return self._ext(_EXT_TUPLE, list(obj))
        if t is set:
            return self._ext(_EXT_SET, list(obj))
        if t is frozenset:
            return self._ext(_EXT_FROZENSET, list(obj))
        if t is bytearray or t is memoryview:
            # Plain bytes are packed inline by msgpack; large bytearrays/memoryviews travel
            # as their own frame without a copy and arrive as bytes.
            if (obj.nbytes if t is memoryview else len(obj)) > OOB_BYTES_THRESHOLD:
                return self._ext(_EXT_OOB_BYTES, self._buffer(obj))
            return bytes(obj)
        codec = _codecs_by_type.get(t)
        if codec is not None:
            return self._ext(_EXT_CODEC, [codec[0], codec[1](obj)])
        # Subclasses of the native types (bool excluded) fall here because of strict_types.
        if isinstance(obj, BaseException):
            return self._encode_exception(obj)
        if isinstance(obj, enum.Enum) and is_registered(t):
            return self._ext(_EXT_ENUM, [t.__relay_wire_name__, obj.value])
        # numpy / torch only once imported (a module another thread is still importing is in
        # sys.modules without its classes: then no object can be an instance of them)
        np = sys.modules.get("numpy")
        if np is not None and hasattr(np, "generic"):
            if t is getattr(np, "ndarray", None):
                return self._encode_ndarray(obj)
            if isinstance(obj, np.generic):
                arr = np.asarray(obj)
                if arr.dtype.kind in "OV":
                    raise _unsupported(obj)
                return self._ext(_EXT_NPSCALAR, [arr.dtype.str, arr.tobytes()])
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, getattr(torch, "Tensor", ())):
            return self._encode_tensor(obj, torch)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and is_registered(t):
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            return self._ext(_EXT_REGISTERED, [t.__relay_wire_name__, fields])
        if isinstance(obj, (int, float, str, bytes, list, dict)) and not is_registered(t):
            # e.g. an IntEnum not registered, or a str subclass: send the plain value.
            for base in (bool, int, float, str, bytes, list, dict):
                if isinstance(obj, base):
                    return base(obj)
        raise _unsupported(obj)

    def _encode_ndarray(self, arr: Any) -> msgpack.ExtType:
        np = _np()
        if arr.dtype.kind in "OV":
            raise TypeError(f"relay cannot send numpy arrays of dtype {arr.dtype} (object or structured)")
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return self._ext(_EXT_NDARRAY, [arr.dtype.str, list(arr.shape), self._buffer(arr)])

    def _encode_tensor(self, t: Any, torch: Any) -> msgpack.ExtType:
        if t.device.type != "cpu":
            raise TypeError(
                f"relay cannot send a tensor on {t.device}: bulk device tensors go over "
                "torch.distributed or CUDA IPC; move it to the CPU first to send it here"
            )
        t = t.detach()
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"relay cannot send a {t.layout} tensor; send a dense tensor")
        if not t.is_contiguous():
            t = t.contiguous()
        dtype_name = str(t.dtype).removeprefix("torch.")
        flat = t.reshape(-1)
        if flat.numel() and flat.element_size() in (1, 2, 4, 8):
            view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
            raw = flat.view(view_dtype).numpy()
        else:
            raw = flat.numpy() if flat.numel() else b""
        return self._ext(_EXT_TENSOR, [dtype_name, list(t.shape), self._buffer(raw)])

    def _encode_exception(self, exc: BaseException) -> msgpack.ExtType:
        t = type(exc)
        args = []
        for a in exc.args:
            try:
                Encoder().pack(a)
                args.append(a)
            except Exception:
                args.append(repr(a))
        tb = getattr(exc, "remote_traceback", None) or "".join(
            traceback.format_exception(t, exc, exc.__traceback__)
        )
        return self._ext(
            _EXT_EXCEPTION,
            [getattr(t, "__relay_wire_name__", None) or _type_name(t), str(exc), args, tb],
        )


_local = threading.local()


def encode(obj: Any) -> tuple[bytes, list[Any]]:
    """Encode ``obj``; return the msgpack bytes and the out-of-band buffers."""
    enc = _local.__dict__.pop("encoder", None) or Encoder()  # popped: safe if re-entered
    enc.buffers = []
    try:
        data = enc.pack(obj)
    except BaseException:
        enc = Encoder()  # a packer interrupted mid-way is not reused
        raise
    finally:
        buffers = enc.buffers
        enc.buffers = []
        _local.encoder = enc
    return data, buffers


def packb(obj: Any) -> bytes:
    """msgpack for plain values (headers), with a per-thread reusable packer."""
    p = _local.__dict__.get("packer")
    if p is None:
        p = _local.packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    return p.pack(obj)


def buffer_of(frame: Any) -> memoryview:
    """A memoryview over a received frame (a zmq.Frame, bytes or memoryview)."""
    buf = getattr(frame, "buffer", None)
    return buf if buf is not None else memoryview(frame)


class Decoder:
    __slots__ = ("frames",)

    def __init__(self, frames: list[Any]):
        self.frames = frames

    def unpack(self, data: bytes | memoryview) -> Any:
        return msgpack.unpackb(data, ext_hook=self._hook, raw=False, strict_map_key=False, use_list=True)

    def _frame(self, index: int) -> memoryview:
        if not 0 <= index < len(self.frames):
            raise ValueError(f"message refers to buffer {index} but carries {len(self.frames)}")
        return buffer_of(self.frames[index])

    def _hook(self, code: int, data: bytes) -> Any:
        v = self.unpack(data)
        if code == _EXT_TUPLE:
            return tuple(v)
        if code == _EXT_SET:
            return set(v)
        if code == _EXT_FROZENSET:
            return frozenset(v)
        if code == _EXT_OOB_BYTES:
            return self._frame(v).tobytes()
        if code == _EXT_NDARRAY:
            dtype, shape, idx = v
            np = _np()
            return np.frombuffer(self._frame(idx), dtype=np.dtype(dtype)).reshape(shape)
        if code == _EXT_NPSCALAR:
            np = _np()
            return np.frombuffer(v[1], dtype=np.dtype(v[0]))[0]
        if code == _EXT_TENSOR:
            return _decode_tensor(v, self._frame(v[2]))
        if code == _EXT_REGISTERED:
            key, fields = v
            return _lookup(key)(**fields)
        if code == _EXT_ENUM:
            key, value = v
            return _lookup(key)(value)
        if code == _EXT_EXCEPTION:
            return _decode_exception(*v)
        if code == _EXT_CODEC:
            from_wire = _codecs_by_name.get(v[0])
            if from_wire is None:
                raise TypeError(f"no codec registered for {v[0]!r}")
            return from_wire(v[1])
        raise ValueError(f"unknown wire ext type {code}")


def _decode_tensor(v: list, buf: memoryview) -> Any:
    import torch

    dtype_name, shape, _ = v
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown tensor dtype {dtype_name!r}")
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    size = torch.empty((), dtype=dtype).element_size()
    view_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    with warnings.catch_warnings():
        # Received buffers are read-only views of the message (zero-copy): see docs/relay.md.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=view_dtype)
    return flat.view(dtype).reshape(shape)


def _decode_exception(key: str, message: str, args: list, tb: str) -> BaseException:
    module, _, qual = key.partition(":")
    cls: Any = None
    if module == "builtins":
        cls = getattr(builtins, qual, None)
    elif key in _registry:
        cls = _registry[key]
    exc: BaseException
    if isinstance(cls, type) and issubclass(cls, BaseException):
        try:
            exc = cls(*args)
        except Exception:
            exc = RemoteException(qual or key, message, tb)
    else:
        exc = RemoteException(qual or key, message, tb)
    exc.remote_traceback = tb  # type: ignore[attr-defined]
    return exc


def decode(data: bytes | memoryview, frames: list[Any]) -> Any:
    """Inverse of :func:`encode`; ``frames`` are the out-of-band buffers, in order."""
    return Decoder(frames).unpack(data)
