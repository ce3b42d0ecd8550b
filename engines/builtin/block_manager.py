"""Bookkeeping of the paged KV cache (no tensors of K/V here): which blocks are free, how
many requests hold each block (the full blocks of a shared prompt are held by several), and
each running request's row of the host block table that decode reads."""

from __future__ import annotations

import torch

from engines.builtin.sequence import Sequence


class BlockManager:
    """Blocks ``0 .. num_blocks - 1`` are handed out; block ``num_blocks`` (the scratch
    block) never is: padding rows of a batch write and read there. The host block table has
    one row per running request plus a padding row (``padding_row``), each filled with the
    scratch block beyond the request's blocks.

    Until :meth:`resize` (and after :meth:`release`) there are no free blocks."""

    def __init__(self, block_size: int, max_rows: int):
        self.block_size = block_size
        self.max_rows = max_rows  # rows for running requests
        self.padding_row = max_rows
        self.num_blocks = 0
        self.max_blocks_per_seq = 0
        self.allocated = False  # whether a KV cache of num_blocks exists
        self.free_blocks: list[int] = []  # a stack: the lowest block is handed out first
        self.refs: list[int] = []  # requests holding each block
        self.free_rows: list[int] = []
        self.host_tables = torch.empty((0, 0), dtype=torch.int32)
        self._tables = self.host_tables.numpy()  # its memory: an element written in ~0.1 us, not ~5

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold ``n_tokens`` tokens."""
        return -(-n_tokens // self.block_size)

    def resize(self, num_blocks: int, max_tokens: int) -> None:
        """A new KV cache of ``num_blocks`` blocks, for requests of at most ``max_tokens``
        tokens (the model's positions): every block and row free."""
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = self.blocks_for(min(max_tokens, num_blocks * self.block_size))
        self.host_tables = torch.full((self.max_rows + 1, self.max_blocks_per_seq), num_blocks, dtype=torch.int32)
        self._tables = self.host_tables.numpy()
        self.allocated = True
        self.reset()

    def reset(self) -> None:
        """Every block and row free again, whatever requests held (failure recovery: the
        caller drops its requests' blocks). Nothing to do while the cache is released."""
        if not self.allocated:
            return
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.refs = [0] * self.num_blocks
        self.host_tables.fill_(self.num_blocks)
        self.free_rows = list(range(self.max_rows - 1, -1, -1))

    def release(self) -> None:
        """The KV cache is gone (sleep): nothing can be handed out until :meth:`resize`."""
        self.allocated = False
        self.free_blocks = []

    def take(self) -> int:
        """A free block, now held by one request."""
        block = self.free_blocks.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> int:
        """``block``, now held by one more request."""
        self.refs[block] += 1
        return block

    def assign_row(self, seq: Sequence) -> None:
        """Give ``seq`` (holding its blocks) a row of the host block table."""
        seq.table_row = self.free_rows.pop()
        self._tables[seq.table_row, : len(seq.blocks)] = seq.blocks

    def append_block(self, seq: Sequence) -> None:
        """One more block for a running request (its next token starts a block)."""
        seq.blocks.append(self.take())
        self._tables[seq.table_row, len(seq.blocks) - 1] = seq.blocks[-1]

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks (a block is free once its last holder lets go)
        and return its row."""
        for block in seq.blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_blocks.append(block)
        seq.blocks = []
        if seq.table_row >= 0:
            self.free_rows.append(seq.table_row)
            seq.table_row = -1
