"""Weight payloads for SGLang's ``/update_weights_from_tensor``: what its
``MultiprocessingSerializer.deserialize`` (a pickle restricted to torch and a few other
modules) rebuilds in every TP rank into ``[(name, tensor)]`` for ``load_format=None``.

- :func:`by_value`: CPU tensors pickled by value (the relay path; CPU test runs).
- :func:`by_ipc_handle`: views of a trainer's flat bucket (``engines.weight_sync``) shared by
  CUDA IPC, rebuilt with ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` from the
  handle the trainer exported; the device is the GPU's UUID (SGLang patches the rebuild to
  map a UUID to its own device index: ``sglang/srt/utils/patch_torch.py``), so it does not
  matter which GPUs each process sees. Nothing is mapped in this process.
"""

from __future__ import annotations

import base64
import pickle


def by_value(items: list) -> str:
    """``[(name, cpu tensor)]`` -> a base64 payload (tensors by value)."""
    return base64.b64encode(pickle.dumps([(n, t.detach().to("cpu").contiguous()) for n, t in items])).decode()


class _SharedView:
    """Pickles as SGLang's sender does (``reduce_tensor`` + its UUID patch): a tensor of the
    trainer's shared buffer, ``shape``/``dtype`` at byte offset ``offset``."""

    def __init__(self, handle: dict, uuid: str, shape: list, dtype: str, offset: int):
        self.handle, self.uuid, self.shape, self.dtype, self.offset = handle, uuid, shape, dtype, offset

    def __reduce__(self):
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        dt = getattr(torch, self.dtype)
        if self.offset % dt.itemsize:
            raise ValueError(f"weight sync: offset {self.offset} of a {self.dtype} tensor is not aligned")
        stride, n = [], 1
        for s in reversed(self.shape):
            stride.insert(0, n)
            n *= s
        h = self.handle
        return rebuild_cuda_tensor, (
            torch.Tensor,
            torch.Size(self.shape),
            tuple(stride),
            self.offset // dt.itemsize,
            torch.UntypedStorage,
            dt,
            self.uuid,
            h["handle"],
            h["size"],
            h["offset"],
            False,
            h["ref_counter_handle"],
            h["ref_counter_offset"],
            h["event_handle"],
            h["event_sync_required"],
        )


def by_ipc_handle(handle: dict, metas: list, uuid: str) -> str:
    """A flat bucket shared by ``engines.weight_sync.ipc_handle`` (with ``metas`` =
    ``[(name, shape, dtype, byte offset)]``) on the GPU ``uuid`` -> a base64 payload whose
    tensors SGLang maps by CUDA IPC and copies device to device."""
    if "handle" not in handle:
        raise ValueError("weight sync: the bucket was not exported for another process (cross_process=False)")
    items = [(name, _SharedView(handle, uuid, list(shape), dtype, off)) for name, shape, dtype, off in metas]
    return base64.b64encode(pickle.dumps(items)).decode()
