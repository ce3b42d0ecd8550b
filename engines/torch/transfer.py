"""Host data onto the engine's device without waiting for the device."""

from __future__ import annotations

import torch


def to_device(data: list | torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (a list or a host tensor) as a tensor on ``device``. On CUDA through pinned
    memory and an asynchronous copy: a copy from pageable memory waits for the work already
    queued on the stream, which would stall a decode step launched ahead."""
    if device.type != "cuda":
        return torch.as_tensor(data, dtype=dtype, device=device)
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    return host.pin_memory().to(device, dtype=dtype, non_blocking=True)
