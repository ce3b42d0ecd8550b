"""How trainer weights reach the engines, the parts both sides share:

- **Flattened buckets**: HF-named tensors of mixed dtypes packed into one contiguous
  ``uint8`` buffer; ``metas`` = ``[(name, shape, dtype, offset), ...]`` (plain lists and
  strings, so they travel over relay) let the receiver view each tensor in place.
- **CUDA IPC** (trainer and engine on the same GPU): the sender shares the bucket buffer's
  storage (:func:`ipc_handle`, plain bytes/ints); the receiver opens it on its own device
  (:func:`open_ipc`), copies device to device and drops it; the sender frees the buffer
  only after the receiver acknowledged the bucket.
- **CUDA IPC in place** (built-in engines): tensors inside a large storage (a trainer's
  parameter buffer) are not packed at all: each storage is shared once and the receiver
  copies every tensor from its view of it (:func:`share_in_place`, :func:`open_views`);
  only the small rest goes through flat buckets.
- **Broadcast group** (different GPUs or hosts): a standalone process group of trainer
  rank 0 (rank 0) and the engines (ranks 1..n), built on its own TCPStore so it never
  touches either side's default group; every wait has a timeout, so neither side can hang.

The relay path (CPU tensors sent as relay frames) needs nothing here.
"""

from __future__ import annotations

import datetime

import torch

ALIGN = 256  # bytes: every tensor starts aligned in the flat buffer (any dtype view is legal)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight-sync metadata")
    return dt


def shaped(view: torch.Tensor, shape) -> torch.Tensor:
    """Mark ``view`` as the tensor of HF shape ``shape`` that it cannot be as a view (q, k or v
    split out of a fused weight, in its per-group layout): the in-place path sends the view
    and the receiver reshapes it; packing it (:func:`flatten`) writes the bytes of
    ``view.contiguous()``, which are those of the HF tensor, under ``shape``."""
    view.hf_shape = tuple(int(x) for x in shape)
    return view


def hf_shape(t: torch.Tensor) -> tuple:
    """The shape ``t`` stands for: its own, or the one :func:`shaped` gave it."""
    return getattr(t, "hf_shape", tuple(t.shape))


