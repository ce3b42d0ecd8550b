"""The trainer's side of weight sync: which transport serves each engine, and pushing one
weight version through it (the engine's side: ``TorchEngine.update_weights*``; the shared
layout and transports: :mod:`engines.weight_sync`).

Transports, per engine: ``ipc`` (CUDA IPC from the trainer rank on the engine's GPU; to
built-in engines the parameter buffer is shared in place, without staging copies),
``distributed`` (a broadcast group of trainer rank 0 and the engines, kept across pushes to
the same engines) and ``relay`` (CPU tensors as relay frames: CPU engines). ``auto`` picks
them in that order of preference. SGLang engines take the same three, through SGLang's own
routes (``/update_weights_from_tensor`` with the IPC handles, ``/init_weights_update_group``
+ ``/update_weights_from_distributed``, ``/update_weights_from_tensor`` by value): their
``weight_sync_info`` says how many group ranks each takes (one per TP rank), the flat
layout they expect (``align`` 1: SGLang's flattened bucket) and how the group is built
(``group_protocol`` "sglang").
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass

import torch

from engines.weight_sync import (
    ALIGN,
    BroadcastGroup,
    buckets,
    device_uuid,
    flatten,
    ipc_handle,
    layout,
    packed_views,
    release,
    share_in_place,
)

TRANSPORTS = ("auto", "ipc", "distributed", "relay")
ENGINES = ("torch", "sglang")  # backends whose engines take weights by CUDA IPC or a broadcast group
TEARDOWN_TIMEOUT = 30.0  # seconds to wait for an engine to leave a broadcast group


@dataclass(frozen=True)
class Route:
    """How one engine gets the weights: its transport, the trainer rank that sends them,
    and what the engine said about itself (``weight_sync_info``)."""

    engine: object  # an EngineActor mesh of one engine
    transport: str
    sender_rank: int
    info: dict


@dataclass
class _Group:
    """A broadcast group kept across pushes to the same engines."""

    engine_ids: tuple
    name: str
    group: BroadcastGroup
    engines: list


class WeightSender:
    """One trainer rank's sender. Every trainer rank calls :meth:`plan` and :meth:`push`
    (``plan`` gathers the ranks' GPUs); each rank sends to the engines routed to it."""

    def __init__(self, rank: int, device: torch.device):
        self.rank = rank
        self.device = device
        self._group: _Group | None = None
        self._uuids: list | None = None  # every trainer rank's GPU (device_uuid), by rank

    def plan(self, engines: list, transport: str, timeout: float) -> list[Route]:
        """Per engine, its :class:`Route`. ``auto``: CUDA IPC from the rank on the engine's
        GPU; a broadcast group from rank 0 when no trainer rank is on that GPU; the relay
        path on CPU and for engines that are not the built-in one. A collective over the
        trainer ranks."""
        import torch.distributed as dist

        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        if self._uuids is None:  # the ranks' GPUs do not change: gathered once
            self._uuids = [None] * dist.get_world_size()
            dist.all_gather_object(self._uuids, device_uuid(self.device))
        uuids = self._uuids
        routes = []
        asked = [engine.weight_sync_info.call() for engine in engines]  # all at once: one round trip
        for engine, future in zip(engines, asked):
            info = future.get(timeout).values()[0]
            colocated = next((r for r, u in enumerate(uuids) if u is not None and u == info["uuid"]), None)
            chosen = transport
            if chosen == "auto":
                if self.device.type != "cuda" or info["device_type"] != "cuda" or info["backend"] not in ENGINES:
                    chosen = "relay"
                else:
                    chosen = "ipc" if colocated is not None else "distributed"
            if chosen == "ipc" and colocated is None:
                raise ValueError(
                    f"weight sync by CUDA IPC needs the engine on a trainer GPU; engine GPU {info['uuid']} is not one "
                    f"of {uuids}"
                )
            routes.append(Route(engine, chosen, colocated if chosen == "ipc" else 0, info))
        return routes

    @staticmethod
    def in_place_only(routes: list[Route], rank: int) -> bool:
        """Does ``rank`` send only to built-in engines by CUDA IPC (so the weights it sends
        may be views that only the in-place path reads: :func:`engines.weight_sync.shaped`)?"""
        mine = [r for r in routes if r.sender_rank == rank]
        return all(r.transport == "ipc" and r.info.get("backend") == "torch" for r in mine)

    def push(self, routes: list[Route], named: dict, bucket_bytes: int, version: int, timeout: float) -> int:
        """Send ``named`` ({HF name: tensor}) as ``version`` to the engines routed to this
        rank, in buckets of about ``bucket_bytes`` where a transport packs them. Returns once
        every engine applied everything (no buffer is reused or freed before its receiver
        acknowledged it); the bytes this rank sent."""
        mine = [r for r in routes if r.sender_rank == self.rank]
        by_transport = {t: [r.engine for r in mine if r.transport == t] for t in ("ipc", "distributed", "relay")}
        sent = 0
        if by_transport["ipc"]:
            ipc = [r for r in mine if r.transport == "ipc"]
            cross_process = any(r.info.get("pid") != os.getpid() for r in ipc)
            if all(r.info.get("backend") == "torch" for r in ipc):  # built-in engines read views in place
                sent += self._push_in_place(by_transport["ipc"], named, bucket_bytes, version, timeout, cross_process)
            else:
                sent += self._push_ipc(by_transport["ipc"], buckets(named, bucket_bytes), version, timeout,
                                       cross_process)
        if by_transport["distributed"]:
            infos = [r.info for r in mine if r.transport == "distributed"]
            sent += self._push_broadcast(by_transport["distributed"], infos, buckets(named, bucket_bytes), version,
                                         timeout)
        if by_transport["relay"]:
            # copies: the relay may move what it sends into shared memory (never the params)
            cpu = [{n: t.detach().to("cpu", copy=True).contiguous() for n, t in bucket}
                   for bucket in buckets(named, bucket_bytes)]
            for f in [e.update_weights.call(cpu, version) for e in by_transport["relay"]]:
                f.get(timeout)
            sent += sum(t.numel() * t.element_size() for b in cpu for t in b.values()) * len(by_transport["relay"])
        return sent

    def close(self, timeout: float = TEARDOWN_TIMEOUT) -> None:
        """Tear down the kept broadcast group, if any (the engines leave it too)."""
        if self._group is None:
            return
        kept, self._group = self._group, None
        _leave(kept.engines, kept.name, timeout)
        kept.group.close()

    def _push_in_place(self, engines: list, named: dict, bucket_bytes: int, version: int, timeout: float,
                       cross_process: bool) -> int:
        """CUDA IPC without staging: the tensors inside large storages (the parameter buffer)
        are shared in place (:func:`engines.weight_sync.share_in_place`) and the first
        ``bucket_bytes`` of the rest packed into one buffer shared with them, all in one
        call per engine; what is left after that goes through :meth:`_push_ipc`'s buckets."""
        handles, metas, rest = share_in_place(sorted(named.items()), cross_process)
        chunks = buckets(dict(rest), bucket_bytes)
        staging = None
        if chunks:
            staging, packed = flatten(chunks.pop(0), self.device)
            metas += packed_views(staging, packed, len(handles))
            handles.append(ipc_handle(staging, cross_process))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the values are final before anyone reads them
        try:
            calls = [e.update_weights_from_ipc.call(handles, metas, version, not chunks) for e in engines]
            for f in calls:
                f.get(timeout)
        finally:
            for h in handles:
                release(h)
            staging = None
            if cross_process:
                torch.cuda.ipc_collect()
        sent = sum(torch.Size(m[1]).numel() * getattr(torch, m[4]).itemsize for m in metas) * len(engines)
        if chunks:
            sent += self._push_ipc(engines, chunks, version, timeout, cross_process)
        return sent

    def _push_ipc(self, engines: list, buckets: list, version: int, timeout: float, cross_process: bool) -> int:
        """CUDA IPC, double-buffered: bucket i+1 is packed into the other buffer while the
        engines copy bucket i; a buffer is repacked only after its bucket was acknowledged.
        An engine in this very process (colocated actors share the worker) reads the buffer
        directly (see :func:`engines.weight_sync.open_ipc`)."""
        buffers: list = [None, None]
        buffer = None
        pending: list = []
        previous = None
        sent = 0
        try:
            for i, bucket in enumerate(buckets):
                buffer, metas = flatten(bucket, self.device, out=buffers[i % 2])
                buffers[i % 2] = buffer
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()  # packed before anyone reads it
                handle = ipc_handle(buffer, cross_process)
                for f in pending:  # bucket i-1 acknowledged: its buffer may be reused next round
                    f.get(timeout)
                if previous is not None:
                    release(previous)
                last = i == len(buckets) - 1
                pending = [e.update_weights_from_ipc.call(handle, metas, version, last) for e in engines]
                previous = handle
                sent += buffer.numel() * len(engines)
            for f in pending:
                f.get(timeout)
        finally:
            if previous is not None:
                release(previous)
        buffers = buffer = None  # noqa: F841 (freed before collecting the IPC limbo)
        if cross_process:
            torch.cuda.ipc_collect()
        return sent

    def _push_broadcast(self, engines: list, infos: list, buckets: list, version: int, timeout: float) -> int:
        """A broadcast group of this rank (rank 0) and the engines (1..n; an engine of
        ``ranks`` TP ranks takes that many), one flat buffer per bucket. The group is made
        on the first push to these engines and kept for the next ones (its set-up is paid
        once); pushing to another set of engines, a failed push and :meth:`close` tear it
        down.

        Each bucket's call goes out before the bucket is packed (the engines post their side
        of the broadcast meanwhile). Built-in engines take their calls in order, so the next
        bucket goes out without waiting for the last one's acknowledgement (read after the
        next broadcast, by when the engines have applied it); an engine's failure ends the
        broadcast waiting on it at once. SGLang servers (HTTP requests, not ordered) get one
        bucket at a time. Two buffers, used in turn: one is repacked only after its
        broadcast completed."""
        engine_ids = tuple(info.get("engine_id") for info in infos)
        if self._group is not None and (self._group.engine_ids != engine_ids or None in engine_ids):
            self.close(timeout)
        if self._group is None:
            self._group = _Group(engine_ids, *_join(engines, infos, self.device, timeout), engines)
        name, group = self._group.name, self._group.group
        pipelined = all(info.get("backend") == "torch" for info in infos)  # built-in: calls taken in order
        align = min(int(info.get("align", ALIGN)) for info in infos)
        buffers: list = [None, None]
        pending: list = []  # the calls of the bucket before, when pipelined
        sent = 0
        try:
            for i, bucket in enumerate(buckets):
                metas, _ = layout(bucket, align)
                names, shapes, dtypes = [m[0] for m in metas], [m[1] for m in metas], [m[2] for m in metas]
                last = i == len(buckets) - 1
                receives = [
                    e.update_weights_from_distributed.call(names, dtypes, shapes, version, name, last) for e in engines
                ]
                buffer, _ = flatten(bucket, self.device, out=buffers[i % 2], align=align)
                buffers[i % 2] = buffer
                group.broadcast(buffer, watch=pending + receives)
                for f in pending if pipelined else pending + receives:
                    f.get(timeout)
                pending = receives if pipelined else []
                sent += buffer.numel() * len(engines)
            for f in pending:
                f.get(timeout)
        except BaseException:
            self.close(timeout)
            raise
        return sent


def _join(engines: list, infos: list, device: torch.device, timeout: float) -> tuple[str, BroadcastGroup]:
    """A new broadcast group of this process (rank 0) and ``engines`` (each taking
    ``info["ranks"]`` consecutive ranks); its name and group."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    name = f"weights-{uuid.uuid4().hex[:12]}"
    backend = "nccl" if device.type == "cuda" else "gloo"
    protocols = {info.get("group_protocol", "relay") for info in infos}
    if len(protocols) > 1:
        raise ValueError(f"weight sync: one broadcast group cannot serve engines of different kinds ({protocols})")
    offsets, size = [], 1
    for info in infos:
        offsets.append(size)
        size += int(info.get("ranks", 1))
    joins = [
        e.init_weights_update_group.call(address, port, offset, size, name, backend, timeout)
        for e, offset in zip(engines, offsets)
    ]
    group = None
    try:
        group = BroadcastGroup(address, port, 0, size, backend, timeout, name, protocol=protocols.pop())
        for f in joins:
            f.get(timeout)
    except BaseException:
        _leave(engines, name, timeout)
        if group is not None:
            group.close()
        raise
    return name, group


def _leave(engines: list, name: str, timeout: float) -> None:
    for f in [e.destroy_weights_update_group.call(name) for e in engines]:
        try:
            f.get(min(timeout, TEARDOWN_TIMEOUT))
        except Exception:  # noqa: BLE001 (the push's own error, if any, is the one to report)
            pass
