"""The per-sequence state of a hybrid model's linear-attention layers (engines/models/linear_attention.py),
beside the paged KV cache that its full-attention layers use.

A running request's state row is its block-table row (:class:`.block_manager.BlockManager`):
given when the request is admitted, returned when it finishes, is aborted or is preempted,
all rows returned after a failed step; the padding row is the scratch row that padding
rows of a batch write and read. A request's prefill writes its row from scratch, so a row
needs no clearing when it changes hands, and a preempted request, prefilled again from its
tokens when it is admitted again, gets its state recomputed. The tensors are allocated and
released with the KV cache (the ``kv_cache`` tag of sleep/wake).
"""

from __future__ import annotations

import torch

from engines.models.linear_attention import state_shapes


class StatePool:
    """``conv`` [layers, rows, C, K - 1] (the model dtype) and ``rec`` [layers, rows, Hv, Dk, Dv]
    (float32: the recurrence accumulates over the whole sequence) for ``rows`` rows."""

    def __init__(self, cfg, rows: int, device: torch.device, dtype: torch.dtype):
        self.layers = cfg.num_layers - cfg.kv_layers
        self.conv_shape, self.rec_shape = state_shapes(cfg)
        self.rows = rows
        self.device = device
        self.dtype = dtype
        self.conv: torch.Tensor | None = None
        self.rec: torch.Tensor | None = None

    def row_bytes(self) -> int:
        """Bytes of one request's state (every linear-attention layer)."""
        conv = torch.Size(self.conv_shape).numel() * torch.empty((), dtype=self.dtype).element_size()
        return self.layers * (conv + torch.Size(self.rec_shape).numel() * 4)

    def allocate(self) -> None:
        self.conv = torch.zeros((self.layers, self.rows, *self.conv_shape), dtype=self.dtype, device=self.device)
        self.rec = torch.zeros((self.layers, self.rows, *self.rec_shape), dtype=torch.float32, device=self.device)

    def release(self) -> None:
        self.conv = self.rec = None

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.rec

    def nbytes(self) -> int:
        return 0 if self.conv is None else self.rows * self.row_bytes()

    def copy_rows(self, src: list[int], dst: list[int]) -> None:
        """Rows ``dst`` take the state of rows ``src`` (requests whose tokens equal a prefilled one's)."""
        src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        self.conv[:, dst_t] = self.conv[:, src_t]
        self.rec[:, dst_t] = self.rec[:, src_t]
