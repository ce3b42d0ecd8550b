"""The model on its device: the weights (:class:`.weights.Weights`), the paged KV cache's
tensors (sized by ``kv_cache_tokens`` or ``mem_fraction_static``, released and allocated
again by sleep/wake; a hybrid model's linear-attention state pool with them:
:class:`.state_pool.StatePool`), the prefill and decode forwards of a
:class:`.scheduler.StepPlan`, and the decode step's CUDA graphs. Runs on the engine thread."""

from __future__ import annotations

import time

import numpy as np
import torch

from engines import kv_pool
from engines.builtin.block_manager import BlockManager
from engines.builtin.sampler import greedy_pairs
from engines.builtin.scheduler import StepPlan
from engines.builtin.sequence import Sequence
from engines.builtin.state_pool import StatePool
from engines.builtin.transfer import host_tensor, to_device
from engines.builtin.weights import Weights
from engines.interface import SamplingParams
from engines.models.fused_decode import pack_projections
from engines.models.hybrid_model import build_causal_lm
from engines.models.model import ModelConfig, _inv_freq
from engines.models.weight_names import load_weights


class ModelRunner:
    """With ``tp`` (engines/builtin/tp.py), this rank's shard; rank 0 sends each operation on
    the model or the cache to the followers (:meth:`_mirror`) before it runs it, and a
    follower's runner is driven by those operations (its cache sized by rank 0)."""

    def __init__(self, model_path: str, blocks: BlockManager, *, device: torch.device, dtype: torch.dtype,
                 weights_mode: str, name: str, kv_cache_tokens: int | None, mem_fraction_static: float,
                 cuda_graph: bool, tp=None, ep_size: int = 1, lend_kv: bool = False):
        self.blocks = blocks
        # sleep lends the KV tensors to the next engine of this process (engines/kv_pool.py);
        # not over several GPUs (the followers take rank 0's size, which must not change)
        self.lend_kv = lend_kv and tp is None and device.type == "cuda"
        self.device = device
        self.dtype = dtype
        self.max_running = blocks.max_rows
        self.kv_cache_tokens = kv_cache_tokens
        self.mem_fraction_static = mem_fraction_static
        self.use_cuda_graph = cuda_graph and device.type == "cuda"
        self.tp = tp
        self.cfg = ModelConfig.from_dir(model_path)
        if tp is not None or ep_size != 1:  # ep_size > 1 on one GPU is refused there, naming it
            self.cfg = self.cfg.shard_for(1 if tp is None else tp.size, 0 if tp is None else tp.rank, ep_size)
        # hybrid models: one state row per running request (its block-table row) and the padding row
        self.state = StatePool(self.cfg, blocks.max_rows + 1, device, dtype) if self.cfg.hybrid else None
        with torch.device("meta"):
            model = build_causal_lm(self.cfg)
        model = model.to_empty(device=device).to(dtype)
        model.inv_freq = _inv_freq(self.cfg).to(device)  # buffers are not in the checkpoint
        if self.cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        pack_projections(model, keep_values=False)  # one GEMM for q/k/v and one for gate/up (fused_decode.py)
        load_weights(model, model_path)
        model.eval()
        model.tp = tp
        self.model = model
        self.prefill_tokens = 0  # prompt tokens actually run through prefill
        # decode CUDA graphs captured (every sleep and wake drops them) and the seconds that took
        self.graph_captures = 0
        self.graph_capture_s = 0.0
        self.graphs: DecodeGraphs | None = None
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.weights = Weights(model, self.cfg, device, weights_mode, name, mirror=self._mirror)
        self.kv_blocks = 0  # the KV cache's size the last time it was allocated
        if self.leads:  # a follower's cache comes with rank 0's first allocate_kv
            self.allocate_kv()

    @property
    def leads(self) -> bool:
        """Rank 0 of a tensor-parallel engine, or an engine of one GPU."""
        return self.tp is None or self.tp.rank == 0

    def _mirror(self, op: str, *args) -> None:
        """Rank 0 of a tensor-parallel engine: the followers run ``op(*args)`` next."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send(op, *args)

    def stop_followers(self) -> None:
        self._mirror("stop")

    # ------------------------------------------------------------------ memory

    def kv_block_bytes(self) -> int:
        c = self.cfg
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.kv_layers * self.blocks.block_size * c.local_kv_heads * c.head_dim * itemsize

    def _kv_capacity(self) -> int:
        """Blocks of the KV cache to allocate now."""
        if self.kv_cache_tokens is not None:
            return max(1, self.kv_cache_tokens // self.blocks.block_size)
        if self.device.type != "cuda":
            return 4096 // self.blocks.block_size  # a configured capacity is expected on CPU
        # As in SGLang: this engine's weights + KV cache take mem_fraction_static of the
        # GPU (other tenants of the GPU, even in this process, are not counted here).
        free, total = torch.cuda.mem_get_info(self.device)
        free += kv_pool.lent_bytes(self.device) if self.lend_kv else 0  # ours to take (allocate_kv)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        state = 0 if self.state is None else self.state.rows * self.state.row_bytes()
        budget = min(total * self.mem_fraction_static - weights, free * 0.95) - state
        blocks = int(max(budget, 0) // self.kv_block_bytes())
        if blocks < 1:
            raise MemoryError(
                f"mem_fraction_static {self.mem_fraction_static} of {total / 2**30:.0f} GiB leaves no room for the "
                f"KV cache after {weights / 2**30:.1f} GiB of weights (free now: {free / 2**30:.1f} GiB)"
            )
        return blocks

    def allocate_kv(self, blocks: int | None = None) -> None:
        """The KV cache of ``blocks`` blocks (default: what ``kv_cache_tokens`` or
        ``mem_fraction_static`` gives; a tensor-parallel engine's followers take rank 0's)."""
        sized = blocks is None
        blocks = blocks or self._kv_capacity()
        self.kv_blocks = blocks  # what the next wake allocates again (wake_bytes)
        self._mirror("allocate_kv", blocks)
        try:
            self.k, self.v = self._kv_tensors(blocks)
        except torch.OutOfMemoryError:
            if not (self.lend_kv and kv_pool.drain(self.device)):
                raise
            self.k = self.v = None  # the lent memory did not fit: freed, and sized again without it
            torch.cuda.empty_cache()
            self.kv_blocks = blocks = self._kv_capacity() if sized else blocks
            self.k, self.v = self._kv_tensors(blocks)
        if self.state is not None:
            self.state.allocate()
        self.blocks.resize(blocks, self.cfg.max_position_embeddings)
        self.graphs = None
        self.picked: torch.Tensor | None = None  # the last decode's greedy picks (see decode)

    def _kv_tensors(self, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` blocks and one more, never handed out: the scratch block padding
        rows write and read. Not zeroed (a wake's cost on a large cache): a slot is written
        before it is read (a prompt's by its prefill, a token's in its decode step); padding
        rows read garbage into rows nobody reads. In memory another engine lent, if any."""
        c = self.cfg
        shape = (c.kv_layers, blocks + 1, self.blocks.block_size, c.local_kv_heads, c.head_dim)
        out = []
        try:
            for _ in range(2):
                lent = kv_pool.take(self.device, shape, self.dtype) if self.lend_kv else None
                out.append(lent if lent is not None else torch.empty(shape, dtype=self.dtype, device=self.device))
                lent = None
        except torch.OutOfMemoryError:
            out.clear()  # nothing of it kept alive by the traceback: the caller frees and retries
            lent = None
            raise
        return out[0], out[1]

    def wake_bytes(self) -> int:
        """Device memory a wake of the weights and the KV cache allocates, the cache as large
        as the last time (0 before any allocation). A cache sized by ``mem_fraction_static``
        is that large again only if the free memory it finds is at least 1/0.95 of it."""
        if not self.kv_blocks:
            return 0
        kv = (self.kv_blocks + 1) * self.kv_block_bytes()
        state = 0 if self.state is None else self.state.rows * self.state.row_bytes()
        return self.weights.full_nbytes() + kv + state

    def drop_graphs(self) -> None:
        """Forget captured decode graphs (they point at the weights' and the cache's memory:
        any reallocation invalidates them; they are captured again on use)."""
        self._mirror("drop_graphs")
        self.graphs = None

    def sleep(self, tags) -> None:
        """Release the memory of ``tags`` (the graphs always). Idempotent."""
        self._mirror("sleep", tags)
        self.graphs = None  # "cuda_graph", and any release below, invalidates them
        if "kv_cache" in tags and self.k is not None:
            if self.lend_kv:  # whole, for the next engine of this process to wake (kv_pool.py)
                kv_pool.lend(self.device, [self.k, self.v])
            self.k = self.v = None
            if self.state is not None:
                self.state.release()
            self.blocks.release()
        if "weights" in tags:
            self.weights.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self, tags) -> None:
        """Allocate the memory of ``tags`` again. Idempotent."""
        if "weights" in tags:
            self._mirror("wake_weights")
            self.wake_weights()
        else:
            self.drop_graphs()
        if "kv_cache" in tags and self.k is None:
            self.allocate_kv()  # sizes the cache, and the followers' with it

    def wake_weights(self) -> None:
        self.graphs = None
        self.weights.restore()

    def memory_bytes(self) -> dict:
        kv = 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()
        kv += 0 if self.state is None else self.state.nbytes()
        graphs = 0 if self.graphs is None else self.graphs.bytes
        return {"weights": self.weights.nbytes(), "kv_cache": kv, "cuda_graph": graphs,
                "cpu_backup": self.weights.backup_nbytes()}

    # ------------------------------------------------------------------ forwards

    def run(self, plan: StepPlan, greedy: bool = False) -> torch.Tensor:
        """Logits of the next token of each request of ``plan.batch``, in its order
        (``greedy``: see :meth:`decode`)."""
        self.picked = None
        parts = []
        if plan.decode:
            parts.append(self.decode(plan.decode, greedy=greedy and not plan.admitted))
        if plan.admitted:
            parts.append(self.prefill(plan.prefill, plan.admitted, plan.followers))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def prefill(self, seqs: list[Sequence], admitted: list[Sequence], followers: dict[int, int]) -> torch.Tensor:
        """Logits of the next token of each ``admitted`` request: ``seqs`` (none of whose
        tokens are cached yet) run through the model; a follower takes its leader's row and
        a copy of the leader's partial last block (a hybrid model's: and of its
        linear-attention state, which equal tokens make equal)."""
        logits = self.prefill_rows(seqs)
        if not followers:
            return logits
        copies = [(seqs[followers[s.request_id]].blocks[-1], s.blocks[-1]) for s in admitted
                  if s.request_id in followers and s.n_tokens % self.blocks.block_size]
        if copies:
            self.copy_blocks([c[0] for c in copies], [c[1] for c in copies])
        if self.state is not None:
            pairs = [(seqs[followers[s.request_id]].table_row, s.table_row) for s in admitted
                     if s.request_id in followers]
            self.copy_state_rows([c[0] for c in pairs], [c[1] for c in pairs])
        index = {id(s): i for i, s in enumerate(seqs)}
        rows = [followers[s.request_id] if s.request_id in followers else index[id(s)] for s in admitted]
        return logits[torch.tensor(rows, device=logits.device)]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy KV blocks ``src`` into ``dst`` (every layer)."""
        self._mirror("copy_blocks", src, dst)
        src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        self.k[:, dst_t] = self.k[:, src_t]
        self.v[:, dst_t] = self.v[:, src_t]

    def copy_state_rows(self, src: list[int], dst: list[int]) -> None:
        """A hybrid model's state rows ``dst`` take the state of rows ``src``."""
        self._mirror("copy_state_rows", src, dst)
        self.state.copy_rows(src, dst)

    def prefill_rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """Every token of ``seqs`` through the model, right-padded to the longest, writing
        their K/V into their blocks; the logits of each one's next token."""
        bs = self.blocks.block_size
        self.prefill_tokens += sum(s.n_tokens for s in seqs)
        # through numpy (a row's list into an array row: ~100x faster than torch.tensor per row)
        lens = np.fromiter((len(s.tokens) for s in seqs), np.int64, len(seqs))
        longest = int(lens.max())
        ids = np.zeros((len(seqs), longest), np.int64)
        table = np.full((len(seqs), -(-longest // bs)), self.blocks.scratch_block, np.int64)
        for r, seq in enumerate(seqs):
            ids[r, : lens[r]] = seq.tokens
            held = seq.blocks[: table.shape[1]]
            if len(held) * bs < lens[r]:
                raise RuntimeError(f"request {seq.request_id}: {len(held)} KV blocks for {lens[r]} tokens")
            table[r, : len(held)] = held
        at = np.arange(longest)
        slots = table[:, at // bs] * bs + at % bs
        slots[at[None, :] >= lens[:, None]] = self.blocks.scratch_block * bs  # padding: the scratch slot
        rows = None if self.state is None else torch.tensor([s.table_row for s in seqs])  # a hybrid's state rows
        return self.prefill_tensors(torch.from_numpy(ids), torch.from_numpy(lens), torch.from_numpy(slots), rows)

    def prefill_tensors(self, ids: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`prefill_rows` once its inputs are tensors (what followers run); ``rows``: a
        hybrid model's state row of each sequence."""
        self._mirror("prefill_tensors", ids, lens, slots, rows)
        dev = self.device
        state = () if rows is None else (self.state.tensors, rows.to(dev))
        return self.model.prefill(ids.to(dev), lens.to(dev), slots.to(dev), self.k, self.v, *state)

    def decode(self, seqs: list[Sequence], ids: torch.Tensor | None = None, greedy: bool = False) -> torch.Tensor:
        """Logits of the next token of running requests (each feeds its last token); on
        CUDA through a captured graph of the padded batch size. ``ids`` [len(seqs)]: the
        tokens to feed instead, on the device: sampled by the step before and not appended
        yet (each request feeds it at position ``n_tokens``; its block has the slot).
        ``greedy`` (every row greedy and unpenalized): a graph also picks each row's argmax
        and its log-probability, left in :attr:`picked` ([n, 2] float64; else None)."""
        self.picked = None
        bs = self.blocks.block_size
        n = len(seqs)
        padded = bucket(n) if self.use_cuda_graph else n
        scratch_slot = self.blocks.scratch_block * bs
        ahead = ids is not None
        tokens = [0] * n if ahead else [s.last_token for s in seqs]
        pos = [len(s.prompt) + len(s.output) - 1 + ahead for s in seqs]  # n_tokens - 1 (inlined: every row)
        slots = [s.blocks[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        pad = padded - n
        meta = host_tensor([tokens + [0] * pad, pos + [0] * pad, slots + [scratch_slot] * pad,
                            [p + 1 for p in pos] + [1] * pad], torch.int64)
        width = max(len(s.blocks) for s in seqs)
        rows = host_tensor([s.table_row for s in seqs] + [self.blocks.padding_row] * pad, torch.int64)
        tables = self.blocks.host_tables[:, :width].index_select(0, rows)  # the columns in use only
        logits = self.decode_tensors(meta, tables, n, None if self.state is None else rows, ids)  # a hybrid's rows
        if greedy and self.graphs is not None and self.tp is None:
            self.picked = self.graphs.pick_greedy(padded)[:n]
        return logits

    def decode_tensors(self, meta: torch.Tensor, tables: torch.Tensor, n: int,
                       rows: torch.Tensor | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`decode` once its inputs are tensors (what followers run): ``meta`` [4, B]
        ids, positions, slots, context lengths of the padded batch; ``tables`` its block
        tables; ``n`` the real rows; ``rows`` a hybrid model's state rows (= table rows);
        ``ids`` (device, one engine GPU only) the first ``n`` ids instead of meta's."""
        if ids is not None and self.tp is not None:
            raise RuntimeError("decode with device-side ids runs on an engine of one GPU only")
        self._mirror("decode_tensors", meta, tables, n, rows)
        if not self.use_cuda_graph:
            meta = to_device(meta, self.device)
            if ids is not None:
                meta[0, :n] = ids
            state = () if rows is None else (self.state.tensors, to_device(rows, self.device))
            return self.model.decode(meta[0], meta[1], meta[2], to_device(tables, self.device), meta[3].to(torch.int32),
                                     self.k, self.v, *state)
        if self.graphs is None:
            self.graphs = DecodeGraphs(self)
        return self.graphs.run(meta, tables, rows, ids)[:n]

    def self_test(self) -> None:
        """One prefill and one decode of a one-token prompt through the engine's own paths
        (KV cache, block tables, CUDA graphs); raises if that fails or the logits are not
        finite. Leaves the cache's bookkeeping as it found it."""
        probe = Sequence(-1, [0], SamplingParams(temperature=0.0, max_new_tokens=2), None, None, None)
        probe.blocks = [self.blocks.take() for _ in range(self.blocks.blocks_for(2))]
        self.blocks.assign_row(probe)
        try:
            logits = self.prefill_rows([probe])
            self.prefill_tokens -= 1
            probe.output.append(int(logits[0].argmax()))
            logits = self.decode([probe])
            if not bool(torch.isfinite(logits).all()):
                raise FloatingPointError("the model's logits are not finite")
        finally:
            self.blocks.free(probe)


#: Decode batch sizes captured as CUDA graphs (a batch runs padded to the next one).
BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]


def bucket(n: int) -> int:
    """The padded batch size that ``n`` requests decode at."""
    for b in BUCKETS:
        if b >= n:
            return b
    return -(-n // 64) * 64


class DecodeGraphs:
    """CUDA graphs of the decode step, one per padded batch size, captured on first use.
    Inputs are copied into static buffers before a replay; padding rows write to and read
    from the scratch block (a hybrid model's: and the padding state row). All graphs share
    one memory pool (they never run concurrently; each output is consumed before the next
    replay)."""

    def __init__(self, runner: ModelRunner):
        from engines.kernels.paged_attention import LONG_CONTEXT_TOKENS

        self.runner = runner
        dev = runner.device
        most = bucket(runner.max_running)
        scratch = runner.blocks.scratch_block
        self.meta = torch.zeros((4, most), dtype=torch.int64, device=dev)  # ids, positions, slots, lens
        self.meta[2] = scratch * runner.blocks.block_size
        self.meta[3] = 1
        self.tables = torch.full((most, runner.blocks.max_blocks_per_seq), scratch, dtype=torch.int32, device=dev)
        # a hybrid model's state rows (padding: the padding row)
        self.rows = None if runner.state is None else torch.full((most,), runner.blocks.padding_row,
                                                                  dtype=torch.int64, device=dev)
        # block-table columns of a graph of short contexts: its attention splits as a short
        # context's (engines/kernels/paged_attention.py decode_splits); longer batches replay a
        # graph of the whole table (keys: (padded batch, long))
        self.short_width = min(runner.blocks.max_blocks_per_seq, LONG_CONTEXT_TOKENS // runner.blocks.block_size)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pickers: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # greedy picks
        self.last: tuple[int, bool] | None = None  # the key of the last replay
        self.pool = torch.cuda.graph_pool_handle()
        self.bytes = 0

    def _forward(self, key: tuple[int, bool], rows: torch.Tensor | None) -> torch.Tensor:
        r = self.runner
        b, long = key
        lens = self.meta[3, :b].to(torch.int32)
        state = () if rows is None else (r.state.tensors, rows)
        tables = self.tables[:b] if long else self.tables[:b, : self.short_width]
        return r.model.decode(self.meta[0, :b], self.meta[1, :b], self.meta[2, :b], tables, lens, r.k, r.v, *state)

    def batch_sizes(self) -> list[int]:
        """The padded batch sizes captured (short or long contexts)."""
        return sorted({b for b, _ in self.graphs})

    def _capture(self, key: tuple[int, bool]) -> None:
        dev = self.runner.device
        started = time.perf_counter()
        torch.cuda.synchronize(dev)
        before = torch.cuda.mem_get_info(dev)[0]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up (kernel selection, Triton compile) off the capture
            # a decode step advances the state rows it reads: the warm-up touches only the padding row
            # (its KV writes land in the real rows' new slots, which the replay writes again before reading)
            pad = self.runner.blocks.padding_row
            b = key[0]
            self._forward(key, None if self.rows is None else torch.full_like(self.rows[:b], pad))
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(key, None if self.rows is None else self.rows[:b])
        self.graphs[key] = (graph, out)
        torch.cuda.synchronize(dev)
        self.bytes += max(0, before - torch.cuda.mem_get_info(dev)[0])  # device memory the capture took
        self.runner.graph_captures += 1
        self.runner.graph_capture_s += time.perf_counter() - started

    def run(self, meta: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor | None = None,
            ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the graph of ``meta``'s (padded) batch size on these inputs (host tensors,
        copied through pinned memory without waiting for queued work; ``ids``: device ids of
        the first rows instead of meta's); its output buffer is overwritten by the next replay."""
        b = meta.shape[1]
        self.meta[:, :b].copy_(meta.pin_memory(), non_blocking=True)
        if ids is not None:
            self.meta[0, : ids.shape[0]].copy_(ids)
        self.tables[:b, : tables.shape[1]].copy_(tables.pin_memory(), non_blocking=True)
        if rows is not None:
            self.rows[:b].copy_(rows.pin_memory(), non_blocking=True)
        key = (b, tables.shape[1] > self.short_width)  # the columns in use
        if key not in self.graphs:
            self._capture(key)
        graph, out = self.graphs[key]
        graph.replay()
        self.last = key
        return out

    def pick_greedy(self, b: int) -> torch.Tensor:
        """Each row's argmax of the last replay's logits at batch size ``b`` and its
        log-probability, [b, 2] float64, by a graph of its own (one launch for the ~8
        kernels: the sampler's greedy rule, engines/builtin/sampler.py); overwritten by the next."""
        key = self.last
        if key is None or key[0] != b:
            raise RuntimeError(f"pick_greedy({b}): the last replay was not of batch size {b}")
        if key not in self.pickers:
            logits = self.graphs[key][1]
            dev = self.runner.device
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                greedy_pairs(logits)  # warm-up off the capture
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                pairs = greedy_pairs(logits)
            self.pickers[key] = (graph, pairs)
        graph, pairs = self.pickers[key]
        graph.replay()
        return pairs
