"""KV caches handed from a sleeping engine to the next one that wakes in the same process.

Allocating device memory right after it was freed waits for the CUDA driver to clear it
(~2.6 ms/GB on an H200: ~0.26 s for a 100 GB cache; docs/PERFORMANCE.md). In the launcher's
colocated layouts the engines and the trainer of a GPU share one worker process, and in
Defer-swap the rollout's KV cache is freed the moment before the judge's is allocated. So a
colocated engine (``TorchEngine(lend_kv=True)``) does not free its cache's tensors on sleep:
it *lends* them here, whole, and an engine that wakes on that device takes a lent tensor
large enough for each of its own K and V (a view of the same memory) before asking the
driver. Whatever is still lent when the trainer needs the memory is the trainer's: its onload
empties the pool with :func:`drain` (the memory stays in the allocator's cache for its state
and activations), and it calls :func:`release` before it reports free memory.

Thread-safe (engines run on their own threads). Lent memory is counted as free by the KV
sizing (:func:`lent_bytes`)."""

from __future__ import annotations

import threading

import torch

_LOCK = threading.Lock()
_LENT: dict[torch.device, list[torch.Tensor]] = {}


def _key(device) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def lend(device: torch.device, tensors: list[torch.Tensor]) -> None:
    """Keep ``tensors``' memory for the next engine that wakes on ``device``."""
    with _LOCK:
        _LENT.setdefault(_key(device), []).extend(t for t in tensors if t is not None)


def take(device: torch.device, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor of ``shape`` and ``dtype`` in the smallest lent memory that holds it (no longer
    lent), or None."""
    need = torch.Size(shape).numel() * dtype.itemsize
    with _LOCK:
        lent = _LENT.get(_key(device), [])
        fits = [i for i, t in enumerate(lent) if t.untyped_storage().nbytes() >= need]
        if not fits:
            return None
        best = lent.pop(min(fits, key=lambda i: lent[i].untyped_storage().nbytes()))
    return torch.empty(0, dtype=dtype, device=best.device).set_(best.untyped_storage(), 0, shape)


def lent_bytes(device: torch.device) -> int:
    with _LOCK:
        return sum(t.untyped_storage().nbytes() for t in _LENT.get(_key(device), []))


def drain(device: torch.device | None = None) -> int:
    """Free what is lent (on ``device``, or everywhere); returns the bytes freed. The caller
    empties the allocator's cache if the driver should get them back."""
    with _LOCK:
        devices = list(_LENT) if device is None else [_key(device)]
        freed = 0
        for d in devices:
            freed += sum(t.untyped_storage().nbytes() for t in _LENT.pop(d, []))
    return freed


def release(device: torch.device) -> None:
    """:func:`drain` ``device`` and give the memory back to the driver (a CUDA device): the
    trainer of the worker needs it."""
    if torch.device(device).type == "cuda" and drain(device):
        torch.cuda.empty_cache()
