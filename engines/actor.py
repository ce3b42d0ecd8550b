"""``EngineActor``: an inference engine behind relay. The rest of the system talks to
engines only through this actor (generate, sleep/wake, update_weights, ...)."""

from __future__ import annotations

import asyncio

from engines.interface import TAGS, GenerateResult, RequestCancelled, backend_options, encode_rendered
from relay import Actor, endpoint

INLINE_TOKENIZE_CHARS = 1 << 16  # a batch with more text is tokenized off the event loop


class EngineActor(Actor):
    """Hosts one engine. ``backend`` is "torch" (the built-in engine) or "sglang";
    ``engine_kwargs`` are the engine options (``engines.interface.ENGINE_OPTIONS``), the
    same for both backends (``backend_options`` gives each what it takes)."""

    def __init__(self, model_path: str, backend: str = "torch", **engine_kwargs):
        self.model_path = model_path
        self.backend = backend
        self.engine_kwargs = engine_kwargs
        self.engine = None
        self._tagged: dict[str, asyncio.Task] = {}  # generate_rendered tag -> its running request

    async def setup(self) -> None:
        if self.backend == "torch":
            from engines.builtin import TorchEngine

            options = backend_options("torch", self.engine_kwargs)
            peers = options.pop("tp_peers", None)  # follower ranks of a tensor-parallel engine
            if peers:
                from engines.builtin.tp import start_engine

                self.engine = await start_engine(self.model_path, peers, options)
            else:
                self.engine = TorchEngine(self.model_path, **options)
        elif self.backend == "sglang":
            from engines.sglang.engine import SGLangEngine

            self.engine = SGLangEngine(self.model_path, **backend_options("sglang", self.engine_kwargs))
            await self.engine.start()
        else:
            raise ValueError(f"unknown engine backend {self.backend!r}; use 'torch' or 'sglang'")

    @endpoint(concurrent=True)
    async def generate(
        self, prompt, sampling: dict | None = None, chat_template_kwargs: dict | None = None
    ) -> GenerateResult:
        return await self.engine.generate(prompt, sampling, chat_template_kwargs)

    @endpoint(concurrent=True)
    async def generate_batch(self, requests: list) -> list:
        """``requests``: a list of ``[prompt, sampling]``, run concurrently. One item per
        request, in order: its GenerateResult, or the exception it raised (the others are
        unaffected)."""
        return await asyncio.gather(*(self.engine.generate(p, s) for p, s in requests), return_exceptions=True)

    @endpoint(concurrent=True)
    async def generate_rendered(self, requests: list) -> list:
        """``requests``: a list of ``[text, sampling]`` or ``[text, sampling, tag]`` where
        ``text`` is a chat already rendered by its chat template (the judge service sends
        these): tokenized here, all at once, as ``apply_chat_template(tokenize=True)`` would
        (no special tokens added), then run like :meth:`generate_batch`. Tokenizing in the
        engines spreads that work over them instead of the one process that renders. One item
        per request, in order. A request with a ``tag`` (a string) can be cancelled while it
        runs (:meth:`cancel`): it then ends with :class:`RequestCancelled`."""
        texts = [r[0] if isinstance(r, (list, tuple)) and len(r) in (2, 3) else None for r in requests]
        tok = self.engine.tokenizer  # both backends have one (SGLang's adapter loads it on first use)
        try:
            if sum(len(t) for t in texts if isinstance(t, str)) > INLINE_TOKENIZE_CHARS:
                ids: list = await asyncio.to_thread(encode_rendered, tok, texts)
            else:
                ids = encode_rendered(tok, texts)
        except Exception:  # noqa: BLE001 - some request is malformed: encode one by one to find it
            ids = []
            for t in texts:
                try:
                    ids.append(encode_rendered(tok, [t])[0])
                except Exception as e:  # noqa: BLE001
                    ids.append(TypeError(f"each request must be [rendered chat text, sampling]: {e}"))
        loop = asyncio.get_running_loop()
        tasks, tags = [], []
        for p, r in zip(ids, requests):
            task = loop.create_task(_failed(p) if isinstance(p, Exception) else self.engine.generate(p, r[1]))
            tasks.append(task)
            if len(r) == 3 and isinstance(r[2], str):
                self._tagged[r[2]] = task
                tags.append(r[2])
        try:
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for tag in tags:
                self._tagged.pop(tag, None)
        return [
            RequestCancelled("cancelled by its caller") if isinstance(r, asyncio.CancelledError) else r for r in results
        ]

    @endpoint(concurrent=True)
    async def cancel(self, tags: list) -> int:
        """Cancel the tagged requests of :meth:`generate_rendered` still running here (their
        callers left); the engine frees their place in the batch. Returns how many."""
        n = 0
        for tag in tags if isinstance(tags, list) else ():
            task = self._tagged.pop(tag, None) if isinstance(tag, str) else None
            if task is not None and task.cancel():
                n += 1
        return n

    @endpoint
    async def sleep(self, tags: tuple = TAGS[:2], drain: str = "abort") -> None:
        await self.engine.sleep(tags, drain)

    @endpoint
    async def wake(self, tags: tuple = TAGS[:2]) -> None:
        await self.engine.wake(tags)

    @endpoint
    async def update_weights(self, buckets: list, version: int) -> None:
        await self.engine.update_weights(buckets, version)

    @endpoint(concurrent=True)
    async def weight_sync_info(self) -> dict:
        """``{"backend", "device_type", "uuid", ...}``: lets a trainer pick CUDA IPC (same GPU),
        a broadcast group (other GPUs) or the relay path (CPU, and SGLang backends)."""
        return self.engine.weight_sync_info()

    @endpoint
    async def update_weights_from_ipc(self, handle: dict | list, metas: list, version: int, last: bool = True) -> None:
        await self.engine.update_weights_from_ipc(handle, metas, version, last)

    @endpoint
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> None:
        await self.engine.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s
        )

    @endpoint
    async def update_weights_from_distributed(
        self,
        names: list,
        dtypes: list,
        shapes: list,
        version: int,
        group_name: str = "weight_update_group",
        last: bool = True,
    ) -> None:
        await self.engine.update_weights_from_distributed(names, dtypes, shapes, version, group_name, last)

    @endpoint
    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self.engine.destroy_weights_update_group(group_name)

    @endpoint(concurrent=True)
    async def pause(self) -> None:
        await self.engine.pause()

    @endpoint(concurrent=True)
    async def resume(self) -> None:
        await self.engine.resume()

    @endpoint(concurrent=True)
    async def abort(self, request_ids: list | None = None) -> int:
        return await self.engine.abort(request_ids)

    @endpoint(concurrent=True)
    async def health(self) -> dict:
        return await self.engine.health()

    @endpoint(concurrent=True)
    async def stats(self) -> dict:
        return await self.engine.stats()

    @endpoint(concurrent=True)
    async def events(self) -> list:
        return [
            list(e[:2]) + [list(e[2]) if isinstance(e[2], tuple) else e[2]] for e in getattr(self.engine, "events", [])
        ]

    async def __cleanup__(self, exc) -> None:
        if self.engine is not None:
            await self.engine.close()


async def _failed(e: Exception):
    raise e
