"""The built-in torch engine (the embedded default): continuous batching over a paged KV
cache, sampling with per-token log-probs, sleep/wake with real memory release, and weight
updates by HF name. CPU and CUDA.

Threading: every tensor operation runs on one engine thread (``_step``); the asyncio side
only queues requests and resolves their futures. Requests join and leave the running batch
at every step. A request whose prompt does not fit in the free KV blocks waits; when decode
runs out of blocks, the newest running request is preempted (its blocks freed, recomputed
later), so exhaustion queues instead of failing.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

import relay

from .interface import (
    Engine,
    EngineFailed,
    EngineStepError,
    GenerateResult,
    SamplingParams,
    check_tags,
)
from .kernels import seeded_gumbel_argmax, seeded_uniform, triton_usable
from .model import CausalLM, ModelConfig, _inv_freq, load_weights

log = logging.getLogger("relay.engine")



@dataclass(eq=False)  # identity: requests are compared in list scans every step
class _Seq:
    rid: int
    prompt: list
    sampling: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator | None
    output: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    blocks: list = field(default_factory=list)
    row: int = -1  # this request's row in the engine's host block table while it holds blocks
    cached: int = 0  # tokens whose K/V are in the cache
    finish: str | None = None
    text: str | None = None  # set when a stop string ended the request (text before it)

    @property
    def tokens(self) -> list:
        return self.prompt + self.output

    @property
    def n_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]


class TorchEngine(Engine):
    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        kv_cache_tokens: int | None = None,
        mem_fraction_static: float = 0.5,
        block_size: int = 16,
        max_running: int = 256,
        weights_mode: str = "discard",
        name: str = "engine",
        max_prefill_tokens: int | None = None,
        cuda_graph: bool = True,
        share_prefix: bool = True,
        cpu_threads: int | None = None,
    ):
        if weights_mode not in ("discard", "backup"):
            raise ValueError("weights_mode must be 'discard' (rollout: re-synced after wake) or 'backup' (judge: kept in CPU memory)")
        from transformers import AutoTokenizer

        self.name = name
        self.device = torch.device(device)
        # Prompts admitted in one step are prefilled together, padded to the longest: this
        # caps (prompts x longest prompt) so a burst of long prompts is prefilled over several
        # steps instead of exhausting memory (a single prompt is always admitted).
        self.max_prefill_tokens = max_prefill_tokens or (32768 if self.device.type == "cuda" else 8192)
        self.use_cuda_graph = cuda_graph and self.device.type == "cuda"
        # Requests admitted together with identical tokens (the n samples of one prompt) are
        # prefilled once and share its full KV blocks (reference-counted); each gets its own
        # copy of the last, partial block, which its samples then write.
        self.share_prefix = share_prefix
        self._prefill_tokens = 0  # prompt tokens actually run through prefill
        self._graphs: _DecodeGraphs | None = None
        self._failed: BaseException | None = None
        self._step_failures = 0  # steps that raised and were recovered from
        self.cfg = ModelConfig.from_dir(model_path)
        if dtype is None:
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        eos = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos = eos
        with torch.device("meta"):
            model = CausalLM(self.cfg)
        model = model.to_empty(device=self.device).to(self.dtype)
        model.inv_freq = _inv_freq(self.cfg).to(self.device)  # buffers are not in the checkpoint
        if self.cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        load_weights(model, model_path)
        model.eval()
        self.model = model
        self.block_size = block_size
        self.max_running = max_running
        self.weights_mode = weights_mode
        self.mem_fraction_static = mem_fraction_static
        self._kv_tokens_cfg = kv_cache_tokens
        self._k = self._v = None
        self._free_blocks: list[int] = []
        self.num_blocks = 0
        self._allocate_kv()
        self.weight_version = 0
        self._weights_present = True
        self._weights_valid = True
        self._backup: dict[str, torch.Tensor] | None = None
        self._sync_seen: set[str] = set()  # names updated since the last completed version
        self._sync_groups: dict = {}  # group name -> weight_sync.BroadcastGroup
        self._engine_id = uuid.uuid4().hex  # lets a trainer keep one broadcast group per set of engines
        self._shapes = {n: (tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()}
        self._next_rid = 0  # request ids, in arrival order
        self._incoming: queue.SimpleQueue = queue.SimpleQueue()
        self._abort_ids: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._paused = False
        self._exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-step")
        if self.device.type == "cpu":
            # Intra-op threads of the step thread only (OpenMP's setting is per calling
            # thread). A decode step is hundreds of small ops: forking and joining an OpenMP
            # team around each costs more than it saves (2 cores, tiny model: 2,067 -> 6,413
            # tokens/s at batch 8 with one thread; two threads were slower at 64 as well), and
            # colocated CPU workers already share the cores.
            threads = cpu_threads or relay.settings().engine_cpu_threads
            self._exec.submit(torch.set_num_threads, threads).result()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._lock = threading.Lock()
        self._tokens_out = 0
        self._requests_done = 0  # requests answered (any finish reason)
        self._t0 = time.monotonic()
        self.events: list[tuple] = []  # (monotonic time, event, detail): sleep/wake/sync log

    # ------------------------------------------------------------------ memory

    def _kv_block_bytes(self) -> int:
        c = self.cfg
        return 2 * c.num_layers * self.block_size * c.num_kv_heads * c.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def _allocate_kv(self) -> None:
        if self._kv_tokens_cfg is not None:
            blocks = max(1, self._kv_tokens_cfg // self.block_size)
        elif self.device.type == "cuda":
            # As in SGLang: this engine's weights + KV cache take mem_fraction_static of the
            # GPU (other tenants of the GPU, even in this process, are not counted here).
            free, total = torch.cuda.mem_get_info(self.device)
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            budget = min(total * self.mem_fraction_static - weights, free * 0.95)
            blocks = int(max(budget, 0) // self._kv_block_bytes())
            if blocks < 1:
                raise MemoryError(
                    f"mem_fraction_static {self.mem_fraction_static} of {total / 2**30:.0f} GiB leaves no room for the KV cache "
                    f"after {weights / 2**30:.1f} GiB of weights (free now: {free / 2**30:.1f} GiB)"
                )
        else:
            blocks = 4096 // self.block_size  # a configured capacity is expected on CPU
        c = self.cfg
        # One extra block, never handed out: padding rows of a batch write and read there.
        shape = (c.num_layers, blocks + 1, self.block_size, c.num_kv_heads, c.head_dim)
        self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_blocks = blocks
        self._scratch_block = blocks
        self._free_blocks = list(range(blocks - 1, -1, -1))
        self._refs = [0] * blocks  # requests holding each block
        # Host-side block table: one row per running request (plus a scratch row for padding).
        self.max_blocks_per_seq = -(-min(self.cfg.max_position_embeddings, blocks * self.block_size) // self.block_size)
        self._host_tables = torch.full((self.max_running + 1, self.max_blocks_per_seq), blocks, dtype=torch.int32)
        self._free_rows = list(range(self.max_running - 1, -1, -1))
        self._drop_graphs()

    def _bytes(self) -> dict:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters()) if self._weights_present else 0
        kv = 0 if self._k is None else 2 * self._k.numel() * self._k.element_size()
        backup = 0 if self._backup is None else sum(t.numel() * t.element_size() for t in self._backup.values())
        graphs = 0 if self._graphs is None else self._graphs.bytes
        return {"weights": weights, "kv_cache": kv, "cuda_graph": graphs, "cpu_backup": backup}

    def _drop_graphs(self) -> None:
        """Forget captured decode graphs (they point at the weights' and the cache's memory:
        any reallocation invalidates them; they are captured again on use)."""
        self._graphs = None

    # ------------------------------------------------------------------ API

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _encode(self, prompt, chat_template_kwargs) -> list:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            out = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {}))
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt:
            bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
            return list(prompt)
        raise ValueError("prompt must be a non-empty list of token ids, a string, or chat messages [{role, content}]")

    async def generate(self, prompt, sampling=None, chat_template_kwargs=None) -> GenerateResult:
        sp = sampling if isinstance(sampling, SamplingParams) else SamplingParams.from_dict(sampling)
        sp.validate()
        ids = self._encode(prompt, chat_template_kwargs)
        need = len(ids) + sp.max_new_tokens
        if need > self.num_blocks * self.block_size:
            raise ValueError(f"request needs {need} tokens of KV cache (prompt {len(ids)} + max_new_tokens {sp.max_new_tokens}) but the engine holds {self.num_blocks * self.block_size}")
        if need > self.cfg.max_position_embeddings:
            raise ValueError(f"request of {need} tokens exceeds the model's {self.cfg.max_position_embeddings} positions")
        if not self._weights_valid:
            raise RuntimeError(f"{self.name}: weights were discarded by sleep(); update_weights() before generating")
        if self._k is None:
            raise RuntimeError(f"{self.name}: the KV cache is asleep; wake(['kv_cache']) before generating")
        if self._failed is not None:
            raise EngineFailed(f"{self.name}: the engine failed and serves no more requests: {self._failed!r}")
        loop = asyncio.get_running_loop()
        gen = None
        if sp.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sp.seed)
        seq = _Seq(self._next_rid, ids, sp, loop.create_future(), loop, gen)
        self._next_rid += 1
        self._incoming.put(seq)
        self._ensure_loop()
        self._wakeup.set()
        try:
            return await seq.future
        except asyncio.CancelledError:  # the caller left (its future is cancelled): free its place
            if seq.finish is None:
                self._abort_ids.put(seq.rid)
                self._wakeup.set()
            raise

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._paused or not self._has_work():
                self._wakeup.clear()
                if not self._paused and self._has_work():
                    continue
                await self._wakeup.wait()
                continue
            try:
                done = await loop.run_in_executor(self._exec, self._steps)
            except Exception as e:  # noqa: BLE001 (every caller gets the error; nothing waits forever)
                self._step_failures += 1
                broken = await loop.run_in_executor(self._exec, self._recover, e)
                if broken is not None:
                    self._fail_all(broken)
                    return
                continue
            for seq in done:
                self._resolve(seq)

    def _recover(self, exc: BaseException) -> BaseException | None:
        """Engine thread, after a step raised: fail the step's requests (every running one:
        they shared its forward) with :class:`EngineStepError`, rebuild the KV bookkeeping
        and block tables from scratch (no request holds blocks now), release a device's
        cached allocations (an out-of-memory step), then check the engine still computes
        (:meth:`_self_test`). Returns None when it does (the waiting requests run next), else
        the error that shows it cannot go on."""
        failed = list(self._running)
        log.error("%s: engine step failed (%d so far); failing its %d request(s) and recovering: %r",
                  self.name, self._step_failures, len(failed), exc)
        self._running.clear()
        for seq in self._waiting:  # a preempted request holds none, but be exact
            seq.blocks, seq.row, seq.cached = [], -1, 0
        if self._k is not None:
            self._free_blocks = list(range(self.num_blocks - 1, -1, -1))
            self._refs = [0] * self.num_blocks
            self._host_tables.fill_(self.num_blocks)
            self._free_rows = list(range(self.max_running - 1, -1, -1))
        self._drop_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        error = EngineStepError(f"{self.name}: an engine step failed ({exc!r}); its {len(failed)} request(s) failed with it and the engine recovered")
        for seq in failed:
            seq.loop.call_soon_threadsafe(_settle_error, seq.future, error)
        try:
            self._self_test()
        except Exception as e:  # noqa: BLE001 - reported as the reason the engine gives up
            return e
        return None

    def _self_test(self) -> None:
        """Engine thread: one prefill and one decode of a one-token prompt through the
        engine's own paths (KV cache, block tables, CUDA graphs); raises if that fails or
        the logits are not finite. Leaves the cache's bookkeeping as it found it."""
        probe = _Seq(-1, [0], SamplingParams(temperature=0.0, max_new_tokens=2), None, None, None)
        probe.blocks = [self._take_block() for _ in range(-(-2 // self.block_size))]
        probe.row = self._free_rows.pop()
        self._host_tables[probe.row, : len(probe.blocks)] = torch.tensor(probe.blocks, dtype=torch.int32)
        try:
            logits = self._prefill_rows([probe])
            self._prefill_tokens -= 1
            probe.output.append(int(logits[0].argmax()))
            logits = self._decode([probe])
            if not bool(torch.isfinite(logits).all()):
                raise FloatingPointError("the model's logits are not finite")
        finally:
            self._free(probe)

    def _fail_all(self, exc: BaseException) -> None:
        """The engine cannot go on: fail every pending request, release their KV blocks and
        refuse new requests with :class:`EngineFailed`; ``health()`` reports unhealthy."""
        self._failed = exc
        log.error("%s: the engine cannot go on after a failed step (its self-test failed); failing %d pending request(s): %r", self.name,
                  len(self._running) + len(self._waiting) + self._incoming.qsize(), exc)
        while not self._incoming.empty():
            self._waiting.append(self._incoming.get())
        for seq in list(self._running) + list(self._waiting):
            if seq.blocks:
                self._free(seq)
            if not seq.future.done():
                seq.future.set_exception(EngineFailed(f"{self.name}: the engine failed and serves no more requests: {exc!r}"))
        self._running.clear()
        self._waiting.clear()

    def _has_work(self) -> bool:
        return bool(self._running or self._waiting or not self._incoming.empty() or not self._abort_ids.empty())

    def _resolve(self, seq: _Seq) -> None:
        if seq.future.done():
            return
        text = seq.text if seq.text is not None else self.tokenizer.decode(seq.output, skip_special_tokens=True)
        self._requests_done += 1
        seq.future.set_result(GenerateResult(list(seq.output), text, list(seq.logprobs), seq.finish, len(seq.prompt), self.weight_version))

    # ------------------------------------------------------------------ the step (engine thread)

    def _steps(self, most: int = 8) -> list[_Seq]:
        """Up to ``most`` steps in one hop to the engine thread: it returns as soon as a
        request finishes (so its caller hears at once) or anything arrives to admit or abort,
        or the engine is paused."""
        for _ in range(most):
            done = self._step()
            if done or self._paused or not self._running or not self._incoming.empty() or not self._abort_ids.empty():
                return done
        return done

    def _step(self) -> list[_Seq]:
        finished: list[_Seq] = []
        while not self._incoming.empty():
            self._waiting.append(self._incoming.get())
        aborts = set()
        while not self._abort_ids.empty():
            aborts.add(self._abort_ids.get())
        if aborts:
            for seq in [s for s in list(self._waiting) + self._running if _aborted(s.rid, aborts)]:
                seq.finish = "abort"
                finished.append(self._release(seq))
        # Running requests first: each feeds its last token this step and needs a slot for
        # it; when no block is free, the newest running request is preempted (recomputed
        # later from its prompt and output so far).
        bs = self.block_size
        preempted: set[int] = set()
        for seq in list(self._running):
            if seq.rid in preempted or seq.n_tokens <= len(seq.blocks) * bs:
                continue
            while not self._free_blocks:
                victim = self._running.pop()
                self._free(victim)
                victim.cached = 0
                self._waiting.appendleft(victim)
                preempted.add(victim.rid)
                if victim is seq:
                    break
            if seq.rid not in preempted:
                seq.blocks.append(self._take_block())
                self._host_tables[seq.row, len(seq.blocks) - 1] = seq.blocks[-1]
        # Then admit waiting requests whose tokens fit (FIFO: the head blocks the rest), while
        # the padded prefill (prompts x longest) stays within max_prefill_tokens. A request
        # whose tokens equal one admitted this step follows it: no prefill of its own.
        new: list[_Seq] = []
        prefill: list[_Seq] = []
        leader_of: dict[int, int] = {}  # follower rid -> index of its leader in `prefill`
        leaders: dict[tuple, int] = {}
        longest = 0
        while self._waiting and len(self._running) + len(new) < self.max_running:
            seq = self._waiting[0]
            key = tuple(seq.tokens) if self.share_prefix and not seq.blocks else None
            lead = leaders.get(key) if key is not None else None
            if lead is not None:
                full = seq.n_tokens // bs
                if seq.n_tokens % bs and not self._free_blocks:
                    break
                self._waiting.popleft()
                seq.blocks = [self._share_block(b) for b in prefill[lead].blocks[:full]]
                if seq.n_tokens % bs:
                    seq.blocks.append(self._take_block())
                leader_of[seq.rid] = lead
            else:
                need = -(-seq.n_tokens // bs) - len(seq.blocks)
                if need > len(self._free_blocks):
                    break
                if prefill and (len(prefill) + 1) * max(longest, seq.n_tokens) > self.max_prefill_tokens:
                    break
                longest = max(longest, seq.n_tokens)
                self._waiting.popleft()
                seq.blocks += [self._take_block() for _ in range(need)]
                if key is not None:
                    leaders[key] = len(prefill)
                prefill.append(seq)
            seq.row = self._free_rows.pop()
            self._host_tables[seq.row, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
            new.append(seq)
        decoding = list(self._running)
        if not decoding and not new:
            return finished
        self._running.extend(new)  # before the forward: a failing step still finds them
        parts = []
        if decoding:
            parts.append(self._decode(decoding))
        if new:
            parts.append(self._prefill(prefill, new, leader_of))
        batch_seqs = decoding + new
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        toks, lps = self._sample_batch(logits, batch_seqs)
        for row, seq in enumerate(batch_seqs):
            seq.cached = seq.n_tokens
            tok, lp = toks[row], lps[row]
            seq.output.append(tok)
            seq.logprobs.append(lp)
            self._tokens_out += 1
            if self._finished(seq, tok):
                self._running.remove(seq)
                finished.append(self._release(seq))
        return finished

    def _prefill(self, seqs: list[_Seq], admitted: list[_Seq], leader_of: dict[int, int]) -> torch.Tensor:
        """Logits of the next token of each ``admitted`` request: ``seqs`` (none of whose
        tokens are cached yet) run through the model; a follower takes its leader's row and
        a copy of the leader's partial last block."""
        logits = self._prefill_rows(seqs)
        if not leader_of:
            return logits
        copies = [(seqs[leader_of[s.rid]].blocks[-1], s.blocks[-1]) for s in admitted if s.rid in leader_of and s.n_tokens % self.block_size]
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self._k[:, dst] = self._k[:, src]
            self._v[:, dst] = self._v[:, src]
        index = {id(s): i for i, s in enumerate(seqs)}
        rows = [leader_of[s.rid] if s.rid in leader_of else index[id(s)] for s in admitted]
        return logits[torch.tensor(rows, device=logits.device)]

    def _prefill_rows(self, seqs: list[_Seq]) -> torch.Tensor:
        bs = self.block_size
        self._prefill_tokens += sum(s.n_tokens for s in seqs)
        longest = max(len(s.tokens) for s in seqs)
        ids = torch.zeros((len(seqs), longest), dtype=torch.int64)
        slots = torch.full((len(seqs), longest), self._scratch_block * bs, dtype=torch.int64)
        lens = torch.empty(len(seqs), dtype=torch.int64)
        for r, seq in enumerate(seqs):
            n = len(seq.tokens)
            ids[r, :n] = torch.tensor(seq.tokens)
            slots[r, :n] = (torch.tensor(seq.blocks).repeat_interleave(bs)[:n] * bs) + torch.arange(n) % bs
            lens[r] = n
        dev = self.device
        return self.model.prefill(ids.to(dev), lens.to(dev), slots.to(dev), self._k, self._v)

    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """Logits of the next token of running requests (each feeds its last token); on
        CUDA through a captured graph of the padded batch size."""
        bs = self.block_size
        n = len(seqs)
        padded = _bucket(n) if self.use_cuda_graph else n
        scratch_slot = self._scratch_block * bs
        ids = [s.last_token for s in seqs]
        pos = [s.n_tokens - 1 for s in seqs]
        slots = [s.blocks[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        pad = padded - n
        meta = torch.tensor([ids + [0] * pad, pos + [0] * pad, slots + [scratch_slot] * pad, [p + 1 for p in pos] + [1] * pad])
        width = max(len(s.blocks) for s in seqs)
        rows = torch.tensor([s.row for s in seqs] + [self.max_running] * pad)
        tables = self._host_tables.index_select(0, rows)[:, :width]
        if not self.use_cuda_graph:
            dev = self.device
            meta = meta.to(dev)
            return self.model.decode(meta[0], meta[1], meta[2], tables.to(dev), meta[3].to(torch.int32), self._k, self._v)
        if self._graphs is None:
            self._graphs = _DecodeGraphs(self)
        return self._graphs.run(meta, tables)[:n]

    def _sample_batch(self, logits: torch.Tensor, seqs: list[_Seq]) -> tuple[list[int], list[float]]:
        """Sample one token per row on the device, with one host transfer for the batch.
        Seeded rows use Gumbel-max over :func:`seeded_uniform` noise (batched); rows that
        truncate (top-k / top-p) are handled row by row."""
        if all(s.sampling.temperature == 0 for s in seqs):  # all greedy: argmax and its log-prob
            tok, logp = logits.argmax(dim=-1), torch.log_softmax(logits, dim=-1)
        else:
            tok, logp = self._sample_rows(logits, seqs)
        lp = logp.gather(1, tok[:, None])[:, 0]
        toks, lps = torch.stack((tok.double(), lp.double())).tolist()  # one device->host transfer
        return [int(t) for t in toks], lps

    def _sample_rows(self, logits: torch.Tensor, seqs: list[_Seq]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B] and the log-softmax at each row's temperature [B, V]."""
        dev = logits.device
        temps = torch.tensor([s.sampling.temperature or 1.0 for s in seqs], device=dev, dtype=logits.dtype)
        logp = torch.log_softmax(logits / temps[:, None], dim=-1)
        tok = logits.argmax(dim=-1)  # greedy rows; every other row is drawn below
        untruncated = [i for i, s in enumerate(seqs) if s.sampling.temperature > 0 and s.sampling.top_k < 0 and s.sampling.top_p >= 1.0]
        plain = [i for i in untruncated if seqs[i].generator is None]
        seeded = [i for i in untruncated if seqs[i].generator is not None]
        if plain:
            idx = torch.tensor(plain, device=dev)
            tok[idx] = torch.multinomial(logp[idx].exp(), 1)[:, 0]
        if seeded:  # Gumbel-max with noise from (seed, position): batched and batch-independent
            idx = torch.tensor(seeded, device=dev)
            seeds = torch.tensor([seqs[i].sampling.seed for i in seeded], device=dev, dtype=torch.int64)
            pos = torch.tensor([len(seqs[i].output) for i in seeded], device=dev, dtype=torch.int64)
            rows, row_temps = logits[idx], temps[idx]
            if triton_usable(dev):  # one fused pass over the vocabulary per row
                tok[idx] = seeded_gumbel_argmax(rows, row_temps, seeds, pos)
            else:
                u = seeded_uniform(seeds, pos, logits.shape[-1])
                tok[idx] = ((rows / row_temps[:, None]).double() - torch.log(-torch.log(u))).argmax(dim=-1)
        batched = set(plain) | set(seeded)
        for i, s in enumerate(seqs):
            if s.sampling.temperature > 0 and i not in batched:
                tok[i] = self._sample(logits[i], s.sampling, s.generator)[0]
        return tok, logp

    def _sample(self, logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator | None) -> tuple[int, float]:
        if sp.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = int(torch.argmax(logits))
            return tok, float(logp[tok])
        logp = torch.log_softmax(logits / sp.temperature, dim=-1)
        probs = logp.exp()
        if sp.top_k > 0 and sp.top_k < probs.numel():
            kth = torch.topk(probs, sp.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if sp.top_p < 1.0:
            sorted_p, idx = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < sp.top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[idx[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
        tok = int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
        return tok, float(logp[tok])

    def _finished(self, seq: _Seq, tok: int) -> bool:
        sp = seq.sampling
        if (not sp.ignore_eos and tok in self.eos) or tok in sp.stop_token_ids:
            seq.finish = "stop"
            return True
        if sp.stop:
            # A stop string completed by this token lies within the last few tokens (a token
            # is at least one byte; a character at most 4): decode only that tail each step,
            # and the whole output once one matches (to cut at its first occurrence).
            window = 4 * max(len(s) for s in sp.stop) + 4
            tail = self.tokenizer.decode(seq.output[-window:], skip_special_tokens=True)
            if any(s and s in tail for s in sp.stop):
                text = self.tokenizer.decode(seq.output, skip_special_tokens=True)
                hits = [text.find(s) for s in sp.stop if s and s in text]
                if hits:
                    seq.finish = "stop"
                    seq.text = text[: min(hits)]
                    return True
        if len(seq.output) >= sp.max_new_tokens:
            seq.finish = "length"
            return True
        return False

    def _take_block(self) -> int:
        block = self._free_blocks.pop()
        self._refs[block] = 1
        return block

    def _share_block(self, block: int) -> int:
        self._refs[block] += 1
        return block

    def _free(self, seq: _Seq) -> None:
        for block in seq.blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free_blocks.append(block)
        seq.blocks = []
        if seq.row >= 0:
            self._free_rows.append(seq.row)
            seq.row = -1

    def _release(self, seq: _Seq) -> _Seq:
        if seq in self._waiting:
            self._waiting.remove(seq)
        if seq in self._running:
            self._running.remove(seq)
        self._free(seq)
        return seq

    # ------------------------------------------------------------------ control

    async def abort(self, request_ids=None) -> int:
        """Abort all (None) or the given requests; they finish with reason "abort"."""
        n = len(self._running) + len(self._waiting) + self._incoming.qsize()
        if request_ids is None:  # every request that exists now (not later arrivals)
            self._abort_ids.put(("before", self._next_rid))
        else:
            for rid in request_ids:
                self._abort_ids.put(rid)
        self._ensure_loop()  # the step loop consumes the abort queue
        self._wakeup.set()
        if self._paused:  # aborts are processed even while paused
            done = await asyncio.get_running_loop().run_in_executor(self._exec, self._step_aborts_only)
            for seq in done:
                self._resolve(seq)
        return n

    def _step_aborts_only(self) -> list[_Seq]:
        finished = []
        while not self._incoming.empty():
            self._waiting.append(self._incoming.get())
        aborts = set()
        while not self._abort_ids.empty():
            aborts.add(self._abort_ids.get())
        for seq in [s for s in list(self._waiting) + self._running if _aborted(s.rid, aborts)]:
            seq.finish = "abort"
            finished.append(self._release(seq))
        return finished

    async def pause(self) -> None:
        self._paused = True

    async def resume(self) -> None:
        self._paused = False
        if self._wakeup is not None:
            self._wakeup.set()

    async def _drain(self, drain: str) -> None:
        if drain == "abort":
            await self.abort()
        elif drain != "finish":
            raise ValueError("drain must be 'abort' or 'finish'")
        while self._has_work() and self._failed is None:
            if self._paused:
                await self.resume()
            await asyncio.sleep(0.005)

    async def sleep(self, tags=("weights", "kv_cache"), drain: str = "abort") -> None:
        tags = check_tags(tags)
        await self._drain(drain)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._exec, self._sleep_sync, tags)
        self.events.append((time.monotonic(), "sleep", tags))

    def _sleep_sync(self, tags) -> None:
        self._drop_graphs()  # "cuda_graph", and any release below, invalidates them
        if "kv_cache" in tags and self._k is not None:
            self._k = self._v = None
            self._free_blocks = []
        if "weights" in tags and self._weights_present:
            if self.weights_mode == "backup":
                if self._backup is None:  # allocated once, reused by every later sleep
                    pin = self.device.type == "cuda"
                    self._backup = {n: torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for n, p in self.model.named_parameters()}
                for n, p in self.model.named_parameters():
                    self._backup[n].copy_(p.data, non_blocking=True)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            for p in self.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=self.device)
            self._weights_present = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def wake(self, tags=("weights", "kv_cache")) -> None:
        tags = check_tags(tags)
        await asyncio.get_running_loop().run_in_executor(self._exec, self._wake_sync, tags)
        self.events.append((time.monotonic(), "wake", tags))

    def _wake_sync(self, tags) -> None:
        self._drop_graphs()
        if "weights" in tags and not self._weights_present:
            for n, p in self.model.named_parameters():
                shape, dtype = self._shapes[n]
                p.data = torch.empty(shape, dtype=dtype, device=self.device)
                if self.weights_mode == "backup":
                    p.data.copy_(self._backup[n], non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._weights_present = True
            self._weights_valid = self.weights_mode == "backup"
            self._sync_seen = set()  # fresh (discarded) weights: an update must cover them all
            if self.cfg.tie_word_embeddings:
                self.model.lm_head.weight = self.model.model.embed_tokens.weight
        if "kv_cache" in tags and self._k is None:
            self._allocate_kv()

    async def update_weights(self, buckets, version: int) -> None:
        """Copy HF-named tensors into the model (all names must be covered once the weights
        were discarded); generation afterwards uses them and reports ``version``."""
        await asyncio.get_running_loop().run_in_executor(self._exec, self._update_sync, buckets, version)
        self.events.append((time.monotonic(), "update_weights", version))

    def _update_sync(self, buckets, version: int) -> None:
        if not self._weights_present:
            raise RuntimeError(f"{self.name}: wake(['weights']) before update_weights()")
        for bucket in buckets:
            self._copy_in(bucket.items() if isinstance(bucket, dict) else bucket)
        self._finish_version(version)

    def _copy_in(self, items) -> None:
        """Copy HF-named tensors into the parameters (any device/dtype; converted)."""
        if not self._weights_present:
            raise RuntimeError(f"{self.name}: wake(['weights']) before update_weights()")
        params = dict(self.model.named_parameters())
        for name, tensor in items:
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            p = params.get(name)
            if p is None:
                raise KeyError(f"update_weights: unknown tensor {name!r}")
            if tuple(p.shape) != tuple(tensor.shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor.to(device=self.device, dtype=p.dtype))
            self._sync_seen.add(name)

    def _finish_version(self, version: int) -> None:
        """The update of ``version`` is complete (over one or several calls)."""
        seen, self._sync_seen = self._sync_seen, set()
        if not self._weights_valid:
            missing = set(self.model.hf_names()) - seen
            if missing:
                raise ValueError(f"update_weights after a discarding sleep must cover every tensor; missing {sorted(missing)[:5]}")
            self._weights_valid = True
        self.weight_version = version

    def weight_sync_info(self) -> dict:
        """What a trainer needs to pick the transport: CUDA IPC needs the same physical GPU."""
        from .weight_sync import device_uuid

        return {"backend": "torch", "device_type": self.device.type, "uuid": device_uuid(self.device), "pid": os.getpid(), "engine_id": self._engine_id}

    async def update_weights_from_ipc(self, handle: dict, metas: list, version: int, last: bool = True) -> None:
        """Colocated weight sync, one flat bucket: map the trainer's buffer by its CUDA IPC
        ``handle`` (see engines.weight_sync), copy each ``(name, shape, dtype, offset)``
        tensor device to device, synchronize and unmap before returning (the trainer frees
        the buffer only after that). ``last`` completes ``version``."""
        await asyncio.get_running_loop().run_in_executor(self._exec, self._ipc_sync, handle, metas, version, last)
        if last:
            self.events.append((time.monotonic(), "update_weights", version))

    def _ipc_sync(self, handle: dict, metas: list, version: int, last: bool) -> None:
        from .weight_sync import open_ipc, unflatten

        if self.device.type != "cuda":
            raise RuntimeError(f"{self.name}: CUDA IPC weight sync needs a CUDA engine; this one runs on {self.device}")
        buf = open_ipc(handle, self.device)
        try:
            self._copy_in(unflatten(buf, metas))
            torch.cuda.current_stream(self.device).synchronize()
        finally:
            del buf
        if last:
            self._finish_version(version)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group", backend: str = "nccl", timeout_s: float = 600.0) -> None:
        """Join the trainer's broadcast group as rank ``rank_offset`` (the trainer is rank 0);
        returns once every member joined, raises after ``timeout_s`` otherwise."""
        from .weight_sync import BroadcastGroup

        if group_name in self._sync_groups:
            raise ValueError(f"{self.name}: weight-update group {group_name!r} exists; destroy it first")
        group = await asyncio.to_thread(BroadcastGroup, master_address, master_port, rank_offset, world_size, backend, timeout_s, group_name)
        self._sync_groups[group_name] = group

    async def update_weights_from_distributed(self, names: list, dtypes: list, shapes: list, version: int,
                                              group_name: str = "weight_update_group", last: bool = True) -> None:
        """Receive one bucket (the trainer broadcasts it as one flat buffer laid out by
        ``weight_sync.metas_for``) and copy it in. ``last`` completes ``version``."""
        group = self._sync_groups.get(group_name)
        if group is None:
            raise RuntimeError(f"{self.name}: no weight-update group {group_name!r}; init_weights_update_group() first")
        await asyncio.get_running_loop().run_in_executor(self._exec, self._distributed_sync, group, names, dtypes, shapes, version, last)
        if last:
            self.events.append((time.monotonic(), "update_weights", version))

    def _distributed_sync(self, group, names, dtypes, shapes, version, last) -> None:
        from .weight_sync import metas_for, unflatten

        metas, total = metas_for(names, dtypes, shapes)
        buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        group.broadcast(buf)
        self._copy_in(unflatten(buf, metas))
        if last:
            self._finish_version(version)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        group = self._sync_groups.pop(group_name, None)
        if group is not None:
            group.close()

    async def health(self) -> dict:
        ok = self._failed is None and (self._loop_task is None or not self._loop_task.done() or self._loop_task.exception() is None)
        out = {"status": "healthy" if ok else "unhealthy", "name": self.name}
        if self._failed is not None:
            out["error"] = repr(self._failed)
        return out

    async def stats(self) -> dict:
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        return {
            "bytes": self._bytes(),
            "running": len(self._running),
            "waiting": len(self._waiting) + self._incoming.qsize(),
            "tokens_per_s": self._tokens_out / elapsed,
            "tokens_generated": self._tokens_out,
            "requests_finished": self._requests_done,
            "step_failures": self._step_failures,
            "weight_version": self.weight_version,
            "kv_blocks_free": len(self._free_blocks),
            "prefill_tokens": self._prefill_tokens,
            "kv_blocks_total": self.num_blocks if self._k is not None else 0,
            "paused": self._paused,
            "cuda_graphs": sorted(self._graphs.graphs) if self._graphs is not None else [],  # captured batch sizes
            "weight_update_groups": sorted(self._sync_groups),
            "asleep": [t for t, present in (("weights", self._weights_present), ("kv_cache", self._k is not None)) if not present],
        }

    async def close(self) -> None:
        """Abort what is in flight and release the KV cache and the weights."""
        await self.abort()
        await asyncio.get_running_loop().run_in_executor(self._exec, self._sleep_sync, ("kv_cache",))
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._weights_present = self._weights_valid = False
        self._backup = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._exec.shutdown(wait=False, cancel_futures=True)


#: Decode batch sizes captured as CUDA graphs (a batch runs padded to the next one).
_BUCKETS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]


def _bucket(n: int) -> int:
    for b in _BUCKETS:
        if b >= n:
            return b
    return -(-n // 64) * 64


class _DecodeGraphs:
    """CUDA graphs of the decode step, one per padded batch size, captured on first use.
    Inputs are copied into static buffers before a replay; padding rows write to and read
    from the engine's scratch block. All graphs share one memory pool (they never run
    concurrently; each output is consumed before the next replay)."""

    def __init__(self, engine: TorchEngine):
        self.engine = engine
        dev = engine.device
        most = _bucket(engine.max_running)
        scratch = engine._scratch_block
        self.meta = torch.zeros((4, most), dtype=torch.int64, device=dev)  # ids, positions, slots, lens
        self.meta[2] = scratch * engine.block_size
        self.meta[3] = 1
        self.tables = torch.full((most, engine.max_blocks_per_seq), scratch, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.bytes = 0

    def _forward(self, b: int) -> torch.Tensor:
        e = self.engine
        lens = self.meta[3, :b].to(torch.int32)
        return e.model.decode(self.meta[0, :b], self.meta[1, :b], self.meta[2, :b], self.tables[:b], lens, e._k, e._v)

    def _capture(self, b: int) -> None:
        dev = self.engine.device
        torch.cuda.synchronize(dev)
        before = torch.cuda.mem_get_info(dev)[0]
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # warm-up (kernel selection, Triton compile) off the capture
            self._forward(b)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(b)
        self.graphs[b] = (graph, out)
        torch.cuda.synchronize(dev)
        self.bytes += max(0, before - torch.cuda.mem_get_info(dev)[0])  # device memory the capture took

    def run(self, meta: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        b = meta.shape[1]
        self.meta[:, :b].copy_(meta, non_blocking=True)
        self.tables[:b, : tables.shape[1]].copy_(tables, non_blocking=True)
        if b not in self.graphs:
            self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out


def _settle_error(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _aborted(rid: int, aborts: set) -> bool:
    """Whether request ``rid`` is named by the abort markers (ids, or ("before", n))."""
    return rid in aborts or any(isinstance(a, tuple) and rid < a[1] for a in aborts)


def default_kv_tokens() -> int | None:
    return relay.settings().kv_cache_tokens