def layout(named: list, align: int = ALIGN) -> tuple[list, int]:
    """``[(name, tensor)]`` -> (metas, total bytes) of the flat buffer. ``align`` 1 packs
    the tensors back to back: SGLang's ``FlattenedTensorBucket`` layout."""
    metas, off = [], 0
    for name, t in named:
        metas.append([name, list(hf_shape(t)), str(t.dtype).removeprefix("torch."), off])
        off += -(-t.numel() * t.element_size() // align) * align
    return metas, off


def flatten(named: list, device, out: torch.Tensor | None = None, align: int = ALIGN) -> tuple[torch.Tensor, list]:
    """Pack ``[(name, tensor)]`` into one ``uint8`` buffer on ``device`` (``out`` reused when
    large enough); returns (buffer, metas)."""
    metas, total = layout(named, align)
    buf = (
        out[:total]
        if out is not None and out.numel() >= total
        else torch.empty(total, dtype=torch.uint8, device=device)
    )
    for (_, t), (_, _, _, off) in zip(named, metas):
        n = t.numel() * t.element_size()
        buf[off : off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
    return buf, metas


def unflatten(buf: torch.Tensor, metas: list) -> list:
    """Views of each tensor inside ``buf`` (no copy): ``[(name, tensor)]``."""
    out = []
    for name, shape, dtype, off in metas:
        dt = _dtype(dtype)
        n = dt.itemsize
        for s in shape:
            n *= s
        out.append((name, buf[off : off + n].view(dt).view(shape)))
    return out


def metas_for(names: list, dtypes: list, shapes: list) -> tuple[list, int]:
    """The flat layout of a bucket announced as names/dtypes/shapes (SGLang's
    ``update_weights_from_distributed`` shape): (metas, total bytes), as :func:`layout`."""
    return layout([(n, torch.empty(s, dtype=_dtype(d), device="meta")) for n, d, s in zip(names, dtypes, shapes)])


def buckets(named: dict, bucket_bytes: int) -> list[list]:
    """Split ``{name: tensor}`` (sorted by name) into lists of about ``bucket_bytes``."""
    out, cur, size = [], [], 0
    for name in sorted(named):
        t = named[name]
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        out.append(cur)
    return out


# ---------------------------------------------------------------- CUDA IPC


def device_uuid(device) -> str | None:
    """The physical GPU's UUID (same across processes whatever CUDA_VISIBLE_DEVICES says);
    ``None`` on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return str(
        torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device()).uuid
    )


#: Buffers shared with receivers in this same process (a colocated trainer and engine are
#: actors of one worker process; CUDA cannot open an IPC handle in the process that made
#: it). Token -> buffer, from :func:`ipc_handle` until :func:`release`.
_LOCAL: dict[str, torch.Tensor] = {}


def ipc_handle(buf: torch.Tensor, cross_process: bool = True) -> dict:
    """What the receiver needs to map ``buf``'s storage (bytes, ints and strings only).
    The caller keeps ``buf`` alive until the receiver acknowledged, then calls :func:`release`.
    ``cross_process=False`` (every receiver is in this process) skips the CUDA export."""
    import os
    import uuid

    token = uuid.uuid4().hex
    _LOCAL[token] = buf
    h = {"nbytes": buf.numel(), "pid": os.getpid(), "token": token}
    if cross_process:
        dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = buf.untyped_storage()._share_cuda_()
        h.update(
            handle=handle,
            size=size,
            offset=offset,
            ref_counter_handle=rc_handle,
            ref_counter_offset=rc_offset,
            event_handle=ev_handle,
            event_sync_required=bool(ev_sync),
        )
    return h


#: A CUDA storage at least this large (a trainer's parameter buffer, a big embedding) is
#: shared in place by :func:`share_in_place`; smaller tensors are packed into buckets.
SHARE_MIN_BYTES = 64 << 20


def share_in_place(named: list, cross_process: bool = True, min_bytes: int | None = None) -> tuple:
    """CUDA IPC without staging copies. Of ``[(name, tensor)]``, the tensors that live in a
    CUDA storage (any storage when every receiver is in this process) of at least
    ``min_bytes`` (default :data:`SHARE_MIN_BYTES`) are described as views of it, each storage shared
    once: returns ``(handles, metas, rest)``, ``handles`` one :func:`ipc_handle` per storage,
    ``metas`` ``[name, shape, stride, offset, dtype, storage index, HF shape]`` (``offset``
    and ``stride`` in elements of ``dtype``; the view is reshaped to the HF shape, see
    :func:`shaped`) and ``rest`` the other ``(name, tensor)`` pairs. The caller keeps the
    tensors unchanged until every receiver acknowledged, then releases the handles
    (:func:`release`); :func:`open_views` is the receiver's side."""
    min_bytes = SHARE_MIN_BYTES if min_bytes is None else min_bytes
    handles: list = []
    metas: list = []
    rest: list = []
    index: dict = {}
    for name, given in named:
        shape = list(hf_shape(given))
        t = given.detach()  # (a new tensor object: without ``hf_shape``)
        st = t.untyped_storage()
        if (cross_process and not t.is_cuda) or st.nbytes() < min_bytes:
            rest.append((name, given))
            continue
        key = st.data_ptr()
        if key not in index:
            index[key] = len(handles)
            handles.append(ipc_handle(torch.empty(0, dtype=torch.uint8, device=t.device).set_(st), cross_process))
        metas.append([name, list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype).removeprefix("torch."),
                      index[key], shape])
    return handles, metas, rest


def packed_views(buf: torch.Tensor, packed: list, index: int) -> list:
    """:func:`flatten`'s metas of ``buf`` as :func:`share_in_place` metas of shared storage
    ``index`` (a packed bucket sent along with the storages shared in place)."""
    out = []
    for name, shape, dtype, off in packed:
        stride = torch.empty(shape, device="meta").stride()
        out.append([name, list(shape), list(stride), off // _dtype(dtype).itemsize, dtype, index, list(shape)])
    return out


def open_views(handles: list, metas: list, device) -> list:
    """The receiver's side of :func:`share_in_place`: ``[(name, view)]`` reading the
    sender's storages, each mapped once (bounds checked against its storage). The mappings
    close when the views are freed."""
    storages = [open_ipc(h, device).untyped_storage() for h in handles]
    out = []
    for name, shape, stride, offset, dtype, i, target in metas:
        if not 0 <= int(i) < len(storages):
            raise ValueError(f"weight sync: {name} names shared storage {i} of {len(storages)}")
        st, dt = storages[int(i)], _dtype(dtype)
        shape, stride, offset = [int(x) for x in shape], [int(x) for x in stride], int(offset)
        end = offset + sum((n - 1) * d for n, d in zip(shape, stride)) + 1 if all(shape) else offset
        if len(shape) != len(stride) or min([offset, *shape, *stride]) < 0 or end * dt.itemsize > st.nbytes():
            raise ValueError(f"weight sync: {name} (shape {shape}, stride {stride}, offset {offset}, {dtype}) does "
                             f"not lie within its shared storage of {st.nbytes()} bytes")
        view = torch.empty(0, dtype=dt, device=st.device).set_(st, offset, shape, stride)
        target = [int(x) for x in target]
        if target != shape:
            if torch.Size(target).numel() != view.numel():
                raise ValueError(f"weight sync: {name} of shape {shape} cannot become shape {target}")
            # not expressible as a view of that shape: marked, and copied into a view of
            # the destination (engines/models/weight_names.py place_weight), not reshaped here
            view = view.view(target) if view.is_contiguous() else shaped(view, target)
        out.append((name, view))
    return out


def release(h: dict) -> None:
    """The sender is done with a shared buffer (every receiver acknowledged)."""
    _LOCAL.pop(h["token"], None)


def open_ipc(h: dict, device) -> torch.Tensor:
    """Map a peer's buffer on ``device`` (the same physical GPU: the sender's device index
    may differ in this process). The mapping closes when the returned tensor is freed.
    In the sender's own process this is the buffer itself."""
    import os

    if h.get("pid") == os.getpid():
        buf = _LOCAL.get(h["token"])
        if buf is None:
            raise RuntimeError("weight sync: the shared bucket was released before the receiver opened it")
        return buf[: h["nbytes"]]
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        h["handle"],
        h["size"],
        h["offset"],
        h["ref_counter_handle"],
        h["ref_counter_offset"],
        h["event_handle"],
        h["event_sync_required"],
    )
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    t.set_(storage, 0, (h["nbytes"],), (1,))
    return t


# ---------------------------------------------------------------- broadcast group


class BroadcastGroup:
    """A standalone process group (rank 0 = the trainer's sender, 1..n = engines) over its
    own TCPStore: independent of any default group in either process. ``timeout`` bounds
    the rendezvous and (unless ``op_timeout_s`` is given) every collective: a missing peer
    is an error, not a hang.

    ``protocol="sglang"`` (rank 0 only): the group an SGLang server joins with
    ``/init_weights_update_group``, built as SGLang builds its side
    (``init_custom_process_group``: ``PrefixStore(name)`` over the TCP store, then torch's
    ``_new_process_group_helper``, which nests its own prefixes); a group made any other way
    never meets it (tokenspeed#1373). The peers announce nothing beforehand, so the
    rendezvous is the backend's own (bounded by ``timeout``)."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        name: str,
        op_timeout_s: float | None = None,
        protocol: str = "relay",
    ):
        import torch.distributed as dist

        self.name, self.rank, self.world_size = name, rank, world_size
        self._in_flight = False  # a broadcast was started and not seen complete
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.protocol = protocol
        op_timeout = datetime.timedelta(seconds=op_timeout_s or timeout_s)
        try:
            store = dist.TCPStore(
                master_address, master_port, world_size, rank == 0, timeout=self.timeout, wait_for_workers=False
            )
        except Exception as e:  # noqa: BLE001 (re-raised with context)
            raise TimeoutError(
                f"weight-sync group {name!r}: rank {rank} could not reach the store at {master_address}:{master_port} "
                f"within {timeout_s}s: {e}"
            ) from e
        store = dist.PrefixStore(name, store)
        self._store = store
        if protocol == "sglang":
            self.backend = backend
            self.pg = _sglang_compatible_group(store, rank, world_size, backend, self.timeout, name)
            return
        # Everyone present before any backend connects (NCCL's communicator set-up has no
        # timeout of its own): a peer that never comes is a TimeoutError here.
        store.set(f"joined/{rank}", "1")
        try:
            store.wait([f"joined/{r}" for r in range(world_size)], self.timeout)
        except Exception as e:  # noqa: BLE001 (DistStoreError / RuntimeError, re-raised with context)
            raise TimeoutError(
                f"weight-sync group {name!r}: rank {rank} of {world_size} did not meet its peers within {timeout_s}s: "
                f"{e}"
            ) from e
        try:
            if backend == "gloo":
                self.pg = dist.ProcessGroupGloo(store, rank, world_size, op_timeout)
            elif backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = op_timeout
                self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            else:
                raise ValueError(f"weight-sync backend must be 'nccl' or 'gloo', not {backend!r}")
        except (RuntimeError, dist.DistBackendError) as e:
            raise TimeoutError(
                f"weight-sync group {name!r}: rank {rank} of {world_size} did not meet its peers within {timeout_s}s: "
                f"{e}"
            ) from e
        self.backend = backend
        self.timeout = op_timeout  # from now on: what a collective may take

    def broadcast(self, buf: torch.Tensor, watch: list = ()) -> None:
        """Rank 0 sends ``buf``; the others receive into theirs (same size). Polls the work
        against the timeout (an NCCL wait alone would not return), then raises
        ``TimeoutError`` and shuts the group down. ``watch``: futures (the receivers' calls)
        whose failure ends the wait at once, raised, the group shut down (a receiver that
        failed will not take part)."""
        import time

        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self.pg.broadcast([buf], opts)
        self._in_flight = True
        deadline = time.monotonic() + self.timeout.total_seconds()
        watching = list(watch)
        while not work.is_completed():
            for f in [f for f in watching if f.done()]:  # each read once: a failure raises here
                watching.remove(f)
                try:
                    f.get(0)
                except BaseException:
                    self.close()
                    raise
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(
                    f"weight-sync group {self.name!r}: broadcast of {buf.numel()} bytes did not finish within "
                    f"{self.timeout.total_seconds()}s (rank {self.rank})"
                )
            time.sleep(0.0005)
        self._in_flight = False
        work.wait()  # raises the backend's error, if any
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if self.protocol == "sglang" and pg is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 (best effort: the peers may be gone)
                pass
            return
        if pg is None:
            return
        if self.backend == "nccl":
            _shut_down(pg, ("abort", "shutdown"))
        elif self._in_flight:  # gloo's shutdown (and its destructor) would wait that operation's timeout out
            _ABANDONED.append(pg)  # holding the GIL: kept instead, the operation fails on its own
        else:
            _shut_down(pg, ("shutdown",))


#: gloo groups closed while an operation was in flight (see ``BroadcastGroup.close``).
_ABANDONED: list = []


def _shut_down(pg, ways: tuple) -> None:
    """The first of ``ways`` (methods of process group ``pg``) that works."""
    for how in ways:
        if hasattr(pg, how):
            try:
                getattr(pg, how)()
                return
            except Exception:  # noqa: BLE001 (best effort: the peers may be gone)
                pass


def _sglang_compatible_group(store, rank: int, world_size: int, backend: str, timeout, name: str):
    """What SGLang's ``init_custom_process_group`` makes of ``store`` (its
    ``PrefixStore(group_name)``) on the other side."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    try:
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=name,
                                          backend_options=None, timeout=timeout)
    except (RuntimeError, ValueError) as e:
        raise TimeoutError(f"weight-sync group {name!r}: rank {rank} of {world_size} did not meet the SGLang "
                           f"server(s) within {timeout.total_seconds()}s: {e}") from e
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
